"""A DMM member group's RESHARE as stage handlers ``handle_<call>(context, state, message) ->
(state, reply)`` (docs/dmm-design.md, step 7; the resharing in :mod:`protocols.dmm.resharing`).

As the *old* committee (entered by :func:`protocols.dmm.stages.handle_announce_handoff` with
role 'old'): :func:`handle_deal` re-shares each seat's partial-sum shares, scaled by its
Lagrange column, to the next committee (:class:`~protocols.dmm.resharing.OldMember`), then
:func:`handle_retire`, or :func:`handle_keep` when the handoff fails. As the *next* committee
(role 'new'): :func:`handle_receive`, :func:`handle_accumulate`, :func:`handle_check_shares`
and :func:`handle_commit` (:class:`~protocols.dmm.resharing.NewMember`), or
:func:`handle_discard`. The contract is :mod:`protocols.dmm.stages`': the stage is checked
first, and a handler that raises returns no new state. The seats' resharing Generators are
held by reference in the state (:mod:`protocols.dmm.state`): a deal draws from them once,
whatever follows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from protocols.channels import ChannelError, Envelope
from protocols.dmm.common import DMMStage, MemberRefused, refusing
from protocols.dmm.resharing import NewMember, OldMember, ShareRandomness
from protocols.dmm.rows import row_decoder
from protocols.dmm.state import GroupContext, GroupState, expect, moved, offset_row, own_seats
from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, StageError

Reply = tuple[GroupState, Any]


@dataclass(frozen=True, eq=False)
class Deal:
    """DEAL: ``columns`` (seat -> its Lagrange column, k field elements, or None: the check
    block only), the check vector ``mix`` (one field element per block of the rows still
    open), the next committee's seats ``receivers``, the seats that ``tamper`` (from
    ``seed``), and ``rngs`` (seat -> its Generator; None: the state's, else the OS)."""

    columns: Mapping[int, np.ndarray | None]
    mix: np.ndarray
    receivers: Sequence[int]
    tamper: Sequence[int]
    seed: int
    rngs: Mapping[int, np.random.Generator] | None = None


@dataclass(frozen=True)
class Retire:
    """RETIRE: the handoff succeeded; the old committee forgets everything."""


@dataclass(frozen=True)
class Keep:
    """KEEP: the release stands but the handoff failed."""


@dataclass(frozen=True)
class Discard:
    """DISCARD: the round aborted."""


@dataclass(frozen=True)
class Receive:
    """RECEIVE: ``deliveries[seat][dealer]``, a deal for an online seat."""

    deliveries: Mapping[int, Mapping[int, object]]


@dataclass(frozen=True)
class Accumulate:
    """ACCUMULATE: the dealers ``chosen`` (the t + k whose deals are summed)."""

    chosen: Sequence[int]


@dataclass(frozen=True, eq=False)
class CheckShares:
    """CHECK_SHARES (VERIFY): the parity ``checks`` (one row per check, one column per
    dealer of ``candidates``)."""

    checks: np.ndarray
    candidates: Sequence[int]


@dataclass(frozen=True)
class Commit:
    """COMMIT: the handoff succeeded; the accumulated rows become the state."""


def _deal_arguments(context: GroupContext, state: GroupState, message: Deal):
    """(mix, receivers, columns, tamper, seed) of ``message``, checked."""
    f = context.scheme.field
    mix = f.asarray(message.mix, "mix")
    keep = context.schedule.open_after(state.step)
    if mix.shape != (len(keep) * context.blocks,):
        raise MemberRefused(f"mix has shape {mix.shape}; allowed ({len(keep) * context.blocks},)")
    receivers = [int(j) for j in message.receivers]
    if len(set(receivers)) != len(receivers) or not all(
        0 <= j < context.scheme.n for j in receivers
    ):
        raise MemberRefused(f"receivers={receivers}; allowed: distinct seats < n")
    columns = dict(message.columns)
    tamper = set(own_seats(context, message.tamper, "tamper"))
    return mix, receivers, columns, tamper, int(message.seed)


@refusing("deal")
def handle_deal(context: GroupContext, state: GroupState, message: Deal) -> Reply:
    """DEAL: each online seat in ``columns`` re-shares its shares of the rows still open (the
    combined partial sums), scaled by its column, for the ``receivers``; the reply is seat ->
    one row per receiver (sealed to it when channels are on). A seat refuses to deal to a
    receiver whose key it could not verify."""
    expect(context, state, DMMStage.RESHARE, "old")
    mix, receivers, columns, tamper, seed = _deal_arguments(context, state, message)
    f, scheme = context.scheme.field, context.scheme
    keep = context.schedule.open_after(state.step)
    out = {}
    for s, column in columns.items():
        if s not in state.online:
            continue
        if column is not None:
            column = f.asarray(column, "column")
            if column.shape != (scheme.k,):
                raise MemberRefused(f"column has shape {column.shape}; allowed (k,)")
        flat = np.concatenate([state.tentative[r][context.index[s]] for r in keep])
        if s in tamper:
            flat = offset_row(context, state.step, flat, s, seed, 3)
        unverified = [j for j in receivers if NEW_ID_BASE + j in state.unverified]
        if unverified and state.endpoints.get(s) is not None:
            raise MemberRefused(
                f"seat {s} refuses to deal: {state.unverified[NEW_ID_BASE + unverified[0]]}"
            )
        rng = (state.reshare_rngs if message.rngs is None else message.rngs).get(s)
        randomness = ShareRandomness(rng, rng is None)
        rows = OldMember(s, flat).deal(scheme, scheme, column, mix, randomness)
        endpoint = state.endpoints.get(s)
        out[s] = [
            endpoint.seal_array(NEW_ID_BASE + j, state.round, DMMStage.RESHARE, rows[j])
            if endpoint is not None
            else rows[j]
            for j in receivers
        ]
    return state, out


@refusing("retire")
def handle_retire(context: GroupContext, state: GroupState, message: Retire) -> Reply:
    """The handoff succeeded: the old committee forgets everything, its state included."""
    expect(context, state, DMMStage.RESHARE, "old")
    moved(context, state, DMMStage.DONE)
    return GroupState(step=state.step, retired=True, stage=DMMStage.DONE), None


@refusing("keep")
def handle_keep(context: GroupContext, state: GroupState, message: Keep) -> Reply:
    """The release stands but the handoff failed: the combined partial sums become this
    committee's state for the next step."""
    if (
        state.tentative is None
        or state.role not in ("current", "old")
        or state.stage not in (DMMStage.RELEASE, DMMStage.RESHARE)
    ):
        raise StageError(f"DMM members {context.shown}: nothing released to keep")
    return replace(state.cleared(), partials=state.tentative, step=state.step + 1), None


@refusing("discard")
def handle_discard(context: GroupContext, state: GroupState, message: Discard) -> Reply:
    """Abort the round: drop what it brought (a next committee drops what it received); the
    committed state is kept."""
    if state.retired:
        raise MemberRefused(f"members {context.shown} retired")
    cleared = state.cleared()
    return (replace(cleared, partials={}) if state.role == "new" else cleared), None


def _open_deal(context: GroupContext, state: GroupState, seat: int, item, dealer: int):
    """Dealer ``dealer``'s deal to seat ``seat``: its full row or its check block alone."""
    keep = context.schedule.open_after(state.step - 1)
    full = len(keep) * context.blocks + 1
    if isinstance(item, Envelope):
        opened = state.endpoints[seat].open_array(
            item,
            round_=state.round,
            stage=DMMStage.RESHARE,
            sender=OLD_ID_BASE + dealer,
            decode=row_decoder(full),
        )
    elif not state.endpoints and isinstance(item, np.ndarray):
        opened = item
    else:
        raise ChannelError(f"seat {seat} received a {type(item).__name__} from {dealer}")
    if opened.ndim != 1 or opened.shape[0] not in (1, full):
        raise ChannelError(f"a deal of shape {opened.shape}; expected (1,) or ({full},)")
    return context.scheme.field.asarray(opened, "deal")


@refusing("receive")
def handle_receive(context: GroupContext, state: GroupState, message: Receive) -> Reply:
    """Each online seat opens its deals (what it held from an earlier DEAL is replaced); the
    reply is the dealers whose deal some seat here could not authenticate or read."""
    expect(context, state, DMMStage.RESHARE, "new")
    deliveries = message.deliveries
    if not isinstance(deliveries, Mapping):
        raise MemberRefused(f"deliveries is a {type(deliveries).__name__}; allowed: a dict")
    refused: set[int] = set()
    deals: dict[int, dict[int, np.ndarray]] = {s: {} for s in sorted(state.online)}
    for s, sent in deliveries.items():
        if s not in deals or not isinstance(sent, Mapping):
            continue
        for dealer, item in sent.items():
            try:
                dealer = int(dealer)
                deals[s][dealer] = _open_deal(context, state, s, item, dealer)
            except (ChannelError, ValueError, TypeError):
                if isinstance(dealer, int):
                    refused.add(dealer)
    incoming = {s: NewMember(s, received=got) for s, got in deals.items()}
    return replace(state, incoming=incoming), sorted(refused)


def _full_width(context: GroupContext, state: GroupState) -> int:
    """Field elements of a full deal: a block per open row's block, and the check block."""
    return len(context.schedule.open_after(state.step - 1)) * context.blocks + 1


@refusing("accumulate")
def handle_accumulate(context: GroupContext, state: GroupState, message: Accumulate) -> Reply:
    """Each online seat sums the deals of the dealers ``chosen``."""
    expect(context, state, DMMStage.RESHARE, "new")
    chosen = [int(i) for i in message.chosen]
    full = _full_width(context, state)
    for s, member in state.incoming.items():
        if any(member.received.get(i, np.zeros(0)).shape != (full,) for i in chosen):
            raise MemberRefused(f"seat {s} lacks a full deal from some of {chosen}")
    f = context.scheme.field
    handed = np.zeros((len(context.seats), full - 1), dtype=np.int64)
    for s, member in state.incoming.items():
        handed[context.index[s]] = member.accumulate(f, chosen)
    return replace(state, handed=handed), None


@refusing("check_shares")
def handle_check_shares(context: GroupContext, state: GroupState, message: CheckShares) -> Reply:
    """VERIFY: each online seat's shares of the parity-check syndromes."""
    expect(context, state, DMMStage.RESHARE, "new")
    f = context.scheme.field
    checks = f.asarray(message.checks, "checks")
    candidates = [int(i) for i in message.candidates]
    if checks.ndim != 2 or checks.shape[1] != len(candidates):
        raise MemberRefused(f"checks has shape {checks.shape} for {len(candidates)} dealers")
    out = {}
    for s, member in state.incoming.items():
        if any(i not in member.received for i in candidates):
            raise MemberRefused(f"seat {s} has no check block from some of {candidates}")
        out[s] = member.check_shares(f, checks, candidates)
    return state, out


@refusing("commit")
def handle_commit(context: GroupContext, state: GroupState, message: Commit) -> Reply:
    """The handoff succeeded: the accumulated rows become this committee's state for its
    step; the reply is the seats that hold it."""
    expect(context, state, DMMStage.RESHARE, "new")
    moved(context, state, DMMStage.DONE)
    keep = context.schedule.open_after(state.step - 1)
    handed = state.handed
    if handed is None:
        if keep:
            raise MemberRefused(f"nothing accumulated for rows {list(keep)}")
        handed = np.zeros((len(context.seats), 0), dtype=np.int64)
    split = handed.reshape(len(context.seats), len(keep), context.blocks)
    partials = {int(r): split[:, a].copy() for a, r in enumerate(keep)}
    return replace(state.cleared(), partials=partials), sorted(state.online)
