"""SecAgg+'s mask PRG as a named choice (:class:`protocols.secagg.prg.MaskPRG`): the default is
ChaCha20 with the masks and the config record it always had (a record without ``prg`` reads as
it), an unknown PRG is refused by name and code on the wire and as ``strategy.options.prg``."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedsim.config import ConfigError
from protocols.field import DEFAULT_FIELD
from protocols.secagg.common import RingZ2k, SecAggConfig, SecAggKeys, prg
from protocols.secagg.prg import MaskPRG
from strategies.registry import build_strategy

KEY = bytes(range(32))


def test_the_default_prg_is_chacha20_and_its_record_is_unchanged():
    """Without ``prg`` the masks are ChaCha20's words and the record holds the eight
    parameters it always held; a record without the entry reads as ChaCha20."""
    words = np.frombuffer(
        Cipher(algorithms.ChaCha20(KEY, bytes(16)), None).encryptor().update(bytes(8 * 64)),
        dtype="<u8",
    )
    low = words & np.uint64(DEFAULT_FIELD.modulus)
    expected = low[low != DEFAULT_FIELD.modulus][:50].astype(np.int64)
    config = SecAggConfig(6, 4, 3, 50)
    assert config.prg is MaskPRG.CHACHA20 and config.masking is DEFAULT_FIELD
    np.testing.assert_array_equal(prg(config.masking, KEY, 50), expected)
    assert list(config.to_record()) == [
        "num-clients", "degree", "threshold", "vector-length", "round", "min-survivors",
        "ring-bits", "field-exponent",
    ]  # fmt: skip
    assert SecAggConfig.from_record(config.to_record()) == config
    assert SecAggConfig(6, 4, 3, 50, ring_bits=32).masking == RingZ2k(32)
    assert repr(SecAggConfig(6, 4, 3, 50, ring_bits=32).masking) == "RingZ2k(bits=32)"


def test_an_unknown_prg_is_refused_on_the_wire_and_in_a_config():
    record = SecAggConfig(5, 4, 3, 8).to_record()
    record[SecAggKeys.PRG] = len(MaskPRG)
    with pytest.raises(ValueError, match=f"'prg': {len(MaskPRG)}; allowed: 'chacha20'"):
        SecAggConfig.from_record(record)
    with pytest.raises(ValueError, match="'prg': 'rc4'"):
        SecAggConfig(5, 4, 3, 8, prg="rc4")
    facts = dict(expected_clients=8, evaluate_fraction=0.0, seed=0)
    built = build_strategy("fedavg", {"secure_sum": "secagg", "prg": "chacha20"}, **facts)
    assert built.secure.plan.config(1, 6, 3).prg is MaskPRG.CHACHA20
    with pytest.raises(ConfigError, match="strategy.options.prg = 'rc4'") as caught:
        build_strategy("fedavg", {"secure_sum": "secagg", "prg": "rc4"}, **facts)
    assert "'chacha20'" in str(caught.value)
    with pytest.raises(ConfigError, match="strategy.options.prg = 1"):
        build_strategy("fedavg", {"secure_sum": "secagg", "prg": 1}, **facts)
