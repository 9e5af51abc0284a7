"""Client-contiguous arrays, train/test splitting, shipping, save/load, specs and the cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsim.config import ConfigError, from_mapping
from fedsim.data import (
    ClientArrays,
    DatasetSpec,
    FederatedDataset,
    build_dataset,
    cached_dataset,
    from_partition,
    register_dataset,
)
from fedsim.data import spec as spec_module
from fedsim.data.dataset import read_rows


def _arrays(sizes=(3, 0, 2)):
    n = sum(sizes)
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 2, 2)
    y = np.arange(n, dtype=np.int64) % 3
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return ClientArrays(x, y, offsets)


def _equal(a: FederatedDataset, b: FederatedDataset) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a.to_arrays().values(), b.to_arrays().values()))


# --------------------------------------------------------------------------- ClientArrays


def test_client_views_are_zero_copy_and_correct():
    ca = _arrays()
    assert ca.num_clients == 3
    assert ca.sizes().tolist() == [3, 0, 2]
    x0, y0 = ca.client(0)
    x2, y2 = ca.client(np.int64(2))
    assert np.shares_memory(x0, ca.x) and np.shares_memory(y2, ca.y)
    assert np.array_equal(x2, ca.x[3:5]) and np.array_equal(y0, ca.y[:3])
    x1, y1 = ca.client(1)
    assert x1.shape == (0, 2, 2) and y1.shape == (0,)


@pytest.mark.parametrize("k", [-1, 3, 1.0, True])
def test_client_index_out_of_range(k):
    with pytest.raises(ConfigError, match="client"):
        _arrays().client(k)


def test_client_arrays_validation():
    x = np.zeros((4, 2), np.float32)
    y = np.zeros(4, np.int64)
    with pytest.raises(ConfigError, match="offsets"):
        ClientArrays(x, y, np.array([0, 3], np.int64))  # does not end at n
    with pytest.raises(ConfigError, match="offsets"):
        ClientArrays(x, y, np.array([0, 3, 2, 4], np.int64))  # decreasing
    with pytest.raises(ConfigError, match="offsets"):
        ClientArrays(x, y, np.array([0, 4], np.int32))
    with pytest.raises(ConfigError, match="y"):
        ClientArrays(x, y[:3], np.array([0, 3], np.int64))
    with pytest.raises(ConfigError, match="y"):
        ClientArrays(x, y.astype(np.int32), np.array([0, 4], np.int64))


# --------------------------------------------------------------------------- from_partition


def _toy(n=200):
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = (np.arange(n) % 5).astype(np.int64)
    return x, y


def test_from_partition_keeps_each_clients_rows_and_splits():
    x, y = _toy()
    rng = np.random.default_rng(0)
    parts = [np.sort(rng.choice(200, 40, replace=False))]
    rest = np.setdiff1d(np.arange(200), parts[0])
    parts += [rest[:1], rest[1:11], np.array([], np.int64), rest[11:]]
    ds = from_partition(x, y, parts, 0.25, np.random.default_rng(1), 5, "toy")
    assert ds.num_clients == 5 and ds.feature_shape == (3,) and ds.name == "toy"
    for k, part in enumerate(parts):
        xtr, ytr = ds.train.client(k)
        xte, yte = ds.test.client(k)
        rows_tr, rows_te = xtr[:, 0].astype(int), xte[:, 0].astype(int)
        assert np.array_equal(np.sort(np.concatenate([rows_tr, rows_te])), part)
        assert np.all(np.diff(rows_tr) > 0) and np.all(np.diff(rows_te) > 0)  # order kept
        assert np.array_equal(ytr, y[rows_tr]) and np.array_equal(yte, y[rows_te])
        if part.size:
            assert len(ytr) >= 1
            assert len(yte) == min(int(np.floor(0.25 * part.size + 0.5)), part.size - 1)
    assert ds.test.sizes().tolist() == [10, 0, 3, 0, 37]
    cx, cy = ds.central_test
    assert cx is ds.test.x and cy is ds.test.y


def test_from_partition_test_rows_are_random_and_seeded():
    x, y = _toy()
    parts = [np.arange(100), np.arange(100, 200)]

    def test_rows(seed):
        ds = from_partition(x, y, parts, 0.3, np.random.default_rng(seed), 5, "t")
        return ds.test.x[:, 0]

    assert np.array_equal(test_rows(4), test_rows(4))
    assert not np.array_equal(test_rows(4), test_rows(5))
    assert not np.array_equal(test_rows(4)[:30], np.arange(30))  # not simply the first rows


def test_from_partition_rejects_bad_input():
    x, y = _toy(10)
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="parts"):
        from_partition(x, y, [np.arange(5), np.arange(4, 10)], 0.2, rng, 5, "t")
    with pytest.raises(ConfigError, match="parts"):
        from_partition(x, y, [np.arange(5), np.array([10])], 0.2, rng, 5, "t")
    with pytest.raises(ConfigError, match="test_fraction"):
        from_partition(x, y, [np.arange(10)], 1.0, rng, 5, "t")
    with pytest.raises(ConfigError, match="y"):
        from_partition(x, y, [np.arange(10)], 0.2, rng, 3, "t")  # labels >= num_classes


# --------------------------------------------------------------------------- FederatedDataset


@pytest.fixture(scope="module")
def digits_ds() -> FederatedDataset:
    return build_dataset(
        DatasetSpec(source="digits", partition="dirichlet", num_clients=25, alpha=0.3, seed=2)
    )


def test_stats_are_json_ready_and_consistent(digits_ds):
    stats = digits_ds.stats()
    text = json.dumps(stats)
    assert json.loads(text)["total_samples"] == 1797
    assert stats["train"]["total_samples"] + stats["test"]["total_samples"] == 1797
    assert stats["train"]["sizes"]["min"] >= 1
    assert stats["train"]["sizes"]["mean"] == pytest.approx(len(digits_ds.train.y) / 25)
    assert sum(stats["train"]["label_histogram"]["counts"]) == len(digits_ds.train.y)
    assert stats["feature_shape"] == [1, 8, 8] and stats["num_clients"] == 25
    assert 1 <= stats["train"]["classes_per_client"]["min"] <= 10


def test_to_from_arrays_is_zero_copy(digits_ds):
    arrays = digits_ds.to_arrays()
    assert sorted(arrays) == sorted(
        ["train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets"]
    )
    rebuilt = FederatedDataset.from_arrays(arrays, digits_ds.num_classes, digits_ds.name)
    for key, arr in rebuilt.to_arrays().items():
        assert np.shares_memory(arr, arrays[key])
    assert rebuilt.num_classes == 10
    with pytest.raises(ConfigError, match="arrays"):
        FederatedDataset.from_arrays({"train_x": arrays["train_x"]}, 10, "x")


def test_save_load_round_trip_with_mmap(digits_ds, tmp_path):
    digits_ds.save(tmp_path / "ds")
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["num_classes"] == 10
    loaded = FederatedDataset.load(tmp_path / "ds")
    assert isinstance(loaded.train.x, np.memmap) and isinstance(loaded.test.y, np.memmap)
    assert _equal(loaded, digits_ds)
    assert loaded.name == digits_ds.name and loaded.num_classes == 10
    for k in range(loaded.num_clients):  # memory-mapped clients are read from the file
        for split, ref in ((loaded.train, digits_ds.train), (loaded.test, digits_ds.test)):
            (xk, yk), (xr, yr) = split.client(k), ref.client(k)
            assert not np.shares_memory(xk, split.x) and xk.dtype == xr.dtype
            assert np.array_equal(xk, xr) and np.array_equal(yk, yr)
    inner = loaded.train.x[7:]  # a view that starts inside the file
    assert np.array_equal(read_rows(inner, 3, 9), digits_ds.train.x[10:16])
    assert read_rows(inner, 4, 4).shape == (0, *inner.shape[1:])
    eager = FederatedDataset.load(tmp_path / "ds", mmap=False)
    assert not isinstance(eager.train.x, np.memmap) and _equal(eager, digits_ds)
    with pytest.raises(ConfigError, match="path"):
        FederatedDataset.load(tmp_path / "missing")


def test_mismatched_splits_rejected():
    a, b = _arrays((3, 0, 2)), _arrays((1, 1))
    with pytest.raises(ConfigError, match="test.num_clients"):
        FederatedDataset(a, b, 3, "x")
    with pytest.raises(ConfigError, match="num_classes"):
        FederatedDataset(a, a, 0, "x")


# --------------------------------------------------------------------------- DatasetSpec


def test_spec_from_mapping_and_build_is_deterministic():
    mapping = {
        "source": "digits",
        "partition": "shards",
        "num_clients": 20,
        "classes-per-client": 3,
        "seed": 7,
    }
    spec = from_mapping(DatasetSpec, mapping, "data")
    assert spec.classes_per_client == 3 and spec.test_fraction == 0.2
    a, b = build_dataset(spec), build_dataset(spec)
    assert _equal(a, b)
    other = build_dataset(from_mapping(DatasetSpec, {**mapping, "seed": 8}, "data"))
    assert not _equal(a, other)
    assert a.num_clients == 20
    assert a.stats()["train"]["classes_per_client"]["max"] <= 3


@pytest.mark.parametrize(
    "change, key",
    [
        ({"source": "digits", "partition": "natural"}, "data.partition"),
        ({"source": "mnist"}, "data.source"),
        ({"partition": "random"}, "data.partition"),
        ({"num_clients": 0}, "data.num_clients"),
        ({"num_clients": "ten"}, "data.num_clients"),
        ({"alpha": 0.0}, "data.alpha"),
        ({"alpha": -1}, "data.alpha"),
        ({"test_fraction": 1.0}, "data.test_fraction"),
        ({"classes_per_client": 0}, "data.classes_per_client"),
        ({"quantity_sigma": -0.5}, "data.quantity_sigma"),
        ({"synthetic_beta": -1.0}, "data.synthetic_beta"),
        ({"samples_per_client": -1}, "data.samples_per_client"),
        ({"seed": -1}, "data.seed"),
        ({"source": "leaf", "partition": "natural"}, "data.path"),
        (
            {"source": "table", "partition": "natural", "path": "/nonexistent/x.parquet"},
            "data.path",
        ),
        ({"source": "npy", "partition": "natural", "path": "/nonexistent"}, "data.path"),
        ({"feature_columns": ["a", 3]}, "data.feature_columns"),
        ({"colour": "red"}, "data.colour"),
    ],
)
def test_bad_specs_name_the_key(change, key):
    mapping = {"source": "digits", "partition": "iid", "num_clients": 10, **change}
    with pytest.raises(ConfigError) as err:
        from_mapping(DatasetSpec, mapping, "data")
    assert key in str(err.value)


def test_impossible_partition_names_the_spec_key():
    with pytest.raises(ConfigError, match="data.classes_per_client"):
        build_dataset(
            DatasetSpec(source="digits", partition="shards", num_clients=5, classes_per_client=11)
        )
    with pytest.raises(ConfigError, match="num_clients"):
        build_dataset(DatasetSpec(source="digits", partition="iid", num_clients=5000))


def test_npy_source_memory_maps_first_clients(digits_ds, tmp_path):
    digits_ds.save(tmp_path / "saved")
    spec = DatasetSpec(
        source="npy", partition="natural", num_clients=10, path=str(tmp_path / "saved")
    )
    ds = build_dataset(spec)
    assert isinstance(ds.train.x, np.memmap) and ds.num_clients == 10
    for k in range(10):
        assert np.array_equal(ds.train.client(k)[1], digits_ds.train.client(k)[1])
        assert np.array_equal(ds.test.client(k)[0], digits_ds.test.client(k)[0])
    with pytest.raises(ConfigError, match="data.num_clients"):
        build_dataset(
            DatasetSpec(
                source="npy", partition="natural", num_clients=26, path=str(tmp_path / "saved")
            )
        )
    resplit = build_dataset(
        DatasetSpec(source="npy", partition="iid", num_clients=4, path=str(tmp_path / "saved"))
    )
    assert resplit.num_clients == 4 and resplit.stats()["total_samples"] == 1797


@pytest.mark.parametrize("source", ["synthetic", "femnist"])
def test_generated_sources_natural_and_resplit(source):
    natural = build_dataset(
        DatasetSpec(source=source, partition="natural", num_clients=6, samples_per_client=40)
    )
    assert natural.num_clients == 6
    assert np.all(natural.train.sizes() >= 1)
    iid = build_dataset(
        DatasetSpec(source=source, partition="iid", num_clients=6, samples_per_client=40)
    )
    assert iid.stats()["total_samples"] == natural.stats()["total_samples"]
    assert (
        iid.stats()["train"]["mean_label_tv_distance"]
        < natural.stats()["train"]["mean_label_tv_distance"]
    )


# --------------------------------------------------------------------------- cache


def test_cache_builds_once_and_accepts_registered(monkeypatch, digits_ds):
    monkeypatch.setattr(spec_module, "_CACHE", {})
    calls = []
    real_build = spec_module.build_dataset

    def counting_build(spec):
        calls.append(spec)
        return real_build(spec)

    monkeypatch.setattr(spec_module, "build_dataset", counting_build)
    spec = DatasetSpec(source="digits", partition="iid", num_clients=4)
    first = cached_dataset(spec)
    assert cached_dataset(DatasetSpec(source="digits", partition="iid", num_clients=4)) is first
    assert len(calls) == 1
    shipped = FederatedDataset.from_arrays(digits_ds.to_arrays(), 10, "shipped")
    other = DatasetSpec(source="digits", partition="dirichlet", num_clients=25, alpha=0.3, seed=2)
    register_dataset(other, shipped)
    assert cached_dataset(other) is shipped
    assert len(calls) == 1
    with pytest.raises(ConfigError, match="dataset"):
        register_dataset(other, digits_ds.train)
