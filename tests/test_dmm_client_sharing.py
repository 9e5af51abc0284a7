"""DMM clients share and seal their own update and noise (reference/dmm.md step 2): replies and
the server's SHARE step hold ciphertexts only, and a tampered envelope drops its client."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.clientapp import ClientApp
from test_dmm_strategy import CLIENTS, ROUNDS, _dmm, run

from fedsim.data import DatasetSpec, build_dataset
from fedsim.models import ModelSpec
from fedsim.privacy.dmm import IntegerNoising
from fedsim.privacy.matrix.tree import honaker_tree
from fedsim.records import to_numpy
from fedsim.workloads.supervised import LocalTraining, make_client_app
from protocols.channels import ChannelError, Endpoint, Envelope, new_session_id
from protocols.dmm import (
    MEMBER_ID_BASE,
    DMMCommitteeProtocol,
    DMMFaults,
    DMMStage,
    RoundKeys,
    SealedShares,
    seal_client_shares,
)
from protocols.field import MersenneField
from protocols.shamir import PackedShamir
from strategies.dmm import NOISE_KEY, SEALED_KEY, UPDATE_KEY, dmm_client_app

D, F = 8, 10


def _keys(members, rows=2, round_=4):
    session = new_session_id()
    endpoints = {j: Endpoint(MEMBER_ID_BASE + j, session) for j in members}
    keys = RoundKeys(
        round=round_,
        step=1,
        rows=rows,
        n=7,
        t=2,
        k=3,
        field_exponent=61,
        dim=D,
        session_id=session,
        member_keys={j: e.public_key for j, e in endpoints.items()},
    )
    return keys, endpoints


def test_sealed_shares_open_only_at_their_member_and_reconstruct_the_client_values():
    keys, endpoints = _keys(range(7))
    rng = np.random.default_rng(1)
    update, noise = rng.integers(-99, 99, D), rng.integers(-30, 30, (2, D))
    sealed = seal_client_shares(keys, 3, update, noise)  # OS share randomness
    assert set(sealed.shares) == set(range(7)) and len(sealed.public_key) == 32
    rows = {}
    for j, envelope in sealed.shares.items():
        assert isinstance(envelope, Envelope) and envelope.sender == 3
        endpoints[j].connect(3, sealed.public_key)
        rows[j] = endpoints[j].open_array(envelope, round_=keys.round, stage=DMMStage.SHARE)
        with pytest.raises(ChannelError):  # another member cannot open it
            other = endpoints[(j + 1) % 7]
            other.connect(3, sealed.public_key)
            other.open(envelope, round_=keys.round, stage=DMMStage.SHARE)
    scheme, blocks = keys.scheme(), PackedShamir(7, 2, 3).blocks_for(D)
    field = MersenneField(61)
    holders = [0, 2, 4, 5, 6]  # any t + k = 5 members
    stacked = np.stack([rows[j] for j in holders])
    for a, secret in enumerate([update, *noise]):
        segment = stacked[:, a * blocks : (a + 1) * blocks]
        opened = field.decode_signed(scheme.reconstruct(segment, holders, D))
        np.testing.assert_array_equal(opened, secret)


def test_client_sharing_checks_its_inputs():
    keys, _ = _keys(range(7))
    good = np.zeros(D, dtype=np.int64), np.zeros((2, D), dtype=np.int64)
    with pytest.raises(ValueError, match="party=-1"):
        seal_client_shares(keys, -1, *good)
    with pytest.raises(ValueError, match=r"update has shape \(7,\)"):
        seal_client_shares(keys, 0, np.zeros(7, dtype=np.int64), good[1])
    with pytest.raises(ValueError, match="noise has shape"):
        seal_client_shares(keys, 0, good[0], np.zeros((1, D), dtype=np.int64))
    with pytest.raises(ValueError, match="dtype float64"):
        seal_client_shares(keys, 0, np.zeros(D), good[1])


def test_server_finishes_rounds_from_envelopes_and_drops_a_tampering_client():
    """open_round -> clients seal -> run_sealed_round: a bit flipped in one client's envelope
    fails AEAD at its member, the client is left out and the noise count excludes it."""
    noising = IntegerNoising(honaker_tree(4), F)
    protocol = DMMCommitteeProtocol(PackedShamir(7, 2, 3), noising, D)
    ideal = DMMCommitteeProtocol(PackedShamir(7, 2, 3), noising, D, mode="ideal")
    with pytest.raises(ValueError, match="call open_round first"):
        protocol.run_sealed_round({})
    with pytest.raises(ValueError, match="ideal mode takes the clients' plaintext"):
        ideal.open_round(DMMFaults(), 0)
    rng = np.random.default_rng(2)
    for step in range(3):
        rows = noising.rows_drawn_at(step).size
        updates = {i: rng.integers(-99, 99, D) for i in range(5)}
        noises = {i: rng.integers(-30, 30, (rows, D)) for i in range(5)}
        faults = DMMFaults(member={(step, DMMStage.COMBINE): "drop"})
        keys = protocol.open_round(faults, step)
        assert keys.rows == rows and sorted(keys.member_keys) == list(range(7))
        sealed = {i: seal_client_shares(keys, 10 + i, updates[i], noises[i]) for i in range(5)}
        if step == 1:  # client 2 sends member 4 a corrupted ciphertext
            bad = sealed[2].shares[4]
            body = bytes([bad.ciphertext[0] ^ 0x80]) + bad.ciphertext[1:]
            altered = Envelope(bad.sender, bad.receiver, bad.round, bad.stage, bad.nonce, body)
            shares = {**sealed[2].shares, 4: altered}
            sealed[2] = SealedShares(sealed[2].party, sealed[2].public_key, shares)
        out = protocol.run_sealed_round(sealed)
        present = [i for i in range(5) if step != 1 or i != 2]
        expected = ideal.run_round(
            {i: updates[i] for i in present}, {i: noises[i] for i in present}, faults, step
        )
        np.testing.assert_array_equal(out.release, expected.release)
        assert list(out.clients) == present
        assert out.excluded == ((2,) if step == 1 else ())
        assert out.transcript.messages(stage=DMMStage.SHARE) > 0
    assert protocol.noise_counts == ideal.noise_counts
    assert protocol.noise_counts[int(noising.rows_drawn_at(1)[0])] == 4
    keys = protocol.open_round(DMMFaults(), 3)
    one = seal_client_shares(keys, 1, updates[0], np.zeros((keys.rows, D), dtype=np.int64))
    with pytest.raises(ValueError, match="distinct integers"):
        protocol.run_sealed_round({0: one, 1: one})
    # the round stays open for a well-formed batch
    out = protocol.run_sealed_round({0: one})
    assert out.clients == (0,) and protocol.step == 4


# ---------------------------------------------------------------------- through Flower
@pytest.fixture(scope="module")
def training():
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, inner


def _capturing(app, captured):
    outer = ClientApp()

    @outer.train()
    def train(message, context):
        reply = app(message, context)
        captured.append((message, context, reply))
        return reply

    @outer.evaluate()
    def evaluate(message, context):
        return app(message, context)

    return outer


def _as_ideal(message):
    """The same instruction for the no-cryptography reference (mode = ideal)."""
    message.content = RecordDict(
        {
            name: ConfigRecord({**dict(record), "dmm.mode": "ideal"})
            if isinstance(record, ConfigRecord)
            else record
            for name, record in message.content.items()
        }
    )
    return message


def test_full_mode_replies_hold_no_plaintext_and_the_server_gets_envelopes_only(
    local_engine, training, monkeypatch
):
    data, dataset, model, inner = training
    sharing = dmm_client_app(inner)
    captured, relayed = [], []
    finish = DMMCommitteeProtocol.run_sealed_round

    def recording(self, sealed):
        relayed.append(dict(sealed))
        return finish(self, sealed)

    def plaintext_path(self, *args, **kwargs):
        raise AssertionError("full mode must not hand plaintext to the committee protocol")

    monkeypatch.setattr(DMMCommitteeProtocol, "run_sealed_round", recording)
    monkeypatch.setattr(DMMCommitteeProtocol, "run_round", plaintext_path)
    strategy = _dmm("full")
    digits = (data, dataset, model, _capturing(sharing, captured))
    run(local_engine, digits, strategy, 0.0)
    assert len(captured) == ROUNDS * CLIENTS and len(relayed) == ROUNDS
    for sealed in relayed:
        assert len(sealed) == CLIENTS
        for item in sealed.values():
            assert isinstance(item, SealedShares)
            assert len(item.shares) == 10
            assert all(isinstance(e, Envelope) for e in item.shares.values())
    for message, context, reply in captured[:CLIENTS]:  # round 1, every client
        assert set(reply.content.keys()) == {SEALED_KEY, "metrics"}
        assert not any(isinstance(r, ArrayRecord) for r in reply.content.values())
        record = reply.content[SEALED_KEY]
        assert set(record.keys()) == {"public-key", "members", "nonces", "ciphertexts"}
        assert len(record["public-key"]) == 32 and record["members"] == list(range(10))
        # the same client's plaintext, from the same seeds, in the reference mode
        plain = sharing(_as_ideal(message), context)
        update = to_numpy(plain.content[UPDATE_KEY])[UPDATE_KEY]
        noise = to_numpy(plain.content[NOISE_KEY])[NOISE_KEY]
        assert update.shape == (1024,) and noise.shape[1] == 1024 and np.any(update)
        field = MersenneField(61)
        needles = [update.tobytes()[:48], field.encode_signed(update).tobytes()[:48]]
        needles += [row.tobytes()[:48] for row in noise]
        for blob in record["ciphertexts"]:
            assert len(blob) > update.size * 8 // 3  # one member's shares of every segment
            assert not any(needle in blob for needle in needles)


def test_a_client_envelope_with_a_flipped_bit_drops_that_client(local_engine, training):
    """Round 2: one client's envelope to member 0 is altered; AEAD refuses it, the round
    releases the other clients' sum (equal to the reference without that client) and epsilon
    counts only the noise actually present."""
    data, dataset, model, inner = training
    digits = (data, dataset, model, dmm_client_app(inner))
    victim = {}

    def tamper(server_round, replies):
        if server_round != 2:
            return replies
        node = min(int(r.metadata.src_node_id) for r in replies)
        victim["node"] = node
        for reply in replies:
            if int(reply.metadata.src_node_id) == node:
                record = dict(reply.content[SEALED_KEY])
                first = record["ciphertexts"][0]
                body = first[:5] + bytes([first[5] ^ 0x01]) + first[6:]
                record["ciphertexts"] = [body, *record["ciphertexts"][1:]]
                reply.content[SEALED_KEY] = ConfigRecord(record)
        return replies

    def without_victim(server_round, replies):
        if server_round != 2:
            return replies
        return [r for r in replies if int(r.metadata.src_node_id) != victim["node"]]

    full = _dmm("full")
    final_full, releases_full, eps_full = run(local_engine, digits, full, 0.0, tamper)
    ideal = _dmm("ideal")
    final_ideal, releases_ideal, eps_ideal = run(local_engine, digits, ideal, 0.0, without_victim)
    clients, _ = releases_full[1]
    assert victim["node"] not in clients and len(clients) == CLIENTS - 1
    assert full.outputs[1].excluded == (victim["node"],)
    for (clients_a, a), (clients_b, b) in zip(releases_full, releases_ideal):
        assert clients_a == clients_b
        np.testing.assert_array_equal(a, b)
    for key in final_full:
        np.testing.assert_array_equal(final_full[key], final_ideal[key])
    assert eps_full == eps_ideal
    assert full.privacy_report()["fewest_noise_clients"] == CLIENTS - 1
