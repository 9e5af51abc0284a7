"""What a DMM member group is built with and what it keeps between its calls.

:class:`GroupContext` holds a group's fixed parts: its seats, the packed Shamir scheme, the
public :class:`~protocols.dmm.common.Schedule` of M, D, ``min_clients``, its seats' enrolment
identities, the enrolment authority's verifier, the public draw of the next committee and the
seats' own randomness (:class:`MemberSecrets`). :class:`GroupState` is the stored state value
the stage handlers (:mod:`protocols.dmm.stages`, :mod:`protocols.dmm.reshare_stages`) take and
return: the committed part (step, partial-sum shares, retired) and the round's part (stage,
role, channels, opened rows, combined sums, deals received).

Two kinds of objects inside a state are held by reference, not as values: the round's channel
:class:`~protocols.channels.Endpoint` objects (their nonce counters and records of opened
messages must only move forward: a state value handed back must never rewind them, so a replay
stays refused) and the seats' resharing Generators (their streams, likewise, are drawn once).
Everything else is replaced, never changed in place: a handler that raises leaves the state it
was given as it was.

The helpers here are what every handler checks first: :func:`expect` (the stage and role a
request needs) and :func:`moved` (the stage move, :func:`protocols.dmm.common.check_transition`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Protocol

import numpy as np

from protocols.channels import ChannelError, Endpoint, Envelope
from protocols.dmm.common import DMMStage, MemberRefused, Schedule, check_transition
from protocols.dmm.resharing import NewMember
from protocols.dmm.rows import row_decoder
from protocols.enrolment import Certificate, Identity, KeyVerifier
from protocols.field import MersenneField
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, SEAT_ID_BASE, StageError
from protocols.shamir import PackedShamir

ROLE_BASES = {"current": SEAT_ID_BASE, "old": OLD_ID_BASE, "new": NEW_ID_BASE}
"""Role -> the base of its seats' channel ids (seat j of that role is ``base + j``)."""


class MemberSecrets(Protocol):
    """A host's supply of its seats' own randomness (each seat's secret stays with it)."""

    def channel_keys(self, round_: int, role: str) -> dict[int, bytes]:
        """Seat -> 32 bytes of its own secret for its channel key of ``round_`` as ``role``."""
        ...

    def reshare_rngs(self, round_: int) -> dict[int, np.random.Generator]:
        """Seat -> its own resharing Generator for ``round_``."""
        ...


def base_of(party: int) -> int:
    """The role base a channel id lies above (the highest not above it)."""
    return max(base for base in ROLE_BASES.values() if base <= party)


