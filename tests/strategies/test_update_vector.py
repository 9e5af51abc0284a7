"""The client's update vector: trained minus global, flattened in record order."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.plumbing.vectors import difference, flatten


def test_difference_is_flatten_minus_flatten_bit_for_bit():
    rng = np.random.default_rng(5)
    trained = {
        "w": rng.standard_normal((30, 40)).astype(np.float32),
        "b": np.asfortranarray(rng.standard_normal((6, 5))),
        "s": np.array(3.5, dtype=np.float16),
        "n": np.arange(7, dtype=np.int64) * 3**30,
        "e": np.zeros((0, 3), dtype=np.float32),
    }
    base = {
        "w": rng.standard_normal((30, 40)).astype(np.float32),
        "b": rng.standard_normal((6, 5)).astype(np.float32),
        "s": np.array(1.25, dtype=np.float32),
        "n": np.arange(7, dtype=np.int32),
        "e": np.zeros((0, 3), dtype=np.float32),
    }
    got, want = difference(trained, base), flatten(trained) - flatten(base)
    assert got.dtype == np.float64 and got.shape == (1200 + 30 + 1 + 7,)
    assert got.tobytes() == want.tobytes()


def test_difference_refuses_arrays_that_do_not_pair():
    one = {"w": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="are not the global"):
        difference(one, {"v": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="'w': trained has 3 entries, global 4"):
        difference(one, {"w": np.zeros(4, np.float32)})
