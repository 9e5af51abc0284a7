"""The server against SecAgg+ with the AES-256-CTR mask PRG (``prg = "aes-ctr"``): what it
holds of one client before unmasking, its masked input, is uniform in Z_2^32 whatever that
client's input (all zeros or a constant), and carries no trace of it; only the sum opens."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.secagg.common import SecAggConfig
from protocols.secagg.prg import MaskPRG
from protocols.secagg.server import run_secagg

LENGTH = 4096
TARGET = 100


def _chi_square_top_bits(words: np.ndarray, bits: int = 4) -> float:
    counts = np.bincount((words.astype(np.uint64) >> np.uint64(32 - bits)).astype(np.int64),
                         minlength=1 << bits)
    expected = words.size / (1 << bits)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("value", [0, 2**31 + 12345])
def test_the_server_sees_a_uniform_masked_input_whatever_the_input(value):
    """Chi-square of the top 4 bits under chi2(15)'s 0.999 quantile (37.70) for the target's
    masked input, none of its coordinates equal to its input, and the sum still exact."""
    config = SecAggConfig(8, 6, 4, LENGTH, ring_bits=32, prg=MaskPRG.AES_CTR)
    space = config.masking
    rng = np.random.default_rng(11)
    inputs = {TARGET + i: space.asarray(rng.integers(0, 2**32, LENGTH, dtype=np.uint64))
              for i in range(1, 8)}
    inputs[TARGET] = space.asarray(np.full(LENGTH, value, dtype=np.uint64))
    result = run_secagg(config, inputs, np.random.default_rng(12))
    held = np.asarray(result.server.view.masked_inputs[TARGET])
    assert _chi_square_top_bits(held) < 37.70
    assert np.count_nonzero(held == inputs[TARGET]) <= 2  # ~LENGTH / 2^32 expected
    expected = space.sum(np.stack([inputs[i] for i in result.survivors]), axis=0)
    np.testing.assert_array_equal(result.aggregate, expected)
    # the attack works on an unmasked view: the same statistic on the input itself fails
    assert _chi_square_top_bits(inputs[TARGET]) > 37.70
