"""The DMM member side as stage handlers: called directly on state values they give the same
replies and shares as :class:`MemberGroup`; out of order or refused they give no new state."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from dmm_support import Reference, inputs

from protocols.channels import SERVER_ID, Endpoint, Envelope
from protocols.dmm import reshare_stages as rs
from protocols.dmm import stages
from protocols.dmm.client import seal_client_shares
from protocols.dmm.common import (
    PROTOCOL,
    DMMStage,
    MemberCall,
    MemberRefused,
    RoundKeys,
    Schedule,
)
from protocols.dmm.member import MemberGroup
from protocols.dmm.parity import parity_checks, reshare_coefficients
from protocols.dmm.resharing import NewMember
from protocols.dmm.state import GroupContext, GroupState
from protocols.kit import SEAT_ID_BASE, StageError
from protocols.shamir import PackedShamir

N, T, K, D, CLIENTS = 6, 1, 2, 5, 4
M = np.array([[1, 0, 0], [2, 1, 0], [0, 1, 1]], dtype=np.int64)
KWARGS = dict(n=N, t=T, k=K, field_exponent=61, dim=D, matrix=M)
SEATS = list(range(N))
SCHEME = PackedShamir(N, T, K)
SCHEDULE = Schedule(M)


def _deliveries(step: int, seed: int):
    """(the clients' plain SHARE rows by party and seat, their updates, their noise rows)."""
    updates, noises = inputs(SCHEDULE, step, CLIENTS, D, seed)
    keys = RoundKeys(step, step, 1, N, T, K, 61, D, None, {s: b"" for s in SEATS})
    sealed = {
        c: seal_client_shares(keys, c, updates[c], noises[c], np.random.default_rng([seed, c]))
        for c in range(CLIENTS)
    }
    return {c: dict(m.shares) for c, m in sealed.items()}, updates, noises


class Handlers:
    """One group run by the handlers alone, on a state value."""

    def __init__(self) -> None:
        self.context = GroupContext.build(SEATS, **KWARGS)
        self.state = GroupState()

    def __call__(self, call: MemberCall, message):
        self.state, reply = stages.handle(call, self.context, self.state, message)
        return reply

    def partials(self):
        return self.state.partials


class Group:
    """One :class:`MemberGroup`, sent each message's fields as the call's arguments."""

    def __init__(self) -> None:
        self.group = MemberGroup(SEATS, **KWARGS)

    def __call__(self, call: MemberCall, message):
        return self.group.answer(call, tuple(getattr(message, f.name) for f in fields(message)))

    def partials(self):
        return self.group.partials


def _round_and_handoff(old, new) -> list:
    """Round 0 at ``old`` and its handoff to ``new`` (no channels, fixed resharing streams);
    every reply in order."""
    deliveries, _, _ = _deliveries(0, 1)
    replies = [
        old(MemberCall.ANNOUNCE, stages.Announce(0, None, SEATS, [])),
        old(MemberCall.CONNECT, stages.Connect({})),
        old(MemberCall.SHARE, stages.Share(deliveries)),
        old(MemberCall.COMBINE, stages.Combine(0, list(range(CLIENTS)), [], [], 0)),
        old(MemberCall.RELEASE, stages.Release(0, [], [], [], 0)),
        old(MemberCall.ANNOUNCE_HANDOFF, stages.AnnounceHandoff(0, None, "old", 0, SEATS, [])),
        new(MemberCall.ANNOUNCE_HANDOFF, stages.AnnounceHandoff(0, None, "new", 0, SEATS, [])),
    ]
    chosen = SEATS[: SCHEME.threshold]
    lam = reshare_coefficients(SCHEME, chosen)
    columns = {i: (lam[:, chosen.index(i)] if i in chosen else None) for i in SEATS}
    mix = SCHEME.field.random(np.random.default_rng(3), SCHEME.blocks_for(D))
    rngs = {s: np.random.default_rng([7, s]) for s in SEATS}
    deals = old(MemberCall.DEAL, rs.Deal(columns, mix, SEATS, [], 0, rngs))
    inbox = {j: {i: rows[j] for i, rows in deals.items()} for j in SEATS}
    checks = parity_checks(SCHEME, SEATS)
    replies += [
        deals,
        new(MemberCall.RECEIVE, rs.Receive(inbox)),
        new(MemberCall.ACCUMULATE, rs.Accumulate(chosen)),
        new(MemberCall.CHECK_SHARES, rs.CheckShares(checks, SEATS)),
        new(MemberCall.COMMIT, rs.Commit()),
        old(MemberCall.RETIRE, rs.Retire()),
    ]
    return replies


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[x], b[x]) for x in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _opened(shares: np.ndarray) -> np.ndarray:
    values = SCHEME.reconstruct(shares[: SCHEME.threshold], SEATS[: SCHEME.threshold], D)
    return SCHEME.field.decode_signed(values)


def test_a_round_and_handoff_by_the_handlers_is_the_member_groups():
    old, new = Handlers(), Handlers()
    replies = _round_and_handoff(old, new)
    group_old, group_new = Group(), Group()
    assert _same(replies, _round_and_handoff(group_old, group_new))
    assert _same(dict(new.partials()), dict(group_new.partials()))
    assert old.state.retired and old.state.stage is DMMStage.DONE and not old.partials()
    # the shares open to the mechanism's values: the release and the partial sum handed on
    _, updates, noises = _deliveries(0, 1)
    reference = Reference(M)
    release = reference.release(updates, noises, range(CLIENTS))
    np.testing.assert_array_equal(_opened(np.stack(replies[4]["rows"])), release[0])
    assert new.state.step == 1 and sorted(new.partials()) == [1]
    np.testing.assert_array_equal(_opened(new.partials()[1]), reference.partial_sums()[1])
    # the check shares of an honest dealing open to zero syndromes
    syndromes = np.stack([replies[10][s] for s in SEATS])[:, :, None]
    opened = [SCHEME.reconstruct(syndromes[:, a], SEATS, 1) for a in range(syndromes.shape[1])]
    assert all(int(value[0]) == 0 for value in opened)


