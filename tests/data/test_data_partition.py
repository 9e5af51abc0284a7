"""Partitioners: coverage, disjointness, skew knobs, determinism, errors, statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.data import (
    PARTITIONERS,
    DatasetSpec,
    build_dataset,
    dirichlet_partition,
    iid_partition,
    load_digits,
    partition_stats,
    quantity_skew_partition,
    shard_partition,
    split_classes_partition,
)

PARAMS = {
    "iid": {},
    "dirichlet": {"alpha": 0.3},
    "shards": {"classes_per_client": 2},
    "quantity": {"sigma": 1.0},
    "split-classes": {"classes_per_client": 2},
}


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    return load_digits()[1]


def _classes_per_client(parts, labels):
    return np.array([np.unique(labels[p]).size for p in parts])


def _check_partition(parts, labels, num_clients, covering=True):
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64 and p.ndim == 1 and p.size >= 1
        assert np.all(np.diff(p) > 0)  # sorted, no duplicates
    allrows = np.concatenate(parts)
    assert np.unique(allrows).size == allrows.size  # disjoint
    assert allrows.min() >= 0 and allrows.max() < labels.size
    if covering:
        assert allrows.size == labels.size


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
@pytest.mark.parametrize("num_clients", [1, 7, 50])
def test_partition_is_disjoint_covering_nonempty(name, num_clients, digit_labels):
    parts = PARTITIONERS[name](digit_labels, num_clients, np.random.default_rng(3), **PARAMS[name])
    # shards leave out labels no client holds when num_clients * k < num_classes (documented)
    covering = not (name in ("shards", "split-classes") and num_clients * 2 < 10)
    _check_partition(parts, digit_labels, num_clients, covering)
    if not covering:
        assert np.unique(digit_labels[np.concatenate(parts)]).size == num_clients * 2


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_same_seed_same_partition_other_seed_differs(name, digit_labels):
    def run(seed):
        return PARTITIONERS[name](digit_labels, 20, np.random.default_rng(seed), **PARAMS[name])

    a, b, c = run(5), run(5), run(6)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_iid_sizes_balanced_and_labels_mixed(digit_labels):
    parts = iid_partition(digit_labels, 13, np.random.default_rng(0))
    sizes = np.array([p.size for p in parts])
    assert sizes.max() - sizes.min() <= 1
    assert _classes_per_client(parts, digit_labels).min() == 10


def test_dirichlet_alpha_controls_label_skew(digit_labels):
    def skew(alpha):
        cpc, tv = [], []
        for seed in range(3):
            parts = dirichlet_partition(digit_labels, 30, np.random.default_rng(seed), alpha=alpha)
            stats = partition_stats(parts, digit_labels, 10)
            cpc.append(stats["classes_per_client"]["mean"])
            tv.append(stats["mean_label_tv_distance"])
        return np.mean(cpc), np.mean(tv)

    cpc_small, tv_small = skew(0.05)
    cpc_large, tv_large = skew(100.0)
    assert cpc_small < 4.0 < 9.5 < cpc_large
    assert tv_small > 0.6 > 0.2 > tv_large


def test_dirichlet_repair_gives_every_client_min_size(digit_labels):
    parts = dirichlet_partition(digit_labels, 300, np.random.default_rng(1), alpha=0.01)
    _check_partition(parts, digit_labels, 300)
    parts = dirichlet_partition(
        digit_labels, 100, np.random.default_rng(1), alpha=0.01, min_size=15
    )
    _check_partition(parts, digit_labels, 100)
    assert min(p.size for p in parts) >= 15
    with pytest.raises(ConfigError, match="min_size"):
        dirichlet_partition(digit_labels, 100, np.random.default_rng(1), alpha=0.5, min_size=18)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
@pytest.mark.parametrize("num_clients", [10, 37, 100])
def test_shards_give_exactly_k_classes(k, num_clients, digit_labels):
    parts = shard_partition(
        digit_labels, num_clients, np.random.default_rng(k), classes_per_client=k
    )
    _check_partition(parts, digit_labels, num_clients)
    assert np.all(_classes_per_client(parts, digit_labels) == k)


def test_shards_label_sets_vary_and_balance(digit_labels):
    parts = shard_partition(digit_labels, 100, np.random.default_rng(0), classes_per_client=2)
    pairs = {tuple(np.unique(digit_labels[p])) for p in parts}
    assert len(pairs) > 10  # not the same few label pairs for everyone
    sizes = np.array([p.size for p in parts])
    assert sizes.max() <= 2 * sizes.min()


def test_shards_fewer_slots_than_classes_leaves_labels_out(digit_labels):
    parts = shard_partition(digit_labels, 3, np.random.default_rng(0), classes_per_client=2)
    assert np.all(_classes_per_client(parts, digit_labels) == 2)
    used = np.unique(digit_labels[np.concatenate(parts)])
    assert used.size == 6
    stats = partition_stats(parts, digit_labels, 10)
    assert stats["unassigned"] == int(np.isin(digit_labels, used, invert=True).sum())
    assert stats["overlap"] == 0


def test_shards_errors_name_the_parameter():
    labels = np.array([0] * 10 + [1])
    with pytest.raises(ConfigError, match="classes_per_client"):
        shard_partition(labels, 2, np.random.default_rng(0), classes_per_client=3)
    with pytest.raises(ConfigError, match="classes_per_client"):
        # label 1 (one sample) is dealt to two clients: one of them gets nothing
        shard_partition(labels, 4, np.random.default_rng(0), classes_per_client=1)


@pytest.mark.parametrize("num_clients", [10, 100])
def test_shards_with_sigma_keep_k_classes_and_skew_sizes(num_clients, digit_labels):
    def run(sigma, seed=0):
        return shard_partition(
            digit_labels,
            num_clients,
            np.random.default_rng(seed),
            classes_per_client=5,
            sigma=sigma,
        )

    default = shard_partition(digit_labels, num_clients, np.random.default_rng(0), 5)
    assert all(np.array_equal(a, b) for a, b in zip(run(0.0), default))  # sigma 0: unchanged
    for sigma in (0.5, 2.0):
        parts = run(sigma)
        _check_partition(parts, digit_labels, num_clients)
        assert np.all(_classes_per_client(parts, digit_labels) == 5)

    def cv(sigma):
        sizes = [np.array([p.size for p in run(sigma, seed)]) for seed in range(5)]
        return float(np.mean([s.std() / s.mean() for s in sizes]))

    assert cv(0.0) < 0.2 < cv(0.5) < cv(1.0) < cv(2.0)
    with pytest.raises(ConfigError, match="sigma"):
        run(-1.0)


def test_split_classes_pairs_split_the_classes_in_random_chunks(digit_labels):
    parts = split_classes_partition(digit_labels, 20, np.random.default_rng(4), 5)
    _check_partition(parts, digit_labels, 20)
    sets = [set(np.unique(digit_labels[p]).tolist()) for p in parts]
    assert all(len(s) == 5 for s in sets)
    for a, b in zip(sets[::2], sets[1::2], strict=True):  # each pair splits the ten classes
        assert a.isdisjoint(b) and a | b == set(range(10))
    assert len({frozenset(s) for s in sets}) > 2  # every pair draws its own split
    # each class is cut at random points: its holders' chunks differ in size
    held = [c for c in (np.count_nonzero(digit_labels[p] == 3) for p in parts) if c > 0]
    assert len(held) == 10 and sum(held) == np.count_nonzero(digit_labels == 3)
    assert max(held) > 2 * min(held)


def test_femnist_digits_split_in_pairs():
    """The FEMNIST-like source with its 10 digit classes, pairs of writers splitting them."""
    spec = DatasetSpec(
        source="femnist",
        partition="split-classes",
        femnist_classes=10,
        classes_per_client=5,
        num_clients=6,
        samples_per_client=40,
        test_fraction=0.25,
    )
    dataset = build_dataset(spec)
    assert dataset.num_classes == 10 and dataset.feature_shape == (1, 28, 28)
    classes = [
        set(np.unique(np.concatenate([dataset.train.client(k)[1], dataset.test.client(k)[1]])))
        for k in range(6)
    ]
    for a, b in zip(classes[::2], classes[1::2], strict=True):
        assert len(a) == len(b) == 5 and a | b == set(range(10))
    with pytest.raises(ConfigError, match="data.femnist_classes"):
        DatasetSpec(source="femnist", partition="natural", num_clients=2, femnist_classes=1)


def test_split_classes_refuses_what_it_cannot_split(digit_labels):
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match=r"classes_per_client = 3 .*divisor .*\(10\)"):
        split_classes_partition(digit_labels, 4, rng, 3)
    with pytest.raises(ConfigError, match=r"classes_per_client = 5 .*fewer rows than clients"):
        split_classes_partition(digit_labels[:60], 40, rng, 5)
    with pytest.raises(ConfigError, match="data.classes_per_client"):
        build_dataset(
            DatasetSpec(
                source="digits", partition="split-classes", classes_per_client=4, num_clients=4
            )
        )


def test_quantity_skew_spread_grows_with_sigma(digit_labels):
    def cv(sigma):
        out = []
        for seed in range(5):
            parts = quantity_skew_partition(
                digit_labels, 40, np.random.default_rng(seed), sigma=sigma
            )
            sizes = np.array([p.size for p in parts])
            out.append(sizes.std() / sizes.mean())
        return float(np.mean(out))

    parts = quantity_skew_partition(digit_labels, 40, np.random.default_rng(0), sigma=0.0)
    sizes = np.array([p.size for p in parts])
    assert sizes.max() - sizes.min() <= 1
    assert cv(0.3) < cv(1.0) < cv(2.0)
    assert cv(2.0) > 1.0


def test_bad_inputs_raise_config_error(digit_labels):
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="num_clients"):
        iid_partition(digit_labels, digit_labels.size + 1, rng)
    with pytest.raises(ConfigError, match="num_clients"):
        iid_partition(digit_labels, 0, rng)
    with pytest.raises(ConfigError, match="labels"):
        iid_partition(digit_labels.astype(float), 3, rng)
    with pytest.raises(ConfigError, match="labels"):
        iid_partition(np.array([0, -1, 2]), 2, rng)
    with pytest.raises(ConfigError, match="alpha"):
        dirichlet_partition(digit_labels, 3, rng, alpha=0.0)
    with pytest.raises(ConfigError, match="sigma"):
        quantity_skew_partition(digit_labels, 3, rng, sigma=-1.0)
    with pytest.raises(ConfigError, match="classes_per_client"):
        shard_partition(digit_labels, 3, rng, classes_per_client=0)


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_large_population_is_handled_vectorised(name):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=600_000)
    params = dict(PARAMS[name])
    if name == "dirichlet":
        params["alpha"] = 0.1
    parts = PARTITIONERS[name](labels, 200_000, rng, **params)
    assert len(parts) == 200_000
    sizes = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
    assert sizes.min() >= 1 and sizes.sum() == labels.size


def test_partition_stats_values():
    labels = np.array([0, 0, 1, 1, 2, 2, 2, 2])
    parts = [np.array([0, 1]), np.array([2, 3, 4, 5]), np.array([6, 7])]
    stats = partition_stats(parts, labels, 4)
    json.dumps(stats)
    assert stats["total_samples"] == 8 and stats["num_clients"] == 3
    assert stats["sizes"]["min"] == 2 and stats["sizes"]["max"] == 4
    assert stats["sizes"]["median"] == 2 and stats["sizes"]["mean"] == pytest.approx(8 / 3)
    assert stats["classes_per_client"] == {"mean": pytest.approx(4 / 3), "min": 1, "max": 2}
    assert stats["label_histogram"]["counts"] == [2, 2, 4, 0]
    # client 0: all label 0 vs global (1/4, 1/4, 1/2): TV = 3/4; client 2: TV = 1/2;
    # client 1: (0, 1/2, 1/2) vs global: TV = 1/4
    assert stats["mean_label_tv_distance"] == pytest.approx((0.75 + 0.25 + 0.5) / 3)
    assert stats["overlap"] == 0 and stats["unassigned"] == 0 and stats["empty_clients"] == 0
    bad = partition_stats(
        [np.array([0, 1]), np.array([1]), np.array([], dtype=np.int64)], labels, 4
    )
    assert bad["overlap"] == 1 and bad["unassigned"] == 6 and bad["empty_clients"] == 1