@dataclass(frozen=True, eq=False)
class GroupContext:
    """The fixed parts of a group: ``seats`` of one committee (distinct, in [0, n)), its
    ``scheme``, the ``schedule`` of M, ``dim`` (D), ``min_clients``, ``identities`` (seat ->
    its enrolment :class:`~protocols.enrolment.Identity`, for the seats that sign their keys),
    ``verifier`` (the enrolment authority's, None: peers' keys taken as relayed),
    ``next_names`` (round -> the enrolled names, seat order, of that round's public committee;
    None: any distinct enrolled party) and ``secrets`` (None: the OS's randomness)."""

    seats: tuple[int, ...]
    scheme: PackedShamir
    schedule: Schedule
    dim: int
    min_clients: int = 1
    identities: Mapping[int, Identity] = field(default_factory=dict)
    verifier: KeyVerifier | None = None
    next_names: Callable[[int], Sequence[str]] | None = None
    secrets: MemberSecrets | None = None

    @classmethod
    def build(
        cls,
        seats: Sequence[int],
        *,
        n: int,
        t: int,
        k: int,
        field_exponent: int,
        dim: int,
        matrix,
        min_clients: int = 1,
        identities: Mapping[int, tuple[bytes, bytes]] | None = None,
        authority: bytes | None = None,
        next_names: Callable[[int], Sequence[str]] | None = None,
        secrets: MemberSecrets | None = None,
    ) -> GroupContext:
        """The context of :class:`protocols.dmm.member.MemberGroup`'s arguments; a bad one
        raises ValueError naming it, its value and what is allowed. ``identities``: seat ->
        (its identity seed, its certificate bytes), for the seats here that sign their keys
        (others are ignored); ``authority``: the enrolment authority's public key, under which
        peers' member keys are checked (None: taken as relayed); ``next_names``: round -> the
        enrolled names, seat order, of the committee the public draw makes for that round: a
        dealer of round r deals to seat j of the next committee only under a proof signed by
        ``next_names(r + 1)[j]`` (None: any distinct enrolled party); ``secrets``: the seats'
        own randomness (channel keys and resharing streams) where no request passes it (None:
        the OS's)."""
        scheme = PackedShamir(int(n), int(t), int(k), MersenneField(int(field_exponent)))
        listed = [int(s) for s in seats]
        signing = {
            int(s): Identity.from_seed(seed, Certificate.from_bytes(cert))
            for s, (seed, cert) in (identities or {}).items()
            if int(s) in listed
        }
        verifier = None if authority is None else KeyVerifier(authority)
        if not listed or len(set(listed)) != len(listed):
            raise ValueError(f"seats={seats!r}; allowed: distinct seats in [0, n={n})")
        if min(listed) < 0 or max(listed) >= scheme.n:
            raise ValueError(f"seats={seats!r}; allowed: distinct seats in [0, n={n})")
        if not isinstance(dim, int | np.integer) or dim < 1:
            raise ValueError(f"dim={dim!r}; allowed: a positive integer")
        if not isinstance(min_clients, int | np.integer) or min_clients < 1:
            raise ValueError(f"min_clients={min_clients!r}; allowed: an integer >= 1")
        return cls(
            tuple(listed), scheme, Schedule(matrix), int(dim), int(min_clients), signing,
            verifier, next_names, secrets,
        )

    @cached_property
    def blocks(self) -> int:
        """Blocks of k field elements one row of D values takes."""
        return self.scheme.blocks_for(self.dim)

    @cached_property
    def index(self) -> dict[int, int]:
        """Seat -> its row in the group's arrays."""
        return {s: a for a, s in enumerate(self.seats)}

    @property
    def shown(self) -> list[int]:
        """The seats as error messages name them."""
        return list(self.seats)

    def width(self, step: int) -> int:
        """Field elements per client per seat at ``step``: (1 + rows released) * blocks."""
        return (1 + len(self.schedule.released_at(step))) * self.blocks


@dataclass(frozen=True, eq=False)
class GroupState:
    """What a group keeps between calls. Committed: ``step`` (the next round it runs),
    ``partials`` (row of M -> (len(seats), blocks) shares of its partial sum), ``retired``.
    The round's: ``stage`` and ``role`` ('current', 'old', 'new' or None), ``round`` (-1:
    none), ``endpoints`` (seat -> its channel, held by reference), ``proofs`` (seat -> the
    enrolment proof of its key), ``unverified`` (party -> why its key was refused),
    ``online`` (the seats still answering), ``received`` (client party -> its opened rows),
    ``carried`` (party -> the clients whose pads were removed from its message; 1: its own),
    ``release`` and ``tentative`` (COMBINE's shares of the released rows and of the updated
    partial sums), ``reshare_rngs`` (seat -> its resharing Generator, held by reference),
    ``incoming`` (seat -> the deals it received, a :class:`~protocols.dmm.resharing.NewMember`)
    and ``handed`` (the accumulated rows it will commit)."""

    step: int = 0
    partials: Mapping[int, np.ndarray] = field(default_factory=dict)
    retired: bool = False
    stage: DMMStage = DMMStage.SETUP
    role: str | None = None
    round: int = -1
    endpoints: Mapping[int, Endpoint] = field(default_factory=dict)
    proofs: Mapping[int, bytes] = field(default_factory=dict)
    unverified: Mapping[int, str] = field(default_factory=dict)
    online: frozenset[int] = frozenset()
    received: Mapping[int, np.ndarray] = field(default_factory=dict)
    carried: Mapping[int, int] = field(default_factory=dict)
    tentative: Mapping[int, np.ndarray] | None = None
    release: np.ndarray | None = None
    reshare_rngs: Mapping[int, np.random.Generator] = field(default_factory=dict)
    incoming: Mapping[int, NewMember] = field(default_factory=dict)
    handed: np.ndarray | None = None

    def cleared(self) -> GroupState:
        """The committed part only: the round's fields back to their start (SETUP, no role)."""
        return GroupState(step=self.step, partials=self.partials, retired=self.retired)


