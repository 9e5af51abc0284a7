"""DMM clients share and seal their own update and fresh noise (docs/dmm-design.md step 3): each
seat opens only its own envelope, the shares reconstruct the client's values, the client's
randomness is its own, and its reply leaves only ciphertexts and its public key."""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsim.models import initial_arrays
from fedsim.randomness import NODE_SECRET_KEY, RunSecret
from fedsim.record_codec import to_numpy, to_record
from protocols.channels import ChannelError, Endpoint, new_session_id
from protocols.dmm.client import seal_client_shares
from protocols.dmm.common import PROTOCOL, DMMKeys, DMMStage, RoundKeys
from protocols.kit import SEAT_ID_BASE
from strategies.methods.dmm import dmm_client_app
from strategies.secure.dmm.wire import round_keys_config

D = 8


def _keys(seats, rows=2, round_=4, dim=D):
    session = new_session_id()
    endpoints = {j: Endpoint(SEAT_ID_BASE + j, session, protocol=PROTOCOL) for j in seats}
    keys = RoundKeys(
        round=round_,
        step=1,
        rows=rows,
        n=7,
        t=2,
        k=3,
        field_exponent=61,
        dim=dim,
        session_id=session,
        member_keys={j: e.public_key for j, e in endpoints.items()},
    )
    return keys, endpoints


def test_sealed_shares_open_only_at_their_seat_and_reconstruct_the_client_values():
    keys, endpoints = _keys(range(7))
    rng = np.random.default_rng(1)
    update, noise = rng.integers(-99, 99, D), rng.integers(-30, 30, (2, D))
    sealed = seal_client_shares(keys, 3, update, noise, np.random.default_rng(2))
    assert set(sealed.shares) == set(range(7)) and len(sealed.public_key) == 32
    rows = {}
    for j, envelope in sealed.shares.items():
        endpoints[j].connect(3, sealed.public_key)
        rows[j] = endpoints[j].open_array(envelope, round_=4, stage=DMMStage.SHARE, sender=3)
        other = endpoints[(j + 1) % 7]
        other.connect(3, sealed.public_key)
        with pytest.raises(ChannelError):
            other.open_array(envelope, round_=4, stage=DMMStage.SHARE, sender=3)
    scheme = keys.scheme()
    seats = [0, 2, 4, 5, 6]
    length = 3 * scheme.blocks_for(D) * scheme.k
    values = scheme.reconstruct(np.stack([rows[j] for j in seats]), seats, length)
    segments = scheme.field.decode_signed(values).reshape(3, -1)[:, :D]
    np.testing.assert_array_equal(segments[0], update)
    np.testing.assert_array_equal(segments[1:], noise)


def test_client_sharing_checks_its_inputs():
    keys, _ = _keys(range(7))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="party"):
        seal_client_shares(keys, -1, np.zeros(D, int), np.zeros((2, D), int), rng)
    with pytest.raises(ValueError, match="update has shape"):
        seal_client_shares(keys, 1, np.zeros(D + 1, int), np.zeros((2, D), int), rng)
    with pytest.raises(ValueError, match="noise has shape"):
        seal_client_shares(keys, 1, np.zeros(D, int), np.zeros((1, D), int), rng)
    with pytest.raises(ValueError, match="numpy Generator"):
        seal_client_shares(keys, 1, np.zeros(D, int), np.zeros((2, D), int), None)


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def _instruction(mode, keys=None, party=0):
    data, dataset, model, inner = digits_setup(4)
    arrays = to_record(initial_arrays(model, 0))
    config = {
        "server-round": 4,
        "dmm.dim": 650,
        "dmm.clip": 1.0,
        "dmm.gamma": 0.001,
        "dmm.beta": 0.0,
        "dmm.max-tries": 100,
        "dmm.rotation-seed": 11,
        "dmm.noise-std": 40.0,
        "dmm.rows": 2,
        "dmm.mode": mode,
    }
    if keys is not None:
        config.update(round_keys_config(keys, party))
    content = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
    message = Message(content, 4294967301, "train")
    return inner, message


def _context(secret: RunSecret | None, partition=0):
    node_config = {"partition-id": partition, "num-partitions": 4}
    if secret is not None:
        node_config[NODE_SECRET_KEY] = secret.client(partition).token()
    return Context(
        run_id=1, node_id=4294967301, node_config=node_config, state=RecordDict(), run_config={}
    )


def test_full_mode_reply_holds_ciphertexts_and_a_public_key_only():
    keys, _ = _keys(range(7), dim=1024)
    inner, message = _instruction("full", keys, party=2)
    reply = dmm_client_app(inner)(message, _context(SECRETS))
    assert set(reply.content.keys()) == {DMMKeys.SEALED}
    record = reply.content[DMMKeys.SEALED]
    assert set(record.keys()) == {"public-key", "members", "nonces", "ciphertexts"}
    # the same client in the plaintext reference: nothing of its values is in the ciphertexts
    inner, plain = _instruction("ideal")
    ideal = dmm_client_app(inner)(plain, _context(SECRETS))
    update = to_numpy(ideal.content[DMMKeys.UPDATE])[DMMKeys.UPDATE]
    assert np.any(update)
    needles = [update.tobytes()[i : i + 32] for i in range(0, 256, 32)]
    assert not any(n in blob for n in needles for blob in record["ciphertexts"])
    # with metrics released in the clear (an explicit switch), the metrics come along
    inner, message = _instruction("full", keys, party=2)
    loud = dmm_client_app(inner, metrics_in_clear=True)(message, _context(SECRETS))
    assert {"dmm.tries", "dmm.clipped"} <= set(loud.content["metrics"].keys())


def test_a_clients_noise_is_its_own_and_reproducible_from_its_secret():
    inner, message = _instruction("ideal")
    app = dmm_client_app(inner)

    def noise(secret, partition=0):
        reply = app(message, _context(secret, partition))
        return to_numpy(reply.content[DMMKeys.NOISE])[DMMKeys.NOISE]

    first = noise(SECRETS)
    np.testing.assert_array_equal(first, noise(SECRETS))  # reproducible simulation
    assert not np.array_equal(first, noise(RunSecret.from_passphrase("other run")))
    assert not np.array_equal(first, noise(SECRETS, partition=1))
    assert not np.array_equal(noise(None), noise(None))  # no secret: fresh OS randomness
    assert first.shape == (2, 1024) and 30 < np.std(first) < 50
