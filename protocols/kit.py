"""What every protocol here shares: stage errors and the transition check, the abort and
tamper errors, the fault vocabulary and the layout of member party ids.

Each protocol (:mod:`protocols.secagg`, :mod:`protocols.committee`, :mod:`protocols.dmm` with
its resharing) runs an explicit stage machine: a table of allowed moves checked by
:func:`check_move` before any stage change, so a handler called out of order raises
:class:`StageError` and changes nothing. A round that ends without releasing raises a
:class:`RoundAborted` (:class:`TooManyDropoutsError` when too few parties answered); released
shares that fail their consistency checks beyond what can be corrected raise
:class:`TamperingDetected`. Injected faults (simulation) are named by :class:`Fault`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import numpy as np

MEMBER_ID_BASE = 2**62
"""Channel id of committee member j is ``MEMBER_ID_BASE + j`` (:mod:`protocols.committee`), as
is that of the old committee's member j in a resharing (:data:`OLD_ID_BASE`); client ids lie
below ``2**62`` and the server is :data:`protocols.channels.SERVER_ID`."""
OLD_ID_BASE = MEMBER_ID_BASE
"""Channel id of member j of the committee that deals in a resharing: ``OLD_ID_BASE + j``."""
NEW_ID_BASE = MEMBER_ID_BASE + 2**40
"""Channel id of member j of the committee that receives in a resharing: ``NEW_ID_BASE + j``."""
SEAT_ID_BASE = MEMBER_ID_BASE + 2**41
"""Channel id of DMM committee seat j: ``SEAT_ID_BASE + j`` (:mod:`protocols.dmm`)."""


class StageError(RuntimeError):
    """A handler was called out of order."""


class RoundAborted(RuntimeError):
    """The round ended in ABORTED: nothing was released."""


class TooManyDropoutsError(RoundAborted):
    """Too few parties answered for the round to complete; the round is aborted."""


class TamperingDetected(RuntimeError):
    """Shares that must lie on one polynomial do not, and correcting them would go beyond the
    sound decoding radius: nothing is decoded. ``suspects``: the party ids or member indices
    caught (empty when nobody can be named without risking an honest one); ``blocks``: the
    blocks that failed, where the protocol reports them; ``excluded``: client -> reason, the
    clients left out before it; ``opened``: the protocol's record of the values the server
    already holds (a server colluding with the tampering member decodes the others, so they
    count as released), else None."""

    excluded: Mapping[int, str] = {}
    opened: Any = None

    def __init__(
        self, message: str, suspects: tuple[int, ...] = (), *, blocks: np.ndarray | None = None
    ) -> None:
        super().__init__(message)
        self.suspects = suspects
        self.blocks = blocks


class Fault(StrEnum):
    """How a faulty member misbehaves at a stage (simulation): it drops (silent from then on),
    is late (its answer misses the deadline) or tampers (a non-zero offset added to what it
    holds or sends). A :class:`~enum.StrEnum`: ``Fault.DROP == "drop"``."""

    DROP = "drop"
    LATE = "late"
    TAMPER = "tamper"


def check_move(
    transitions: Mapping[Any, frozenset[Any]], current: Any, target: Any, who: str
) -> None:
    """Raise :class:`StageError` unless ``current -> target`` is in ``transitions``
    (the check every protocol state machine here makes before it changes stage)."""
    if target not in transitions[current]:
        allowed = sorted(stage.name for stage in transitions[current]) or ["none (final)"]
        raise StageError(
            f"{who} is in stage {current.name}; cannot move to {target.name} "
            f"(allowed: {', '.join(allowed)})"
        )
