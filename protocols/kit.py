"""What every protocol here shares: stage errors and the transition check, the abort and
tamper errors, the fault vocabulary and the layout of member party ids.

Each protocol (:mod:`protocols.secagg`, :mod:`protocols.committee`, :mod:`protocols.dmm` with
its resharing) runs an explicit stage machine: a table of allowed moves checked by
:func:`check_move` before any stage change, so a handler called out of order raises
:class:`StageError` and changes nothing. A round that ends without releasing raises a
:class:`RoundAborted` (:class:`TooManyDropoutsError` when too few parties answered); released
shares that fail their consistency checks beyond what can be corrected raise
:class:`TamperingDetected`. Injected faults (simulation) are named by :class:`Fault`.

Members are reached by typed calls: each protocol declares its member side
(:class:`MemberSide`: the call enums its members answer, what a gone or refusing member answers,
which errors are refusals), and each member object answers ``member.answer(call, args)``.
:class:`LocalMembers` hosts a committee's groups in this process; the engine hosts them on Ray
actors through the same interface (:mod:`fedsim.engine.committee_host`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

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


class Member(Protocol):
    """A group of a committee's members as a host reaches it: one entry point, typed calls."""

    def answer(self, call: StrEnum, args: tuple) -> Any:
        """The reply of this group to ``call`` (a member of its side's call enums) with ``args``."""
        ...


@dataclass(frozen=True)
class MemberSide:
    """A protocol's member side as a host sees it. ``calls``: the call enums its members answer
    (a call of another type is a programming error); ``silent``: call -> what a gone group (its
    process died) or a refusing one answers; a call not listed has no silent answer, so its
    error reaches the server; ``refusals``: the errors by which a member refuses a request (its
    group is then silent for that call and the reason kept)."""

    calls: tuple[type[StrEnum], ...]
    silent: Mapping[StrEnum, Any] = field(default_factory=dict)
    refusals: tuple[type[BaseException], ...] = ()

    def check(self, call: Any) -> None:
        """Raise ``TypeError`` unless ``call`` is one of this side's calls."""
        if not isinstance(call, self.calls):
            names = ", ".join(c.__name__ for c in self.calls)
            raise TypeError(f"{call!r} is not a member call; allowed: a member of {names}")

    def refusal(self, error: BaseException) -> BaseException | None:
        """The refusal ``error`` is or wraps (a remote error's ``cause``), else None."""
        for candidate in (error, getattr(error, "cause", None)):
            if isinstance(candidate, self.refusals):
                return candidate
        return None


class LocalMembers:
    """A committee's groups in this process: ``groups[g]`` (the seats or member indices group g
    holds) answered by ``objects[g]`` (a :class:`Member`) under ``side``. :meth:`call` sends
    each group its call and collects the replies in group order; a group that refuses answers
    ``side.silent[call]`` and the refusal is kept in :attr:`refusals` as (group, call, reason).
    Subclasses reach the groups elsewhere (:meth:`_submit`, :meth:`_wait`, :meth:`_died`)."""

    def __init__(
        self, side: MemberSide, groups: Sequence[Sequence[int]], objects: Sequence[Any]
    ) -> None:
        self.side = side
        self.groups = [[int(m) for m in g] for g in groups]
        self.objects = list(objects)
        if len(self.objects) != len(self.groups):
            raise ValueError(
                f"{len(self.objects)} members for {len(self.groups)} groups; allowed: one per group"
            )
        self.dead: set[int] = set()
        self.refusals: list[tuple[int, StrEnum, str]] = []

    def _submit(self, g: int, call: StrEnum, args: tuple) -> Any:
        """Start ``call`` at group g; what :meth:`_wait` turns into its reply."""
        return functools.partial(self.objects[g].answer, call, args)

    def _wait(self, pending: Any) -> Any:
        return pending()

    def _died(self, g: int, error: BaseException) -> bool:
        """Whether ``error`` says group g's process died (never, in this process)."""
        return False

    def _collect(self, g: int, call: StrEnum, pending: Any) -> Any:
        try:
            return self._wait(pending)
        except Exception as error:
            if call not in self.side.silent:
                raise
            refused = self.side.refusal(error)
            if refused is not None:
                self.refusals.append((g, call, str(refused)))
            elif self._died(g, error):
                self.dead.add(g)
            else:
                raise
        return self.side.silent[call]

    def call(self, call: StrEnum, args_per_group: Sequence[tuple]) -> list[Any]:
        """``call`` at every group with its arguments (all started before any is awaited); the
        replies in group order, a dead group's ``side.silent`` answer."""
        self.side.check(call)
        pending = [
            None if g in self.dead else self._submit(g, call, tuple(args))
            for g, args in zip(range(len(self.groups)), args_per_group)
        ]
        return [
            self.side.silent.get(call) if p is None else self._collect(g, call, p)
            for g, p in enumerate(pending)
        ]

    def broadcast(self, call: StrEnum, *args: Any) -> list[Any]:
        """``call`` with the same arguments at every group."""
        return self.call(call, [args] * len(self.groups))

    def close(self) -> None:
        """Nothing to release in process."""


def answer_by(handlers: Mapping[StrEnum, Callable[..., Any]], call: StrEnum, args: tuple) -> Any:
    """``handlers[call](*args)``: a member's dispatch of a typed call to its handler."""
    handler = handlers.get(call)
    if handler is None:
        raise TypeError(f"{call!r} is not answered here; allowed: {sorted(handlers)}")
    return handler(*args)