def _shared() -> tuple[GroupContext, GroupState]:
    """A group's context and its state after SHARE of round 0."""
    run = Handlers()
    deliveries, _, _ = _deliveries(0, 2)
    run(MemberCall.ANNOUNCE, stages.Announce(0, None, SEATS, []))
    run(MemberCall.SHARE, stages.Share(deliveries))
    return run.context, run.state


def test_a_handler_called_out_of_order_raises_stage_error_and_gives_no_new_state():
    context, state = _shared()
    received = dict(state.received)
    with pytest.raises(StageError, match="needs stage COMBINE"):
        stages.handle_release(context, state, stages.Release(0, [], [], [], 0))
    with pytest.raises(StageError, match="mid-round"):
        stages.handle_announce(context, state, stages.Announce(0, None, SEATS, []))
    with pytest.raises(StageError, match="RESHARE"):
        rs.handle_deal(context, state, rs.Deal({}, np.zeros(0), [], [], 0))
    assert state.stage is DMMStage.SHARE and state.role == "current"
    assert received.keys() == state.received.keys() and state.release is None
    # the holder keeps the very state value it had
    group = MemberGroup(SEATS, **KWARGS)
    before = group.state
    with pytest.raises(StageError):
        group.commit()
    assert group.state is before


def test_a_refused_request_changes_nothing():
    context, state = _shared()
    with pytest.raises(MemberRefused, match="step"):
        stages.handle_combine(context, state, stages.Combine(1, [0, 1], [], [], 0))
    with pytest.raises(MemberRefused, match="never shared"):
        stages.handle_combine(context, state, stages.Combine(0, [0, 99], [], [], 0))
    with pytest.raises(MemberRefused, match="malformed"):
        stages.handle_combine(context, state, stages.Combine(0, [0], [], [], "x"))
    assert state.stage is DMMStage.SHARE and sorted(state.received) == list(range(CLIENTS))
    # a next committee refused mid-announcement keeps its step (nothing half-done)
    group = MemberGroup(SEATS, **KWARGS)
    before = group.state
    with pytest.raises(MemberRefused, match="session_id"):
        group.announce_handoff(0, b"short", "new", 4, SEATS, [])
    assert group.state is before and group.step == 0 and group.stage is DMMStage.SETUP
    with pytest.raises(MemberRefused, match="open rows"):
        group.load(1, {})
    assert group.state is before


def test_every_call_has_a_handler_and_none_other_is_answered():
    assert set(stages.HANDLERS) == set(MemberCall)
    context, state = GroupContext.build(SEATS, **KWARGS), GroupState()
    with pytest.raises(StageError, match="no handler"):
        stages.handle("load", context, state, None)


def test_a_new_member_is_a_value():
    f = SCHEME.field
    member = NewMember(2)
    took = member.take(f, 0, np.arange(3), 3)
    assert member.received == {} and sorted(took.received) == [0] and not took.refused
    again = took.take(f, 0, np.arange(3), 3)
    assert again.refused == {0} and not took.refused
    assert took.take(f, 1, np.arange(2), 3).refused == {1}
    assert again.reset().received == {} and not again.reset().refused


def _sealed_round(run, session: bytes) -> tuple[list, dict]:
    """Round 0 at ``run`` with channels (fixed keys): every reply, and the sealed messages."""
    own = {s: bytes([s + 1]) * 32 for s in SEATS}
    keys = run(MemberCall.ANNOUNCE, stages.Announce(0, session, SEATS, [], own))
    round_keys = RoundKeys(0, 0, 1, N, T, K, 61, D, session, keys)
    updates, noises = inputs(SCHEDULE, 0, CLIENTS, D, 4)
    sealed = {
        c: seal_client_shares(
            round_keys, c, updates[c], noises[c], np.random.default_rng([4, c]),
            private_key=bytes([100 + c]) * 32,
        )
        for c in range(CLIENTS)
    }
    server = Endpoint(SERVER_ID, session, protocol=PROTOCOL, private_key=b"\x09" * 32)
    peers = {c: m.public_key for c, m in sealed.items()} | {SERVER_ID: server.public_key}
    deliveries = {c: m.shares for c, m in sealed.items()}
    replies = [
        keys,
        run(MemberCall.CONNECT, stages.Connect(peers)),
        run(MemberCall.SHARE, stages.Share(deliveries)),
        run(MemberCall.COMBINE, stages.Combine(0, list(range(CLIENTS)), [], [], 0)),
        run(MemberCall.RELEASE, stages.Release(0, [], [], [], 0)),
    ]
    return replies, {"updates": updates, "noises": noises, "server": server}


def test_a_sealed_round_by_the_handlers_sends_the_member_groups_bytes():
    session = b"\x01" * 32
    replies, made = _sealed_round(Handlers(), session)
    assert _same(replies, _sealed_round(Group(), session)[0])
    answer = replies[-1]
    assert all(isinstance(e, Envelope) for e in answer["rows"])
    server = made["server"]
    for seat in answer["seats"]:
        server.connect(SEAT_ID_BASE + seat, replies[0][seat])
    rows = np.stack([
        server.open_array(e, round_=0, stage=DMMStage.RELEASE, sender=SEAT_ID_BASE + s)
        for s, e in zip(answer["seats"], answer["rows"])
    ])
    release = Reference(M).release(made["updates"], made["noises"], range(CLIENTS))
    np.testing.assert_array_equal(_opened(rows), release[0])
