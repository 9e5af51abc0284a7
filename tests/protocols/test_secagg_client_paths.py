"""The SecAgg+ client's short paths give what the long ones gave: signed input straight into
the state, the ring encoding cast from a narrow dtype, a restored client that never opens."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from fedsim.privacy.mechanisms import discrete_gaussian
from fedsim.randomness import NODE_SECRET_KEY, RunSecret, client_secret
from fedsim.record_codec import to_numpy
from protocols.encoding import DDGaussEncoder
from protocols.field import DEFAULT_FIELD
from protocols.secagg.common import RingZ2k, SecAggKeys, Stage
from protocols.secagg.stages import MaskedInput, ShareKeys, Unmask, handle
from protocols.secagg.state import ClientState
from strategies import secure
from strategies.secure import secagg_client_stages as client_stages
from tests.protocols.test_protocols_secagg_stages import _round, _same

PREFIX = "t."


def _reference_encode_signed(ring: RingZ2k, integers: np.ndarray) -> np.ndarray:
    """The ring's signed encoding as it was: through int64 and uint64."""
    wide = np.asarray(integers).astype(np.int64)
    return ring._wrap(wide.astype(np.uint64).astype(ring.dtype))


@pytest.mark.parametrize("bits", [8, 20, 32, 33, 64])
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8])
def test_ring_encoding_of_a_narrow_dtype_is_the_int64_one(bits, dtype):
    ring = RingZ2k(bits)
    info = np.iinfo(dtype)
    half = 1 << (bits - 1)
    low, high = max(int(info.min), -half), min(int(info.max), half - 1)
    rng = np.random.default_rng(bits)
    values = np.concatenate([[low, high, 0], rng.integers(low, high, 500, endpoint=True)])
    values = values.astype(dtype)
    got = ring.encode_signed(values)
    assert got.dtype == ring.dtype
    assert np.array_equal(got, _reference_encode_signed(ring, values))
    assert np.array_equal(ring.decode_signed(got), values.astype(np.int64))


def test_ring_encoding_still_refuses_what_would_wrap_and_asarray_what_is_outside():
    with pytest.raises(ValueError, match="would wrap in Z_2"):
        RingZ2k(8).encode_signed(np.array([128], dtype=np.int16))
    with pytest.raises(ValueError, match="would wrap in Z_2"):
        RingZ2k(32).encode_signed(np.array([-(2**31) - 1], dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        RingZ2k(20).asarray(np.array([1 << 20], dtype=np.uint32))
    words = np.array([0, 2**32 - 1], dtype=np.uint32)
    assert RingZ2k(32).asarray(words) is words  # every uint32 is in Z_2^32: no pass, no copy


def test_ddgauss_encoding_carries_its_signed_integers_and_their_field_elements():
    encoder = DDGaussEncoder(dim=100, clip=1.0, gamma=0.01, noise_std=0.05)
    x = np.random.default_rng(3).standard_normal(100) * 0.1
    draw = np.random.default_rng(4)
    encoded = encoder.encode(x, 7, draw, sampler=discrete_gaussian)
    assert encoded.signed.dtype == np.int64 and encoded.signed.size == encoder.padded_dim
    assert np.array_equal(encoded.elements, DEFAULT_FIELD.encode_signed(encoded.signed))
    assert np.array_equal(DEFAULT_FIELD.decode_signed(encoded.elements), encoded.signed)
    assert encoded.signed.any()


@pytest.mark.parametrize("name", ["secagg", "plaintext"])
def test_contributing_signed_integers_is_contributing_their_field_elements(name):
    signed = np.random.default_rng(5).integers(-3000, 3000, 64)
    config = ConfigRecord({PREFIX + SecAggKeys.SESSION: bytes(range(32))})
    own = {NODE_SECRET_KEY: RunSecret.from_passphrase("paths").client(0).token()}
    contexts = [Context(1, 5, dict(own), RecordDict(), {}) for _ in range(2)]
    secret = client_secret(own)
    elements = DEFAULT_FIELD.encode_signed(signed)
    replies = [
        secure.CONTRIBUTE[name](contexts[0], secret, config, elements, 3, PREFIX),
        secure.CONTRIBUTE_SIGNED[name](contexts[1], secret, config, signed, 3, PREFIX),
    ]
    if name == "plaintext":
        key = PREFIX + "encoded"
        sent = [to_numpy(reply[key])[key] for reply in replies]
        assert np.array_equal(sent[0], elements) and np.array_equal(sent[1], elements)
        return
    keys = [dict(reply[SecAggKeys.KEYS]) for reply in replies]
    assert keys[0] == keys[1]  # the same secret: the same keys
    stored = [client_stages._load(context) for context in contexts]
    assert np.array_equal(stored[1].values, signed) and stored[1].values.dtype == np.int16
    assert _same(stored[0].to_arrays(), stored[1].to_arrays())


def test_a_restored_client_that_never_opens_stores_its_receive_keys_as_they_were():
    config, server, routed, states, _ = _round()
    envelopes = {}
    for i in states:
        message = ShareKeys(i, config, True, routed[i])
        states[i], envelopes[i] = handle(Stage.SHARE_KEYS, states[i], message)
    incoming = server.share_keys(envelopes)
    masked = {}
    for i in states:
        states[i], masked[i] = handle(Stage.MASKED_INPUT, states[i], MaskedInput(incoming[i]))
    survivors, dropped = server.masked_input(masked)
    for i in survivors:
        before = states[i].to_arrays()
        assert before["receive_keys"].shape == (len(routed[i]), 32)
        restored = ClientState.from_arrays(before)
        assert _same(restored.to_arrays(), before)  # restored, not opened: the same rows
        after, _ = handle(Stage.UNMASK, restored, Unmask(survivors, dropped))
        assert after.stage is Stage.DONE
        assert np.array_equal(after.to_arrays()["receive_keys"], before["receive_keys"])
