"""Client test rows from held-out pools of the client's classes (``[data] client_test``).

The pFedVEM / pFedHB evaluation: a personal model is tested on the *global* test rows of the
classes its client trains on, not on a few rows cut from the client's own data. Before the
partitioner runs, :func:`hold_out_pools` sets aside, in every class c, ``m_c =
round(test_fraction · n_c)`` rows as the test pool and ``m_c`` more as the validation pool
(stratified, drawn with the split generator); the partitioner splits the rest, and
:func:`from_class_pool` gives client k every row of one pool whose label is among its
training labels. ``"class-pool"`` reads the test pool, ``"class-pool-validation"`` the
validation pool: the two share the training rows exactly, so settings chosen on the second
are then reported on the first without the test rows ever being seen.

A pool row appears under every client that holds its class. With the split-classes
partition (the only one these modes accept) each class is held by exactly one member of
every group, so the pooled test rows are the pool repeated once per group and any accuracy
over them equals the pool's.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from fedsim.config import require
from fedsim.data.dataset import ClientArrays, FederatedDataset

ClientTest = Literal["own", "class-pool", "class-pool-validation"]
CLIENT_TESTS = ("own", "class-pool", "class-pool-validation")


def hold_out_pools(
    y: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kept, test_pool, validation_pool)`` row indices of ``y``, each sorted: per class
    ``m_c = round(fraction · n_c)`` test rows and ``m_c`` validation rows drawn without
    replacement (``m_c`` at most ``(n_c − 1) // 2``, so a class keeps a training row)."""
    kept, test, validation = [], [], []
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        rows = rows[rng.permutation(rows.size)]
        m = min(int(np.floor(fraction * rows.size + 0.5)), (rows.size - 1) // 2)
        test.append(rows[:m])
        validation.append(rows[m : 2 * m])
        kept.append(rows[2 * m :])
    return tuple(
        np.sort(np.concatenate(part)).astype(np.int64) for part in (kept, test, validation)
    )


def from_class_pool(
    x: np.ndarray,
    y: np.ndarray,
    parts: list[np.ndarray],
    pool: np.ndarray,
    num_classes: int,
    name: str,
) -> FederatedDataset:
    """Client k trains on all of ``parts[k]`` and is tested on the rows of ``pool`` whose
    label is among ``y[parts[k]]`` (in pool order)."""
    require(pool.size > 0, "data.test_fraction", 0, "> 0 with a class-pool client_test")
    y64 = np.asarray(y).astype(np.int64, copy=False)
    tests = [pool[np.isin(y64[pool], np.unique(y64[p]))] for p in parts]
    return FederatedDataset(
        _client_arrays(x, y64, parts), _client_arrays(x, y64, tests), int(num_classes), name
    )


def _client_arrays(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> ClientArrays:
    sizes = np.array([p.size for p in parts], dtype=np.int64)
    rows = np.concatenate(parts).astype(np.int64) if sizes.sum() else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return ClientArrays(np.asarray(x)[rows], y[rows], offsets)
