"""Client test rows from the held-out pools of the client's classes (data.client_test)."""

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec, build_dataset
from fedsim.data.class_pool import hold_out_pools

SPEC = dict(
    source="femnist",
    femnist_classes=10,
    partition="split-classes",
    classes_per_client=5,
    num_clients=6,
    samples_per_client=40,
    test_fraction=0.2,
    seed=3,
)


def _rows(arrays, k):
    x, y = arrays.client(k)
    return x.reshape(len(x), -1), y


def _as_set(x):
    return {row.tobytes() for row in x}


def test_pools_are_stratified_disjoint_and_leave_every_class_training_rows():
    y = np.repeat(np.arange(4), [10, 11, 3, 1])
    kept, test, validation = hold_out_pools(y, 0.2, np.random.default_rng(0))
    assert np.array_equal(np.sort(np.concatenate([kept, test, validation])), np.arange(y.size))
    for c, n in enumerate((10, 11, 3, 1)):
        m = min(int(np.floor(0.2 * n + 0.5)), (n - 1) // 2)
        assert (y[test] == c).sum() == m == (y[validation] == c).sum()
        assert (y[kept] == c).sum() == n - 2 * m >= 1


def test_each_client_is_tested_on_every_pool_row_of_its_classes_and_nothing_else():
    test_side = build_dataset(DatasetSpec(**SPEC, client_test="class-pool"))
    val_side = build_dataset(DatasetSpec(**SPEC, client_test="class-pool-validation"))
    # the same training rows in both
    for key in ("x", "y", "offsets"):
        assert np.array_equal(getattr(test_side.train, key), getattr(val_side.train, key))
    train_all = _as_set(test_side.train.x.reshape(len(test_side.train.x), -1))
    pools = []
    for data in (test_side, val_side):
        x, y = data.test.x.reshape(len(data.test.x), -1), data.test.y
        pool = {row.tobytes(): int(label) for row, label in zip(x, y, strict=True)}
        pools.append(set(pool))
        assert not pools[-1] & train_all  # no pool row is anyone's training row
        for k in range(SPEC["num_clients"]):
            classes = set(_rows(data.train, k)[1].tolist())
            tx, ty = _rows(data.test, k)
            assert set(ty.tolist()) == classes
            want = {r for r, label in pool.items() if label in classes}
            assert _as_set(tx) == want and len(tx) == len(want)
    assert not pools[0] & pools[1]  # validation rows are never test rows


def test_pooled_test_rows_repeat_the_pool_evenly():
    data = build_dataset(DatasetSpec(**SPEC, client_test="class-pool"))
    x = data.test.x.reshape(len(data.test.x), -1)
    _, counts = np.unique(x, axis=0, return_counts=True)
    groups = SPEC["num_clients"] // (SPEC["femnist_classes"] // SPEC["classes_per_client"])
    assert set(counts.tolist()) == {groups}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"client_test": "pooled"}, "data.client_test"),
        ({"client_test": "class-pool", "partition": "iid"}, "data.partition"),
        ({"client_test": "class-pool", "test_fraction": 0.5}, "data.test_fraction"),
        ({"client_test": "class-pool-validation", "test_fraction": 0.0}, "data.test_fraction"),
    ],
)
def test_bad_client_test_settings_name_their_key(change, key):
    with pytest.raises(ConfigError) as err:
        DatasetSpec(**{**SPEC, **change})
    assert err.value.key == key
