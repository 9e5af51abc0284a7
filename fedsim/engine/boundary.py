"""The run's release boundary: every reply with client content is accounted, or counted.

The grid sees every reply that carries client-derived content to the server side (train,
evaluate and query replies; error replies carry none). It tells the :class:`ReleaseBoundary`
of each instruction it sent and each reply it handed over (:meth:`ReleaseBoundary.sent`,
:meth:`ReleaseBoundary.delivered`; a worker-folded reply covers every instruction of its
batches). What consumed a reply says so, by the instruction it answers:

* an accounted mechanism (a DP strategy's noised aggregate, a secure sum's release) calls
  :meth:`ReleaseBoundary.claim` with the replies it aggregated: the release is in its ledger;
* a trusted mechanism that consumed replies and released nothing of them (central DP's
  evaluation metrics, kept from the ServerApp) calls :meth:`ReleaseBoundary.withhold`.

A reply is consumed once: a second claim of it is refused (:class:`ClaimRefused`), so a
reply handed to an aggregate twice cannot halve its noise. A reply that nothing claimed is an
*unaccounted release*: the ServerApp's own code received client content that no mechanism
accounts for, and the run's epsilon is infinite (:meth:`ReleaseBoundary.report`).

Mechanisms register (:meth:`ReleaseBoundary.register`); the run's epsilon composes every
registered mechanism's ledger (:func:`fedsim.privacy.composition.run_epsilon`): several
strategies started one after the other, several phases. A mechanism that predates claims
(``claims_replies`` false) is given the replies delivered while fedsim's round loop runs its
hooks (:meth:`ReleaseBoundary.scope`): those are consumed in its name when its round ends.
The boundary trusts the mechanisms that register: it holds ids, counts and ledgers, no
client content and no secret.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

from fedsim.engine.hooks import PrivacyReporting, find


class ClaimRefused(ValueError):
    """A claim of a reply that the grid never delivered, or that was already consumed."""


@dataclass
class _Delivered:
    """One reply handed to the server side: the instructions it answers (a worker fold's
    covers several), its phase's message type and round, who consumed it (None: nobody)."""

    covers: tuple[str, ...]
    message_type: str
    server_round: int | None
    owner: int | None = None
    consumer: str | None = None


@dataclass
class _Mechanism:
    obj: Any
    name: str
    claims: bool
    replies: int = 0


