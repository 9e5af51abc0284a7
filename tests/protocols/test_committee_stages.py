"""The committee member's stage handlers (protocols.committee.stages) called directly: the same
answers as a shard, the stage move checked before anything else, the state a value."""

import dataclasses
import itertools

import numpy as np
import pytest

from protocols.channels import SERVER_ID, Endpoint, decode_array, new_session_id
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    TRANSITIONS,
    CommitteeCall,
    CommitteeStage,
    ShardSealedShares,
    StageFaults,
)
from protocols.committee.member import CommitteeShard
from protocols.committee.stages import (
    HANDLERS,
    Abort,
    Combine,
    Release,
    Share,
    handle,
    handle_abort,
    handle_combine,
    handle_release,
    handle_share,
)
from protocols.committee.state import ShardState
from protocols.field import DEFAULT_FIELD
from protocols.kit import MEMBER_ID_BASE, StageError

S = CommitteeStage
MEMBERS = [3, 4, 5]
WIDTH = 4
KEYS = {m: bytes([m + 1]) * 32 for m in MEMBERS}
SERVER_KEY = bytes([77]) * 32


def shard(session):
    """A shard of MEMBERS with fixed channel keys, connected to the server."""
    made = CommitteeShard(MEMBERS, 61, session, KEYS)
    made.connect(SERVER_ID, Endpoint(SERVER_ID, session, CHANNEL_PROTOCOL, SERVER_KEY).public_key)
    return made


def deliveries(session, round_, values):
    """Each client's sealed rows for MEMBERS (client c's row for member m: values[c][m])."""
    out = {}
    member_keys = CommitteeShard(MEMBERS, 61, session, KEYS).public_keys()
    for client, rows in values.items():
        endpoint = Endpoint(client, session, CHANNEL_PROTOCOL, bytes([client]) * 32)
        envelopes = []
        for member, row in zip(MEMBERS, rows):
            endpoint.connect(MEMBER_ID_BASE + member, member_keys[member])
            envelopes.append(endpoint.seal_array(MEMBER_ID_BASE + member, round_, S.SHARE, row))
        out[client] = ShardSealedShares(endpoint.public_key, tuple(envelopes), WIDTH)
    return out


def values(rng, clients=(10, 11, 12)):
    return {c: [DEFAULT_FIELD.random(rng, WIDTH) for _ in MEMBERS] for c in clients}


def opened(session, answer, round_):
    """The server's view of a RELEASE answer: member -> its opened row."""
    server = Endpoint(SERVER_ID, session, CHANNEL_PROTOCOL, SERVER_KEY)
    for member, key in CommitteeShard(MEMBERS, 61, session, KEYS).public_keys().items():
        server.connect(MEMBER_ID_BASE + member, key)
    return {
        m: decode_array(server.open(e, round_=round_, stage=S.RELEASE)).tolist()
        for m, e in zip(answer["members"], answer["rows"])
    }


def snapshot(state):
    """A copy of ``state`` sharing nothing with it (to show later that it did not change)."""
    rows = {c: r.copy() for c, r in state.rows.items()}
    total = None if state.total is None else state.total.copy()
    return dataclasses.replace(state, rows=rows, total=total)


FAULTS = {
    S.SHARE: StageFaults(tamper=frozenset({4}), seed=9),
    S.COMBINE: StageFaults(drop=frozenset({5}), tamper=frozenset({3}), seed=9),
    S.RELEASE: StageFaults(late=frozenset({4}), tamper=frozenset({4}), seed=9),
}


def test_handlers_give_the_shards_answers_byte_for_byte():
    """SHARE -> COMBINE -> RELEASE by the handlers on a shard's context gives the answers the
    shard gives (tamper offsets, drops and late members included) and the same sealed bytes;
    the sums are the clients' rows summed, plus the tampering members' offsets."""
    session, rng = new_session_id(), np.random.default_rng(3)
    given = values(rng)
    held, bare = shard(session), shard(session)
    delivered = deliveries(session, 7, given)
    state = ShardState()
    state, shared = handle_share(bare.context, state, Share(7, delivered, FAULTS[S.SHARE], WIDTH))
    assert shared == held.share(7, delivered, FAULTS[S.SHARE], WIDTH)
    assert shared == {"online": MEMBERS, "refused": {}} and state.stage is S.SHARE
    assert sorted(state.rows) == [10, 11, 12] and state.width == WIDTH
    state, online = handle_combine(bare.context, state, Combine(7, [10, 12], FAULTS[S.COMBINE]))
    assert online == held.combine(7, [10, 12], FAULTS[S.COMBINE]) == [3, 4]
    assert state.stage is S.COMBINE and state.rows == {} and state.offline == {5}
    state, released = handle_release(bare.context, state, Release(7, FAULTS[S.RELEASE]))
    answer = held.release(7, FAULTS[S.RELEASE])
    assert released == answer and released["late"] == [4] and state.stage is S.DONE
    rows = opened(session, released, 7)
    clean = DEFAULT_FIELD.add(given[10][0], given[12][0]).tolist()
    assert list(rows) == [3, 4] and rows[3] != clean  # member 3 tampered at COMBINE
    assert held.state(7) == state and held.stage(7) is S.DONE


