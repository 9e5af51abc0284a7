"""A run's privacy ledger: its events in round order, epsilon on demand, and its JSON form.

Strategies record one ``dp_accounting`` event per release (noise multipliers ``std / C``, see
:mod:`fedsim.privacy.accountant`); the ledger composes them -- all of them for sampled rounds,
the worst rounds one client can be in under b-min-separation -- and writes a checkpoint whose
events go through :mod:`fedsim.privacy.events`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import dp_accounting as dpa

from fedsim.config import ConfigError, require
from fedsim.privacy.accountant import (
    ACCOUNTANTS,
    Accountant,
    account,
    accountant_kind,
    supports,
    unsupported,
)
from fedsim.privacy.events import check_event, event_from_dict, event_to_dict
from fedsim.privacy.participation import Participation
from fedsim.privacy.round_events import effective_noise_multiplier
from fedsim.privacy.sampling import NeighbouringRelation, check_delta, is_int

LEDGER_FORMAT = "fedsim.privacy_ledger/1"


def _grouped(events: Sequence[dpa.DpEvent]) -> dpa.DpEvent:
    """The composition of ``events`` with equal events merged into one ``SelfComposedDpEvent``.

    Composition is commutative, so this is the same mechanism; dp_accounting then computes each
    distinct event's RDP curve / PLD once instead of once per round (a 1000-round ledger would
    otherwise take tens of seconds).
    """
    counts: dict[str, list[Any]] = {}
    for event in events:
        key = json.dumps(event_to_dict(event), sort_keys=True)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [event, 1]
    parts = [e if c == 1 else dpa.SelfComposedDpEvent(e, c) for e, c in counts.values()]
    return parts[0] if len(parts) == 1 else dpa.ComposedDpEvent(parts)


class PrivacyLedger:
    """The privacy events of one run, in round order; epsilon on demand.

    Entries are ``(round, event)`` with immutable ``dp_accounting`` events (a round may record
    several, or one composed event, e.g. an adaptive-clipping round's two Gaussians). Each
    event's noise multipliers are ``std / C`` (module docstring); ``relation`` says which
    neighbours the run's guarantee is for and is applied when accounting.

    ``participation``: ``None`` (default) composes every recorded event -- right for sampled
    rounds, where every client may be in every round. With a b-min-separation
    :class:`~fedsim.privacy.participation.Participation` (kind ``min_sep``), rounds must
    record Gaussian events without sampling, and epsilon composes the worst set of rounds one
    client can be in: the ``m = min(k, most rounds pickable b apart)`` rounds (k None: as many
    as fit) with the smallest effective noise multipliers (a Gaussian with smaller ``z``
    dominates one with larger ``z``; ignoring the spacing of those ``m`` rounds can only
    overstate epsilon).
    """

    __slots__ = ("_relation", "_delta", "_participation", "_entries")

    def __init__(
        self,
        relation: NeighbouringRelation | str,
        delta: float,
        participation: Participation | None = None,
    ) -> None:
        self._relation = NeighbouringRelation.parse(relation)
        self._delta = check_delta(delta)
        require(
            participation is None
            or (isinstance(participation, Participation) and participation.kind == "min_sep"),
            "participation",
            participation,
            "None or a b-min-separation Participation (Participation.separated(b, k))",
        )
        self._participation = participation
        self._entries: list[tuple[int, dpa.DpEvent]] = []

    @property
    def relation(self) -> NeighbouringRelation:
        return self._relation

    @property
    def delta(self) -> float:
        """The run's target delta (default for :meth:`epsilon`)."""
        return self._delta

    @property
    def participation(self) -> Participation | None:
        return self._participation

    @property
    def entries(self) -> tuple[tuple[int, dpa.DpEvent], ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(relation={self._relation.value!r}, delta={self._delta!r}, "
            f"participation={self._participation!r}, entries={len(self._entries)})"
        )

    def _check_entry(self, round: int, event: dpa.DpEvent) -> None:  # noqa: A002
        last = self._entries[-1][0] if self._entries else 0
        require(
            is_int(round) and round >= last,
            "round",
            round,
            f"an integer >= {last} (rounds are recorded in order)",
        )
        check_event(event)
        if self._participation is not None:
            require(
                effective_noise_multiplier(event) is not None
                or isinstance(event, dpa.NonPrivateDpEvent),
                "event",
                event,
                "Gaussian events without sampling (the ledger's participation is b-min-separation)",
            )
        if not any(supports(event, acc, self._relation) for acc in ACCOUNTANTS):
            raise unsupported(event, "rdp", self._relation, "this event")

    def record(self, round: int, event: dpa.DpEvent) -> None:  # noqa: A002
        """Append ``event`` for ``round`` (>= the last recorded round), after checking it."""
        self._check_entry(round, event)
        self._entries.append((round, event))

    def _worst_case(self, entries: Sequence[tuple[int, dpa.DpEvent]]) -> dpa.DpEvent:
        if not entries:
            return dpa.NoOpDpEvent()
        if self._participation is None:
            return _grouped([e for _, e in entries])
        precision: dict[int, float] = {}  # round -> sum of z^-2 (inf: no noise)
        for r, e in entries:
            z = 0.0 if isinstance(e, dpa.NonPrivateDpEvent) else effective_noise_multiplier(e)
            if z is None:  # unreachable: record() checks
                raise ConfigError("event", e, "a Gaussian event without sampling")
            if math.isinf(z):
                continue
            precision[r] = precision.get(r, 0.0) + (math.inf if z == 0 else z**-2)
        pickable, last = 0, None
        for r in sorted(precision):
            if last is None or r - last >= self._participation.min_sep:
                pickable, last = pickable + 1, r
        k = self._participation.max_participations
        m = pickable if k is None else min(k, pickable)
        worst = sorted(precision.values(), reverse=True)[:m]
        return dpa.ComposedDpEvent(
            [
                dpa.NonPrivateDpEvent() if math.isinf(p) else dpa.GaussianDpEvent(p**-0.5)
                for p in worst
            ]
        )

    def worst_case_event(self) -> dpa.DpEvent:
        """One event that bounds everything recorded for the worst-placed participant (all
        entries composed, or, with a b-min-separation participation, its worst rounds)."""
        return self._worst_case(self._entries)

    def epsilon(self, delta: float | None = None, accountant: Accountant = "rdp") -> float:
        """Epsilon (nats) at ``delta`` (default: the ledger's) of everything recorded."""
        delta = self._delta if delta is None else check_delta(delta)
        accountant = accountant_kind(accountant).name
        return account(
            self._worst_case(self._entries),
            accountant,
            self._relation,
            delta,
            "the recorded events",
        )

    def epsilon_if(
        self,
        event: dpa.DpEvent,
        delta: float | None = None,
        accountant: Accountant = "rdp",
        round: int | None = None,  # noqa: A002
    ) -> float:
        """Epsilon if ``event`` were recorded next (for ``round``, default last + 1).

        For stopping a run before a round would exceed its budget; records nothing.
        """
        if round is None:
            round = self._entries[-1][0] + 1 if self._entries else 0  # noqa: A001
        self._check_entry(round, event)
        delta = self._delta if delta is None else check_delta(delta)
        accountant = accountant_kind(accountant).name
        entries = [*self._entries, (round, event)]
        return account(
            self._worst_case(entries), accountant, self._relation, delta, "the recorded events"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready checkpoint of the ledger (events via :mod:`fedsim.privacy.events`)."""
        p = self._participation
        return {
            "format": LEDGER_FORMAT,
            "relation": self._relation.value,
            "delta": self._delta,
            "participation": None
            if p is None
            else {
                "min_separation": p.min_sep,
                "max_participations": p.max_participations,
            },
            "entries": [{"round": r, "event": event_to_dict(e)} for r, e in self._entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger written by :meth:`to_dict`, checking every field."""
        require(isinstance(data, Mapping), "ledger", data, "a JSON object")
        require(
            data.get("format") == LEDGER_FORMAT,
            "ledger.format",
            data.get("format"),
            repr(LEDGER_FORMAT),
        )
        known = {"format", "relation", "delta", "participation", "entries"}
        for key in sorted(set(data) - known):
            raise ConfigError(f"ledger.{key}", data[key], f"a known key: {sorted(known)}")
        p = data.get("participation")
        participation = None
        if p is not None:
            require(
                isinstance(p, Mapping) and set(p) == {"min_separation", "max_participations"},
                "ledger.participation",
                p,
                "null or {min_separation, max_participations}",
            )
            participation = Participation.separated(p["min_separation"], p["max_participations"])
        ledger = cls(
            NeighbouringRelation.parse(data.get("relation"), "ledger.relation"),
            check_delta(data.get("delta"), "ledger.delta"),
            participation,
        )
        entries = data.get("entries")
        require(isinstance(entries, list), "ledger.entries", entries, "a list")
        for i, item in enumerate(entries):
            key = f"ledger.entries[{i}]"
            require(
                isinstance(item, Mapping) and set(item) == {"round", "event"},
                key,
                item,
                "an object with keys round, event",
            )
            ledger.record(item["round"], event_from_dict(item["event"], f"{key}.event"))
        return ledger