@dataclass
class ReleaseBoundary:
    """Instructions sent, replies delivered and who consumed them; the run's privacy report."""

    #: instruction id -> (node id, message type, server round)
    instructions: dict[str, tuple[int, str, int | None]] = field(default_factory=dict)
    #: reply key (the instruction id it answers) -> what was delivered
    replies: dict[str, _Delivered] = field(default_factory=dict)
    mechanisms: dict[int, _Mechanism] = field(default_factory=dict)
    #: unaccounted contributions of rounds already closed, by message type
    closed_unaccounted: dict[str, int] = field(default_factory=dict)
    _scope: int | None = None

    # -- what the grid reports ----------------------------------------------------------
    def sent(self, messages: Iterable[Message], server_round: int | None) -> None:
        """Instructions that left (their ids are set)."""
        for message in messages:
            meta = message.metadata
            self.instructions[meta.message_id] = (
                int(meta.dst_node_id),
                meta.message_type,
                server_round,
            )

    def delivered(self, reply: Message, covers: Iterable[str] | None = None) -> None:
        """``reply`` was handed to the server side; ``covers``: the instructions a folded
        reply answers (default: its own ``reply_to_message_id``). Error replies carry no
        client content and are not tracked."""
        if reply.has_error():
            return
        key = reply.metadata.reply_to_message_id
        ids = tuple(covers) if covers is not None else (key,)
        message_type, server_round = reply.metadata.message_type, None
        if key in self.instructions:
            _, message_type, server_round = self.instructions[key]
        self.replies[key] = _Delivered(ids, message_type, server_round, self._scope)

    def covers(self, reply: Message) -> tuple[str, ...] | None:
        """The instructions ``reply`` answers (a worker fold's: all of its batches'); None
        for a reply the grid never delivered."""
        entry = self.replies.get(reply.metadata.reply_to_message_id)
        return None if entry is None else entry.covers

    # -- mechanisms ---------------------------------------------------------------------
    def register(self, mechanism: Any) -> None:
        """``mechanism`` (an object with ``ledger``, ``accountant`` and ``epsilon()``) releases
        accounted aggregates in this run; idempotent."""
        if id(mechanism) not in self.mechanisms:
            self.mechanisms[id(mechanism)] = _Mechanism(
                mechanism,
                type(mechanism).__name__,
                bool(getattr(mechanism, "claims_replies", False)),
            )

    def _consume(self, replies: Iterable[Message], consumer: str) -> list[Message]:
        taken: list[Message] = []
        keys: set[str] = set()
        for reply in replies:
            if reply.has_error():
                continue
            key = reply.metadata.reply_to_message_id
            entry = self.replies.get(key)
            if entry is None:
                raise ClaimRefused(
                    f"{consumer}: a reply to {key or 'no instruction'!r} that the grid never "
                    "delivered (only replies the grid handed over can be consumed)"
                )
            if entry.consumer is not None or key in keys:
                raise ClaimRefused(
                    f"{consumer}: the reply to {key!r} was already consumed by "
                    f"{entry.consumer or consumer} (a reply is aggregated once)"
                )
            keys.add(key)
            taken.append(reply)
        for reply in taken:
            self.replies[reply.metadata.reply_to_message_id].consumer = consumer
        return taken

    def claim(self, replies: Iterable[Message], mechanism: Any) -> int:
        """``mechanism`` (registered) released an accounted aggregate of ``replies``; returns
        how many client contributions they cover. :class:`ClaimRefused` if one was never
        delivered or already consumed (then none is claimed)."""
        self.register(mechanism)
        entry = self.mechanisms[id(mechanism)]
        taken = self._consume(replies, entry.name)
        covered = sum(len(self.replies[r.metadata.reply_to_message_id].covers) for r in taken)
        entry.replies += covered
        return covered

    def withhold(self, replies: Iterable[Message], holder: str) -> None:
        """``holder`` consumed ``replies`` and released nothing of them."""
        self._consume(replies, f"{holder} (withheld)")

    @contextmanager
    def scope(self, mechanism: Any) -> Iterator[None]:
        """Replies delivered inside the block are ``mechanism``'s (fedsim's round loop runs a
        registered strategy's hooks in it). On exit, a mechanism that does not claim replies
        itself consumes the ones it was given."""
        self.register(mechanism)
        outer, self._scope = self._scope, id(mechanism)
        try:
            yield
        finally:
            self._scope = outer
            entry = self.mechanisms[id(mechanism)]
            if not entry.claims:
                for reply in self.replies.values():
                    if reply.owner == id(mechanism) and reply.consumer is None:
                        reply.consumer = entry.name
                        entry.replies += len(reply.covers)

    # -- the run's report ---------------------------------------------------------------
    @property
    def private(self) -> bool:
        """Whether an accounted mechanism took part (the run has a protected unit)."""
        return bool(self.mechanisms)

    def unaccounted(self) -> dict[str, int]:
        """Client contributions delivered and never consumed, by message type."""
        out = dict(self.closed_unaccounted)
        for reply in self.replies.values():
            if reply.consumer is None:
                kind = reply.message_type.split(".")[0]
                out[kind] = out.get(kind, 0) + len(reply.covers)
        return out

    def close_round(self) -> None:
        """A round's record was written: what nobody consumed stays counted, the ids are
        forgotten (a later claim of one of them is refused as never delivered), so the
        boundary holds O(one round)."""
        self.closed_unaccounted = self.unaccounted()
        self.replies.clear()
        self.instructions.clear()

    def report(self) -> dict[str, Any]:
        """The run's privacy: epsilon composed over every registered mechanism (infinite with
        any unaccounted release), how many releases went unaccounted, how many mechanisms."""
        from fedsim.privacy.composition import run_epsilon  # noqa: PLC0415 - dp_accounting

        unaccounted = self.unaccounted()
        composed = run_epsilon([m.obj for m in self.mechanisms.values()])
        out: dict[str, Any] = {
            "epsilon": composed.epsilon,
            "unaccounted_releases": sum(unaccounted.values()),
        }
        if unaccounted:
            out["epsilon"] = float("inf")
            out["unaccounted"] = dict(sorted(unaccounted.items()))
        if len(self.mechanisms) > 1:
            out["mechanisms"] = [m.name for m in self.mechanisms.values()]
            out["composition"] = composed.how
        return out


def boundary_of(grid: Any) -> ReleaseBoundary | None:
    """The grid's release boundary (None: a grid without one, e.g. Flower's own runtime)."""
    boundary = getattr(grid, "boundary", None)
    return boundary if isinstance(boundary, ReleaseBoundary) else None


def mechanism_of(strategy: Any) -> PrivacyReporting | None:
    """The layer of ``strategy``'s wrapper chain that holds the privacy ledger (the first
    :class:`~fedsim.engine.hooks.PrivacyReporting` one), or None for a strategy without one."""
    return find(strategy, PrivacyReporting)