def expect(context: GroupContext, state: GroupState, stage: DMMStage, role: str) -> None:
    """StageError unless ``state`` is live in ``stage`` as ``role``."""
    if state.retired or state.stage is not stage or state.role != role:
        raise StageError(
            f"DMM members {context.shown} are in stage {state.stage.name} as {state.role!r}; "
            f"this request needs stage {stage.name} as {role!r}"
        )


def moved(
    context: GroupContext, state: GroupState, target: DMMStage, role: str | None = None
) -> GroupState:
    """``state`` moved to ``target`` (as ``role`` when given): MemberRefused for a retired
    group or another role, StageError for a move :data:`protocols.dmm.common.TRANSITIONS`
    does not allow."""
    if state.retired:
        raise MemberRefused(f"members {context.shown} retired: they hold nothing any more")
    if role is not None and state.role is not None and state.role != role:
        raise MemberRefused(f"members {context.shown} act as {state.role!r}, not {role!r}")
    check_transition(state.stage, target, f"DMM members {context.shown}")
    return replace(state, stage=target, role=state.role if role is None else role)


def own_seats(context: GroupContext, seats, name: str) -> list[int]:
    """The seats of this group among ``seats`` (the argument ``name``), sorted."""
    try:
        out = sorted({int(s) for s in seats})
    except (TypeError, ValueError):
        raise MemberRefused(f"{name}={seats!r}; allowed: seat numbers") from None
    return [s for s in out if s in context.index]


def offset_row(
    context: GroupContext, step: int, row: np.ndarray, seat: int, seed: int, salt: int
) -> np.ndarray:
    """``row`` plus seat ``seat``'s non-zero public offset of ``step`` (simulated tampering;
    ``salt`` 1: COMBINE, 2: RELEASE, 3: DEAL)."""
    f = context.scheme.field
    offsets = np.random.default_rng([int(seed), salt, step, seat])
    return f.add(row, offsets.integers(1, f.modulus, size=row.shape[-1]))


def offset(
    context: GroupContext, step: int, rows: np.ndarray, who, seed: int, salt: int
) -> np.ndarray:
    """``rows`` with :func:`offset_row` added to the rows of the seats ``who``."""
    rows = rows.copy()
    for s in sorted(set(who) & set(context.seats)):
        a = context.index[s]
        rows[a] = offset_row(context, step, rows[a], s, seed, salt)
    return rows


def open_row(
    context: GroupContext, state: GroupState, seat: int, item, stage: Enum, sender: int, width: int
) -> np.ndarray:
    """What ``sender`` sent seat ``seat`` at ``stage``: ``width`` field elements, opened from
    its envelope (a plain array only in a round without channels); ChannelError otherwise."""
    if isinstance(item, Envelope):
        endpoint = state.endpoints.get(seat)
        if endpoint is None:
            raise ChannelError(f"seat {seat} has no channel this round")
        opened = endpoint.open_array(
            item, round_=state.round, stage=stage, sender=sender, decode=row_decoder(width)
        )
    elif not state.endpoints and isinstance(item, np.ndarray):
        opened = item
    else:
        raise ChannelError(f"seat {seat} received a {type(item).__name__}, not an Envelope")
    if opened.ndim != 1 or opened.shape[0] != width:
        raise ChannelError(f"a row of {opened.shape} field elements; expected ({width},)")
    return context.scheme.field.asarray(opened, "share")