def test_width_defaults_to_the_first_clients_and_an_empty_round_sums_to_no_elements():
    session, rng = new_session_id(), np.random.default_rng(4)
    context = shard(session).context
    delivered = deliveries(session, 2, values(rng, (10,)))
    state, _ = handle_share(context, ShardState(), Share(2, delivered, StageFaults()))
    assert state.width == WIDTH
    state, _ = handle_share(context, ShardState(), Share(3, {}, StageFaults()))
    assert state.width is None
    state, online = handle_combine(context, state, Combine(3, [], StageFaults()))
    assert online == MEMBERS and state.total.shape == (3, 0)


def states_by_stage(session):
    """A state in every stage of one round (round 5), reached by the handlers."""
    context = shard(session).context
    delivered = deliveries(session, 5, values(np.random.default_rng(5)))
    share, _ = handle_share(context, ShardState(), Share(5, delivered, StageFaults(), WIDTH))
    combine, _ = handle_combine(context, share, Combine(5, [10, 11], StageFaults()))
    release = dataclasses.replace(combine, stage=S.RELEASE)
    done, _ = handle_release(context, combine, Release(5, StageFaults()))
    aborted, _ = handle_abort(context, share, Abort(5))
    states = {S.SETUP: ShardState(), S.SHARE: share, S.COMBINE: combine, S.RELEASE: release}
    return context, {**states, S.DONE: done, S.ABORTED: aborted}


def test_a_handler_out_of_order_raises_and_leaves_the_state_as_it_was():
    """Every move the transition table refuses raises StageError before anything is done: the
    caller's state still equals a copy taken before, its arrays are read-only."""
    session = new_session_id()
    context, states = states_by_stage(session)
    messages = {
        S.SHARE: Share(5, deliveries(session, 5, values(np.random.default_rng(6))), StageFaults()),
        S.COMBINE: Combine(5, [10], StageFaults()),
        S.RELEASE: Release(5, StageFaults()),
    }
    refused = 0
    for current, target in itertools.product(states, messages):
        if target in TRANSITIONS[current]:
            continue
        state = states[current]
        before = snapshot(state)
        with pytest.raises(StageError, match=f"stage {current.name}; cannot move to {target.name}"):
            handle(target, context, state, messages[target])
        assert state == before and state.stage is current
        refused += 1
    assert refused == 15
    with pytest.raises(ValueError, match="read-only"):
        states[S.SHARE].rows[10][0, 0] = 1


def test_abort_from_every_stage_keeps_nothing():
    session = new_session_id()
    context, states = states_by_stage(session)
    for stage, state in states.items():
        before = snapshot(state)
        new, reply = handle(S.ABORTED, context, state, Abort(5))
        assert reply is None and new == ShardState(S.ABORTED) and new.total is None
        assert state == before, stage


def test_the_table_holds_a_handler_for_each_stage_a_message_enters():
    assert list(HANDLERS) == [S.SHARE, S.COMBINE, S.RELEASE, S.ABORTED]
    context = shard(new_session_id()).context
    for stage in (S.SETUP, S.DONE):
        with pytest.raises(StageError, match="no handler"):
            handle(stage, context, ShardState(), None)
    with pytest.raises(TypeError, match="ShardState"):
        handle_share(context, {"stage": S.SETUP}, Share(0, {}, StageFaults()))


def test_the_shard_stores_the_handlers_state_and_aborts_a_round_a_handler_refuses():
    """Through ``answer``: an out-of-order call leaves the stored state object in place; a
    handler's error (a client never shared) propagates and leaves the round ABORTED."""
    session = new_session_id()
    held = shard(session)
    delivered = deliveries(session, 1, values(np.random.default_rng(7)))
    held.answer(CommitteeCall.SHARE, (1, delivered, StageFaults(), WIDTH))
    stored = held.state(1)
    with pytest.raises(StageError, match="cannot move to RELEASE"):
        held.answer(CommitteeCall.RELEASE, (1, StageFaults()))
    assert held.state(1) is stored and stored.stage is S.SHARE
    with pytest.raises(ValueError, match=r"clients \[99\] were never shared"):
        held.answer(CommitteeCall.COMBINE, (1, [10, 99], StageFaults()))
    assert held.stage(1) is S.ABORTED and held.state(1).rows == {}
    assert held.stage(2) is S.SETUP and held.state(2) == ShardState()
    with pytest.raises(TypeError, match="ShardState"):
        held.store(2, None)


def test_a_state_checks_what_it_holds():
    with pytest.raises(TypeError, match="CommitteeStage"):
        ShardState("SHARE")
    with pytest.raises(ValueError, match="width=-1"):
        ShardState(S.SHARE, width=-1)
    with pytest.raises(TypeError, match=r"rows\[3\]"):
        ShardState(S.SHARE, rows={3: [[1, 2]]})
    with pytest.raises(TypeError, match="frozenset"):
        ShardState(S.SHARE, offline={1})
    rows = np.zeros((3, 2), dtype=np.int64)
    state = ShardState(S.SHARE, 2, {np.int64(10): rows}, offline=frozenset({4}))
    assert rows.flags.writeable and not state.rows[10].flags.writeable  # a read-only view
    assert list(state.rows) == [10] and type(next(iter(state.rows))) is int
    assert state == ShardState(S.SHARE, 2, {10: rows.copy()}, offline=frozenset({4}))
    assert state != ShardState(S.SHARE, 2, {10: rows + 1}, offline=frozenset({4}))
    assert state != ShardState(S.SHARE, 2, {10: rows}) and state != "SHARE"
