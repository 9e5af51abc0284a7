"""DMM against the server, colluding members, hostile clients and whoever holds the run
directory (../shared/attacks/noise_seed.py DMM part, dmm_ckpt.py, dmm_lowkey.py, miscorrect.py
DMM part), and a fuzz of every member and server message handler."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from dmm_support import (
    SECRETS,
    Committees,
    Reference,
    digits_setup,
    inputs,
    make_dmm,
    run_dmm,
    seal_all,
)
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.metadata import Metadata
from flwr.supercore.task_identity import TaskIdentity

from fedsim.checkpoint import Checkpoint
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.dmm_committee import STATE_FILE, CommitteeHost, decode_member_state
from fedsim.privacy.dmm import IntegerMechanism
from fedsim.privacy.matrix.banded import banded
from fedsim.randomness import NODE_SECRET_KEY, Purpose, RunSecret, Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from protocols.channels import Envelope
from protocols.dmm.common import (
    REFUSALS,
    DMMFaults,
    DMMKeys,
    DMMSealedShares,
    DMMStage,
    MemberRefused,
    Schedule,
)
from protocols.dmm.member import MemberGroup, MemberPool
from protocols.dmm.server import DMMServer
from protocols.kit import TamperingDetected
from protocols.shamir import PackedShamir
from strategies.methods.dmm import dmm_client_app

D, CLIENTS, ROUNDS = 8, 5, 6


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _mechanism():
    return IntegerMechanism(banded(ROUNDS, 3), 10)


# --------------------------------------------------------------------- noise_seed.py (DMM)
def test_the_server_cannot_replay_a_clients_noise(local_engine):
    """The server builds the real instruction and sees the client's noise (ideal mode, the
    attacker's best case); nothing it knows reproduces that noise: the instruction carries no
    seed, and every public stream and the old derivation from (seed, round, partition) miss."""
    setup = digits_setup(CLIENTS)
    data, dataset, model, inner = setup
    strategy = make_dmm("ideal", CLIENTS, ROUNDS, population=CLIENTS, committee_size=5,
                        threshold=1, packing=1, member_dropouts=0)
    strategy.bind_committee_host(CommitteeHost(SECRETS))
    grid = local_engine.open_run(inner, CLIENTS, datasets=((data, dataset),))
    from fedsim.models import initial_arrays  # noqa: PLC0415

    arrays = to_record(initial_arrays(model, 0))
    messages = list(strategy.configure_train(3, arrays, ConfigRecord(), grid))
    config = next(r for r in messages[0].content.values() if isinstance(r, ConfigRecord))
    assert not any("seed" in key and key != "dmm.rotation-seed" for key in config.keys())
    partition = int(messages[0].metadata.dst_node_id) - NODE_ID_OFFSET
    own = SECRETS.client(partition)
    node_config = {
        "partition-id": partition, "num-partitions": CLIENTS, NODE_SECRET_KEY: own.token()
    }
    context = Context(run_id=1, node_id=messages[0].metadata.dst_node_id,
                      node_config=node_config, state=RecordDict(), run_config={})
    reply = dmm_client_app(inner)(messages[0], context)
    noise = to_numpy(reply.content[DMMKeys.NOISE])[DMMKeys.NOISE]
    from fedsim.privacy.mechanisms import discrete_gaussian  # noqa: PLC0415

    std = float(config["dmm.noise-std"])
    public = [int(v) for v in config.values() if isinstance(v, int) and not isinstance(v, bool)]
    guesses = [np.random.default_rng([s, 3, partition]) for s in public + [7, 0]]
    guesses += [public_generator(7, 3, stream) for stream in Stream]
    guesses += [SECRETS.server().generator(3, Purpose.NOISE, "dmm")]  # the server's own secret
    for rng in guesses:
        assert not np.array_equal(discrete_gaussian(noise.shape, std, rng), noise)
    # the client's own secret does reproduce it (so the check above could have matched)
    mine = own.generator(3, Purpose.NOISE, "dmm")
    np.testing.assert_array_equal(discrete_gaussian(noise.shape, std, mine), noise)
    # and no instruction byte carries the client's secret
    token = own.token()
    for value in config.values():
        text = value.hex() if isinstance(value, bytes) else str(value)
        assert token not in text


def _unchanged_model_app():
    """A ClientApp whose update is zero: the model after a DMM round is the decoded noise."""
    from flwr.clientapp import ClientApp  # noqa: PLC0415

    app = ClientApp()

    @app.train()
    def train(message, context):
        arrays = next(v for v in message.content.values() if isinstance(v, ArrayRecord))
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
        return Message(content, reply_to=message)

    return app


def test_the_release_carries_the_noise_the_ledger_accounts_for(local_engine):
    """An optimistic ledger is an attack on every client: with zero updates, the model after
    round 1 is exactly the decoded noise gamma * z_0 / (M[0, 0] m) (rotated), and its spread must
    be the std the accounting assumes, z * c * sens(M) / (M[0, 0] m), not less."""
    from fedsim.models import initial_arrays  # noqa: PLC0415
    from fedsim.privacy.participation import Participation  # noqa: PLC0415

    clients, z = 12, 1.0
    data, dataset, model, _ = digits_setup(clients)
    strategy = make_dmm("ideal", clients, 2, noise_multiplier=z,
                        participation=Participation.separated(1, 2))
    final, recorded = run_dmm(local_engine, (data, dataset, model, _unchanged_model_app()),
                              strategy, 1)
    start = initial_arrays(model, 0)
    delta = np.concatenate([(final[k] - start[k]).ravel() for k in start])
    assert recorded.metrics[0]["dmm-clients"] == clients
    m00 = float(strategy.mechanism.integer_matrix[0, 0])
    accounted = z * 1.0 * strategy.sensitivity / (m00 * clients)
    assert 0.9 * accounted < float(np.std(delta)) < 1.1 * accounted


# --------------------------------------------------------------------- dmm_ckpt.py
def _held_shares(pool) -> list[bytes]:
    """Test-only: every share row the members of an in-process hosted pool hold."""
    rows = []
    for hosted in pool.shards:
        for partial in hosted.group.partials.values():
            rows.extend(row.tobytes() for row in partial)
    return rows


def test_the_run_directory_alone_reconstructs_nothing(local_engine, tmp_path):
    """Whoever holds the run directory -- a checkpoint's payload and the members' state store --
    holds no share in the clear and cannot open the store without the run's root, nor a
    member's sealed state without that member's own secret; the members' own secrets can
    (so the store does hold the state)."""
    setup = digits_setup(12)
    host = CommitteeHost(SECRETS, state_path=tmp_path / STATE_FILE)
    strategy = make_dmm("full", 12, ROUNDS)
    arrays, _ = run_dmm(local_engine, setup, strategy, 3, host=host)
    payload = cloudpickle.dumps(Checkpoint(3, arrays, strategy, {}))  # a checkpoint's payload
    (tmp_path / "checkpoint.payload").write_bytes(payload)
    host.checkpoint(3)
    held = _held_shares(strategy.secure.server.pool)
    assert held and all(len(row) >= 64 for row in held)
    holders = [strategy.secure.custody.committee[s] for s in strategy.secure.server.holders]
    committee_step = strategy.secure.server.step
    host.close()
    # the attacker: every file of the run directory, as bytes and as objects
    files = {p: p.read_bytes() for p in Path(tmp_path).rglob("*") if p.is_file()}
    for row in held:
        for start in range(0, len(row) - 32, 32):
            assert not any(row[start : start + 32] in blob for blob in files.values())
    checkpoint = pickle.loads(payload)
    restored = checkpoint.strategy.secure
    assert restored.custody.host is None and restored.server.pool is None
    from fedsim.engine.state import ClientStateStore  # noqa: PLC0415
    from fedsim.runfiles import RunFileError  # noqa: PLC0415

    with pytest.raises(RunFileError, match="fails authentication"):  # no root, no store
        ClientStateStore(tmp_path / STATE_FILE, secrets=RunSecret.from_passphrase("someone"))
    store = ClientStateStore(tmp_path / STATE_FILE, secrets=SECRETS)  # the simulation's root
    blobs = {
        node - NODE_ID_OFFSET: blob
        for node, blob in store.get_many([NODE_ID_OFFSET + c for c in holders]).items()
    }
    assert set(blobs) == set(holders)
    outsider = RunSecret.from_passphrase("someone else")
    for client, blob in blobs.items():
        label = b"fedsim/dmm-member-state/v1/" + str(client).encode()
        for wrong in (SECRETS.server(), outsider.client(client), SECRETS.client(client + 1)):
            with pytest.raises(ValueError, match="failed authentication"):
                wrong.open(blob, label)
        # the member itself
        step, own = decode_member_state(SECRETS.client(client).open(blob, label))
        assert step == committee_step and own
    store.close()


# --------------------------------------------------------------------- dmm_lowkey.py
def test_an_all_zero_public_key_drops_only_that_client():
    mechanism = _mechanism()
    run = Committees(mechanism.integer_matrix, D)
    ref = Reference(mechanism.integer_matrix)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 1)
    keys = run.full.open_round(0)
    sealed = seal_all(keys, updates, noises)
    sealed[2] = DMMSealedShares(2, bytes(32), sealed[2].shares)
    out = run.full.finish_round(sealed, run.new_pool())
    assert "unusable public key" in out.rejected[2]
    assert out.clients == (0, 1, 3, 4) and run.full.stage is DMMStage.DONE
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, (0, 1, 3, 4)))


def test_a_strategy_round_survives_a_zero_key_and_names_the_client(local_engine):
    setup = digits_setup(12)

    def zero_key(server_round, replies):
        if server_round == 2:
            record = dict(replies[0].content[DMMKeys.SEALED])
            record["public-key"] = bytes(32)
            replies[0].content[DMMKeys.SEALED] = ConfigRecord(record)
        return replies

    _, recorded = run_dmm(local_engine, setup, make_dmm("full", 12, 3), 3, alter=zero_key)
    victim = int(recorded.replies[1][0].metadata.src_node_id)
    assert recorded.metrics[1]["rejected"] == [victim]
    assert recorded.outputs[1].clients and victim not in recorded.outputs[1].clients
    assert recorded.metrics[2]["rejected"] == []


# --------------------------------------------------------------------- miscorrect.py (DMM)
class Colluding(MemberGroup):
    """Members whose release shares at the seats ``COLLUDERS`` carry a crafted offset g(x_j):
    with it the answered shares lie on another polynomial of degree < t + k at every seat
    but one honest seat -- what miscorrect.py used to move the release."""

    COLLUDERS: dict[int, int] = {}

    def release(self, round_, drop, late, tamper, seed):
        answer = super().release(round_, drop, late, tamper, seed)
        f = self.scheme.field
        rows = []
        for seat, row in zip(answer["seats"], answer["rows"]):
            if seat in self.COLLUDERS:
                row = f.add(row, f.encode_signed(np.full(row.shape, self.COLLUDERS[seat])))
            rows.append(row)
        answer["rows"] = rows
        return answer


def _colluding_run(n, t, k, colluders):
    mechanism = _mechanism()
    scheme = PackedShamir(n, t, k)
    server = DMMServer(scheme, Schedule(mechanism.integer_matrix), D, encrypt=False)
    pool = MemberPool(range(n), [list(range(n))], server.member_kwargs)
    Colluding.COLLUDERS = colluders
    pool.objects = [Colluding(list(range(n)), **server.member_kwargs)]
    server.attach(pool)
    updates, noises = inputs(server.schedule, 0, CLIENTS, D, 4)
    keys = server.open_round(0)
    sealed = seal_all(keys, updates, noises)
    next_pool = MemberPool(range(n), [list(range(n))], server.member_kwargs)
    expected = Reference(mechanism.integer_matrix).release(updates, noises, range(CLIENTS))
    return server, sealed, next_pool, expected


def test_two_colluders_cannot_choose_the_release_nor_blame_an_honest_member():
    # miscorrect.py's setting: n = 7, t = 3, k = 2, g vanishing at seats 1, 3, 4, 6
    a = 1000
    g = {j: a * (j + 1 - 2) * (j + 1 - 4) * (j + 1 - 5) * (j + 1 - 7) for j in (2, 5)}
    server, sealed, next_pool, _ = _colluding_run(7, 3, 2, g)
    with pytest.raises(TamperingDetected) as caught:
        server.finish_round(sealed, next_pool)
    assert caught.value.suspects == () and server.step == 0  # nothing released, nobody blamed
    # with room to correct (n = 10, t = 2, k = 2: 3 correctable), the colluders are corrected
    server, sealed, next_pool, expected = _colluding_run(10, 2, 2, {2: 77, 5: -5})
    out = server.finish_round(sealed, next_pool)
    np.testing.assert_array_equal(out.release, expected)
    assert out.corrected == (2, 5)


def test_with_exactly_t_plus_k_answers_the_release_is_reported_unverified():
    run = Committees(_mechanism().integer_matrix, D)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 5)
    faults = DMMFaults(member={(j, DMMStage.RELEASE): "drop" for j in range(5)})
    out = run.full_round(0, updates, noises, faults)
    assert not out.verified and out.radius == 0 and out.corrected == ()


# --------------------------------------------------------------------- the server's powers
def test_members_refuse_a_noise_free_or_repeated_release():
    run = Committees(_mechanism().integer_matrix, D, min_clients=2)
    group = run.full.pool.objects[0]
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 6)
    keys = run.full.open_round(0)
    sealed = seal_all(keys, updates, noises)
    with pytest.raises(MemberRefused, match="step"):
        group.combine(3, list(range(CLIENTS)), [], [], 0)  # another step's coefficients
    with pytest.raises(MemberRefused, match="min_clients"):
        group.combine(0, [0], [], [], 0)  # a release carrying one client's noise
    with pytest.raises(MemberRefused, match="never shared"):
        group.combine(0, [0, 1], [], [], 0)  # nothing was relayed yet
    run.full.finish_round(sealed, run.new_pool())
    with pytest.raises(REFUSALS):
        group.release(0, [], [], [], 0)  # the round is over: no second release


def test_a_round_1_envelope_is_refused_in_round_2():
    mechanism = _mechanism()
    run = Committees(mechanism.integer_matrix, D)
    ref = Reference(mechanism.integer_matrix)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 7)
    keys = run.full.open_round(1)
    old = seal_all(keys, updates, noises)
    run.full.finish_round(old, run.new_pool())
    ref.release(updates, noises, range(CLIENTS))
    updates, noises = inputs(run.full.schedule, 1, CLIENTS, D, 8)
    keys = run.full.open_round(2)
    sealed = seal_all(keys, updates, noises)
    sealed[0] = old[0]  # replayed as it was
    relabelled = {
        j: Envelope(e.sender, e.receiver, 2, e.stage, e.nonce, e.ciphertext)
        for j, e in old[1].shares.items()
    }
    sealed[1] = DMMSealedShares(old[1].party, old[1].public_key, relabelled)  # header rewritten
    out = run.full.finish_round(sealed, run.new_pool())
    assert 0 in out.rejected and 1 in out.excluded and out.clients == (2, 3, 4)
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, (2, 3, 4)))


# --------------------------------------------------------------------- fuzz
def _garbage(rng):
    choices = [
        None, 7, -1, 2**70, "x", b"", rng.bytes(int(rng.integers(1, 64))), [rng.bytes(8)],
        {rng.bytes(4): 1}, np.zeros(3), np.full(5, 2**62, dtype=np.int64), [1, 2, 3], {0: None},
        {0: {0: rng.bytes(40)}}, {2**40 + 1: {0: np.zeros(2)}}, ["a"], 1.5, {1: [1.0]},
    ]
    return choices[int(rng.integers(len(choices)))]


HANDLERS = {
    "announce": 5, "announce_handoff": 6, "connect": 1, "share": 1, "combine": 5, "release": 5,
    "deal": 5, "receive": 1, "accumulate": 1, "check_shares": 2, "commit": 0, "retire": 0,
    "keep": 0, "discard": 0, "load": 2,
}


def test_fuzz_every_member_handler_refuses_cleanly_and_changes_nothing():
    """Random bytes, wrong lengths and types, wrong stages, non-members, replays: each request
    is refused with MemberRefused/StageError (or served when it happens to be valid), and the
    committee then runs the round exactly."""
    mechanism = _mechanism()
    run = Committees(mechanism.integer_matrix, D, groups=1)
    ref = Reference(mechanism.integer_matrix)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 9)
    run.full_round(0, updates, noises)
    ref.release(updates, noises, range(CLIENTS))
    group = run.full.pool.objects[0]
    before = {r: v.copy() for r, v in group.partials.items()}
    rng = np.random.default_rng(0)
    for name, arity in itertools.chain.from_iterable(itertools.repeat(HANDLERS.items(), 6)):
        if name in ("retire", "keep", "discard", "commit"):
            continue  # legitimate endings; exercised below on a spare group
        args = [_garbage(rng) for _ in range(arity)]
        try:
            getattr(group, name)(*args)
        except REFUSALS:
            pass
        group.state = group.state.cleared()  # a stray request may have left a stage: restart
    for r, v in before.items():
        np.testing.assert_array_equal(group.partials[r], v)
    spare = MemberGroup([0], **run.full.member_kwargs)
    for name in ("retire", "keep", "commit", "accumulate"):
        with pytest.raises(REFUSALS):
            getattr(spare, name)(*([[0]] if name == "accumulate" else []))
    updates, noises = inputs(run.full.schedule, 1, CLIENTS, D, 10)
    out = run.full_round(1, updates, noises)
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))


def test_fuzz_the_server_rejects_every_malformed_client_message_and_finishes_the_round():
    mechanism = _mechanism()
    run = Committees(mechanism.integer_matrix, D)
    ref = Reference(mechanism.integer_matrix)
    rng = np.random.default_rng(1)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 11)
    keys = run.full.open_round(0)
    sealed = seal_all(keys, updates, noises)
    good = sealed[0]
    some_envelope = next(iter(good.shares.values()))
    bad = {
        100: _garbage(rng),
        101: DMMSealedShares(2**41, good.public_key, good.shares),  # not a client id
        102: DMMSealedShares(0, good.public_key, good.shares),  # the same party twice
        103: DMMSealedShares(103, good.public_key, {0: some_envelope}),  # missing seats
        104: DMMSealedShares(104, rng.bytes(31), good.shares),  # a short key
        105: DMMSealedShares(105, good.public_key, {j: rng.bytes(60) for j in good.shares}),
        106: DMMSealedShares(106, good.public_key, {
            j: Envelope(106, e.receiver, e.round, e.stage, e.nonce, e.ciphertext[:-1])
            for j, e in good.shares.items()
        }),  # wrong length
        107: DMMSealedShares(107, good.public_key, {
            j: Envelope(107, e.receiver, e.round, "RELEASE", e.nonce, e.ciphertext)
            for j, e in good.shares.items()
        }),  # wrong stage
        108: DMMSealedShares(True, good.public_key, good.shares),
    }
    out = run.full.finish_round({**sealed, **bad}, run.new_pool())
    assert set(out.rejected) == set(bad)
    assert all(isinstance(reason, str) and reason for reason in out.rejected.values())
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))


def test_fuzz_the_strategy_rejects_bad_replies_and_names_them(local_engine):
    """Replies with foreign records, from clients not sampled, twice from one client, with a
    malformed sealed record or ideal-mode integers beyond the clip bound: each is rejected and
    named in the round's metrics; the round goes on."""
    setup = digits_setup(12)
    rng = np.random.default_rng(2)
    named = {}

    def hostile(server_round, replies):
        if server_round != 2:
            return replies
        a, b, c = replies[0], replies[1], replies[2]
        foreign = {"arrays": ArrayRecord(), "metrics": MetricRecord({"num-examples": 1})}
        a.content = RecordDict(foreign)
        record = dict(b.content[DMMKeys.SEALED])
        record["nonces"] = record["nonces"][:-1]
        b.content[DMMKeys.SEALED] = ConfigRecord(record)
        meta = c.metadata
        stranger = Message(
            content=RecordDict({DMMKeys.SEALED: ConfigRecord({"x": rng.bytes(8)})}),
            metadata=Metadata(
                run_id=meta.run_id,
                message_id="",
                src_node_id=99,
                dst_node_id=meta.dst_node_id,
                reply_to_message_id=meta.reply_to_message_id,
                group_id=meta.group_id,
                created_at=meta.created_at,
                ttl=meta.ttl,
                message_type=meta.message_type,
            ),
        )
        named.update({name: int(r.metadata.src_node_id) for name, r in zip("abc", (a, b, c))})
        return [*replies, c, stranger]

    _, recorded = run_dmm(local_engine, setup, make_dmm("full", 12, 3), 3, alter=hostile)
    assert set(recorded.metrics[1]["rejected"]) == {named["a"], named["b"], named["c"], 99}
    assert len(recorded.outputs[1].clients) == 12 - 3
    assert recorded.metrics[2]["rejected"] == []

    def oversized(server_round, replies):
        if server_round == 1:

            update = to_numpy(replies[0].content[DMMKeys.UPDATE])[DMMKeys.UPDATE] * 1000
            replies[0].content[DMMKeys.UPDATE] = to_record({DMMKeys.UPDATE: update})
            named["big"] = int(replies[0].metadata.src_node_id)
        return replies

    _, recorded = run_dmm(local_engine, setup, make_dmm("ideal", 12, 2), 2, alter=oversized)
    assert recorded.metrics[0]["rejected"] == [named["big"]]


def test_checkpoints_never_carry_the_host_or_a_pool():
    strategy = make_dmm("full", 12, ROUNDS)
    strategy.bind_committee_host(CommitteeHost(SECRETS))
    restored = pickle.loads(cloudpickle.dumps(strategy))
    assert restored.secure.custody.host is None
    with pytest.raises(TypeError, match="never pickled"):
        cloudpickle.dumps(CommitteeHost(SECRETS))
