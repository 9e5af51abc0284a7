"""What one committee shard keeps of one round between its stages, as an immutable value.

:class:`ShardState` is the per-round state of :class:`protocols.committee.member.CommitteeShard`
that the stage handlers of :mod:`protocols.committee.stages` take and return: where the round
stands, the row width, the rows each client shared with the shard's members (SHARE), their sum
(COMBINE) and the members that went offline. The shard's long-lived parts (its members, field and
channel endpoints) are not in it: they are the handlers' context
(:class:`protocols.committee.stages.ShardContext`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.committee.common import CommitteeStage


def _read_only(value: Any, name: str) -> np.ndarray:
    """A read-only view of ``value`` (a numpy array), or TypeError naming ``name``."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} is {type(value).__name__}; allowed: a numpy array")
    view = value.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class ShardState:
    """One shard's state of one round. ``stage``: where the round stands (SETUP before its
    first message); ``width``: field elements per row (None until SHARE fixes it); ``rows``:
    client -> its rows for this shard's members (one row per member, zeros where a member
    refused its share), held from SHARE until COMBINE; ``total``: the members' summed rows,
    held from COMBINE until RELEASE (None otherwise); ``offline``: the members that dropped.

    A value: its arrays are read-only views and its mapping its own copy, so a handler
    returns a new state and the old one is left as it was. Two states are equal when their
    stages, widths, offline sets, clients and arrays are."""

    stage: CommitteeStage = CommitteeStage.SETUP
    width: int | None = None
    rows: Mapping[int, np.ndarray] = field(default_factory=dict)
    total: np.ndarray | None = None
    offline: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.stage, CommitteeStage):
            raise TypeError(f"stage={self.stage!r}; allowed: a CommitteeStage")
        width = self.width
        if width is not None and (
            isinstance(width, bool) or not isinstance(width, int | np.integer) or width < 0
        ):
            raise ValueError(f"width={width!r}; allowed: None or an integer >= 0")
        if not isinstance(self.rows, Mapping):
            raise TypeError(f"rows is {type(self.rows).__name__}; allowed: client -> array")
        if not isinstance(self.offline, frozenset):
            raise TypeError(f"offline is {type(self.offline).__name__}; allowed: a frozenset")
        rows = {int(c): _read_only(r, f"rows[{c}]") for c, r in self.rows.items()}
        object.__setattr__(self, "rows", rows)
        if width is not None:
            object.__setattr__(self, "width", int(width))
        if self.total is not None:
            object.__setattr__(self, "total", _read_only(self.total, "total"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardState):
            return NotImplemented
        same = (self.stage, self.width, self.offline, sorted(self.rows)) == (
            other.stage,
            other.width,
            other.offline,
            sorted(other.rows),
        )
        if not same or (self.total is None) != (other.total is None):
            return False
        if self.total is not None and not np.array_equal(self.total, other.total):
            return False
        return all(np.array_equal(self.rows[c], other.rows[c]) for c in self.rows)

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal by value, not hashable


ABORTED = ShardState(CommitteeStage.ABORTED)
"""A round the driver aborted: nothing of it kept."""
DONE = ShardState(CommitteeStage.DONE)
"""A released round: nothing of it kept."""
