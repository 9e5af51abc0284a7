"""Sources: bundled digits, synthetic(alpha, beta), FEMNIST-like writers, LEAF JSON, tables."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from fedsim.config import ConfigError
from fedsim.data import (
    DatasetSpec,
    build_dataset,
    femnist_like,
    load_digits,
    load_leaf,
    load_table,
    partition_stats,
    synthetic_fedprox,
)


def _pooled(parts):
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    owner = np.repeat(np.arange(len(parts)), [len(p[1]) for p in parts])
    return x, y, owner


def _fit_accuracy(x, y):
    """Training accuracy of a nearly unregularised multinomial logistic regression."""
    if np.unique(y).size == 1:
        return 1.0
    # one BLAS thread: small fits are far slower when threads fight over 2 cores
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore")
        clf = LogisticRegression(C=1e4, max_iter=1000).fit(x, y)
    return clf.score(x, y)


def test_load_digits():
    x, y = load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


# --------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_sizes_and_determinism():
    parts = synthetic_fedprox(30, 1.0, 1.0, np.random.default_rng(0))
    assert len(parts) == 30
    for x, y in parts:
        assert x.dtype == np.float32 and x.shape[1] == 60 and y.dtype == np.int64
        assert 50 <= len(y) <= 1000 and y.min() >= 0 and y.max() < 10
    again = synthetic_fedprox(30, 1.0, 1.0, np.random.default_rng(0))
    other = synthetic_fedprox(30, 1.0, 1.0, np.random.default_rng(1))
    assert all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(parts, again)
    )
    assert not np.array_equal(parts[0][0][:50], other[0][0][:50])


def test_synthetic_labels_are_a_linear_argmax_per_client_not_globally():
    def first_rows(parts):  # 50 rows per device (the minimum), so no device dominates
        return [(x[:50], y[:50]) for x, y in parts]

    parts = first_rows(synthetic_fedprox(20, 0.5, 0.5, np.random.default_rng(3), dim=5))
    for x, y in parts:
        assert _fit_accuracy(x, y) == 1.0  # each device: labels = argmax of a linear map
    x, y, _ = _pooled(parts)
    assert _fit_accuracy(x, y) < 0.7  # devices use different linear maps
    iid = first_rows(synthetic_fedprox(20, 0.5, 0.5, np.random.default_rng(3), dim=5, iid=True))
    xi, yi, _ = _pooled(iid)
    assert _fit_accuracy(xi, yi) >= 0.99  # iid: one shared map


def test_synthetic_beta_increases_heterogeneity():
    def measure(beta):
        spread, tv = [], []
        for seed in range(3):
            parts = synthetic_fedprox(60, 0.0, beta, np.random.default_rng(seed))
            means = np.array([x.mean() for x, _ in parts])
            spread.append(means.std())
            _, y, _ = _pooled(parts)
            idx = np.split(np.arange(len(y)), np.cumsum([len(p[1]) for p in parts])[:-1])
            tv.append(partition_stats(idx, y, 10)["mean_label_tv_distance"])
        return np.mean(spread), np.mean(tv)

    spread0, tv0 = measure(0.0)
    spread3, tv3 = measure(3.0)
    assert spread3 > 5 * spread0
    assert tv3 > tv0


def test_synthetic_alpha_only_shifts_logits_uniformly():
    # u_k adds the same amount to every class logit, so with the same draws the labels
    # do not change with alpha (the FedProx construction; see the docstring).
    a = synthetic_fedprox(10, 0.0, 1.0, np.random.default_rng(9))
    b = synthetic_fedprox(10, 5.0, 1.0, np.random.default_rng(9))
    agree = np.mean(np.concatenate([ya == yb for (_, ya), (_, yb) in zip(a, b)]))
    assert agree > 0.999


def test_synthetic_bad_input():
    with pytest.raises(ConfigError, match="alpha"):
        synthetic_fedprox(3, -1.0, 1.0, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="num_clients"):
        synthetic_fedprox(0, 1.0, 1.0, np.random.default_rng(0))


# --------------------------------------------------------------------------- FEMNIST-like


def test_femnist_like_benchmark_size_shapes_and_determinism():
    parts = femnist_like(1000, np.random.default_rng(0), samples_per_writer=100)
    assert len(parts) == 1000
    x, y, _ = _pooled(parts[:50])
    assert x.shape == (5000, 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    assert all(len(p[1]) == 100 for p in parts)
    assert float(parts[-1][0].min()) >= 0.0 and float(parts[-1][0].max()) <= 1.0
    assert np.unique(np.concatenate([p[1] for p in parts])).size == 62
    small = femnist_like(5, np.random.default_rng(0), samples_per_writer=100)
    again = femnist_like(5, np.random.default_rng(0), samples_per_writer=100)
    other = femnist_like(5, np.random.default_rng(1), samples_per_writer=100)
    assert all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(small, again)
    )
    assert not np.array_equal(small[0][0], other[0][0])


def test_femnist_like_lognormal_sizes():
    parts = femnist_like(300, np.random.default_rng(2))
    sizes = np.array([len(y) for _, y in parts])
    assert sizes.min() >= 10 and sizes.max() <= 1000
    assert 150 < sizes.mean() < 300 and sizes.std() > 50


def test_femnist_like_is_learnable_across_writers():
    parts = femnist_like(80, np.random.default_rng(0), samples_per_writer=80)
    x, y, _ = _pooled(parts)
    x = x.reshape(len(x), 14, 2, 14, 2).mean(axis=(2, 4)).reshape(len(x), -1)  # 2x2 pooling
    cut = 60 * 80  # train on 60 writers, test on 20 unseen writers
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore")
        clf = LogisticRegression(max_iter=100).fit(x[:cut], y[:cut])
    majority = np.bincount(y[:cut]).max() / cut
    acc = clf.score(x[cut:], y[cut:])
    assert acc > 0.4 and acc > 10 * majority


def test_femnist_like_writers_differ():
    parts = femnist_like(8, np.random.default_rng(4), samples_per_writer=400, num_classes=4)
    _, y, owner = _pooled(parts)
    idx = [np.flatnonzero(owner == w) for w in range(8)]
    assert partition_stats(idx, y, 4)["mean_label_tv_distance"] > 0.2  # label skew
    between, within = [], []
    for w1 in range(8):
        for w2 in range(w1 + 1, 8):
            (x1, y1), (x2, y2) = parts[w1], parts[w2]
            for c in range(4):
                a, b = x1[y1 == c], x2[y2 == c]
                if len(a) >= 30 and len(b) >= 30:
                    between.append(np.abs(a.mean(0) - b.mean(0)).mean())
                    half = len(a) // 2
                    within.append(np.abs(a[:half].mean(0) - a[half:].mean(0)).mean())
    assert len(between) >= 5
    assert np.median(between) > 2 * np.median(within)  # style: same class, other writer


# --------------------------------------------------------------------------- LEAF


def _write_leaf(root, train_users, test_users, dim=784):
    rng = np.random.default_rng(0)
    for split, users in (("train", train_users), ("test", test_users)):
        (root / split).mkdir(parents=True)
        names = list(users)
        half = len(names) // 2
        for i, chunk in enumerate((names[:half], names[half:])):
            blob = {
                "users": chunk,
                "num_samples": [users[u] for u in chunk],
                "user_data": {
                    u: {
                        "x": rng.random((users[u], dim)).round(3).tolist(),
                        "y": rng.integers(0, 62, users[u]).tolist(),
                    }
                    for u in chunk
                },
            }
            (root / split / f"part_{i}.json").write_text(json.dumps(blob))


def test_load_leaf_natural_partition(tmp_path):
    _write_leaf(tmp_path, {"f2": 5, "f0": 3, "f1": 4}, {"f0": 2, "f2": 1, "f3": 2})
    train, test = load_leaf(tmp_path)
    assert len(train) == len(test) == 4  # users f0..f3, sorted
    assert [len(y) for _, y in train] == [3, 4, 5, 0]
    assert [len(y) for _, y in test] == [2, 0, 1, 2]
    assert train[0][0].shape == (3, 1, 28, 28) and train[3][0].shape == (0, 1, 28, 28)
    assert train[0][0].dtype == np.float32 and train[0][1].dtype == np.int64
    blob = json.loads((tmp_path / "train" / "part_0.json").read_text())
    assert blob["users"] == ["f2"]
    assert np.allclose(train[2][0].reshape(5, -1), np.array(blob["user_data"]["f2"]["x"]))
    assert np.array_equal(train[2][1], blob["user_data"]["f2"]["y"])


def test_leaf_spec_build(tmp_path):
    _write_leaf(tmp_path, {"a": 6, "b": 4, "c": 5}, {"a": 2, "b": 2, "c": 2}, dim=10)
    ds = build_dataset(
        DatasetSpec(source="leaf", partition="natural", num_clients=2, path=str(tmp_path))
    )
    assert ds.num_clients == 2 and ds.feature_shape == (10,)
    assert ds.train.sizes().tolist() == [6, 4] and ds.test.sizes().tolist() == [2, 2]
    with pytest.raises(ConfigError, match="data.num_clients"):
        build_dataset(
            DatasetSpec(source="leaf", partition="natural", num_clients=4, path=str(tmp_path))
        )
    pooled = build_dataset(
        DatasetSpec(source="leaf", partition="iid", num_clients=3, path=str(tmp_path))
    )
    assert pooled.stats()["total_samples"] == 21


def test_leaf_errors(tmp_path):
    with pytest.raises(ConfigError, match="path"):
        load_leaf(tmp_path)  # no train/ test/
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "train" / "bad.json").write_text('{"users": ["u"]}')
    with pytest.raises(ConfigError, match="user_data"):
        load_leaf(tmp_path)


# --------------------------------------------------------------------------- tables


def _table_rows():
    return {
        "client_id": ["b", "a", "b", "c", "a", "b"],
        "label": [1, 0, 2, 1, 1, 0],
        "f1": [0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
        "f2": [1, 2, 3, 4, 5, 6],
        "x": [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0], [5.0, 1.0]],
    }


def _write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.table(rows), path)
    else:
        keys = list(rows)
        lines = [json.dumps({k: rows[k][i] for k in keys}) for i in range(len(rows[keys[0]]))]
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_load_table_columns_and_list_features(tmp_path, suffix):
    path = _write(tmp_path / f"data{suffix}", _table_rows())
    parts = load_table(path, feature_columns=("f1", "f2"))
    assert len(parts) == 3  # a, b, c
    (xa, ya), (xb, yb), (xc, yc) = parts
    assert xa.dtype == np.float32 and ya.dtype == np.int64
    assert np.array_equal(ya, [0, 1]) and np.array_equal(yb, [1, 2, 0]) and yc.tolist() == [1]
    assert np.allclose(xb, [[0.5, 1], [1.5, 3], [3.0, 6]])
    listed = load_table(path)  # the list-valued "x" column
    assert np.allclose(listed[0][0], [[1.0, 1.0], [4.0, 1.0]]) and listed[0][0].shape == (2, 2)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_load_table_errors_name_the_column(tmp_path, suffix):
    rows = _table_rows()
    rows["features"] = rows.pop("x")
    path = _write(tmp_path / f"data{suffix}", rows)
    assert np.allclose(load_table(path)[2][0], [[3.0, 1.0]])  # falls back to "features"
    with pytest.raises(ConfigError, match="user") as err:
        load_table(path, client_column="user")
    assert "client_id" in str(err.value)  # lists the columns present
    with pytest.raises(ConfigError, match="label_column"):
        load_table(path, label_column="f1")  # not integer
    with pytest.raises(ConfigError, match="f9"):
        load_table(path, feature_columns=("f1", "f9"))
    with pytest.raises(ConfigError, match="feature_columns"):
        load_table(path, feature_columns=("client_id",))
    del rows["features"]
    bare = _write(tmp_path / f"bare{suffix}", rows)  # every other column is a feature
    assert np.allclose(load_table(bare)[1][0], [[0.5, 1], [1.5, 3], [3.0, 6]])
    rows["note"] = ["x"] * len(rows["label"])
    noted = _write(tmp_path / f"noted{suffix}", rows)
    with pytest.raises(ConfigError, match="feature_columns = 'note'"):
        load_table(noted)


def test_load_table_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="path"):
        load_table(tmp_path / "missing.parquet")
    text = tmp_path / "data.txt"
    text.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match=r"\.parquet, \.csv or \.jsonl"):
        load_table(text)


def test_load_table_reads_csv_with_or_without_client_ids(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("client_id,label,a,b\nu2,1,0.5,1\nu1,0,1.5,2\nu2,2,2.5,3\n")
    (x1, y1), (x2, y2) = load_table(csv)  # clients u1, u2 (sorted), rows in file order
    assert y1.tolist() == [0] and y2.tolist() == [1, 2]
    assert np.allclose(x2, [[0.5, 1], [2.5, 3]]) and x2.dtype == np.float32
    pooled = tmp_path / "pooled.csv"
    pooled.write_text("label,a,b\n1,0.5,1\n0,1.5,2\n")
    [(x, y)] = load_table(pooled, require_clients=False)  # one pool of rows
    assert y.tolist() == [1, 0] and x.shape == (2, 2)
    with pytest.raises(ConfigError, match="client_column = 'client_id'"):
        load_table(pooled)


def test_table_spec_build(tmp_path):
    path = _write(tmp_path / "data.parquet", _table_rows())
    spec = DatasetSpec(
        source="table",
        partition="natural",
        num_clients=2,
        path=str(path),
        feature_columns=("f1", "f2"),
        test_fraction=0.5,
    )
    ds = build_dataset(spec)
    assert ds.num_clients == 2 and ds.num_classes == 3 and ds.feature_shape == (2,)
    assert (ds.train.sizes() + ds.test.sizes()).tolist() == [2, 3]
    with pytest.raises(ConfigError, match="data.num_clients"):
        build_dataset(
            DatasetSpec(source="table", partition="natural", num_clients=4, path=str(path))
        )
