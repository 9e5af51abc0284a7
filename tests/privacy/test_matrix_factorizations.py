"""Factorizations A = B C: closed forms, brute-force references, orientation and optimisers."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.privacy.matrix import (
    Factorization,
    Participation,
    banded,
    banded_toeplitz,
    binary_tree,
    blt,
    dense,
    honaker_tree,
    momentum,
    sqrt_factorization,
)
from fedsim.privacy.matrix.banded import (
    band_loss_and_grad,
    band_mask,
    band_storage_mask,
    from_band_storage,
    normalize_columns,
    to_band_storage,
)
from fedsim.privacy.matrix.blt import blt_coefficients, inverse_blt
from fedsim.privacy.matrix.dense import participation_mask, reverse_cholesky
from fedsim.privacy.matrix.toeplitz import (
    sqrt_coefficients,
    toeplitz_loss_and_grad,
    toeplitz_matrix,
)
from fedsim.privacy.matrix.tree import tree_nodes

N = 16

FACTORIES = {
    "tree": lambda n, A: binary_tree(n, A),
    "honaker": lambda n, A: honaker_tree(n, A),
    "sqrt": lambda n, A: sqrt_factorization(n, A),
    "banded_toeplitz": lambda n, A: banded_toeplitz(n, 4, workload=A, max_iter=50),
    "banded": lambda n, A: banded(n, 4, workload=A, max_iter=50),
    "dense": lambda n, A: dense(n, 2 if n % 2 == 0 else 1, workload=A, max_iter=50),
    "blt": lambda n, A: blt(n, 2, workload=A, max_iter=50),
}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("workload", ["prefix", "momentum"])
@pytest.mark.parametrize("n", [N, 13])
def test_every_factorization_reproduces_the_workload(kind, workload, n):
    A = None if workload == "prefix" else momentum(n, 0.9, np.linspace(1.0, 0.2, n))
    f = FACTORIES[kind](n, A)
    assert f.reconstruction_error() < 1e-10
    assert f.encoder.shape[1] == n and f.decoder.shape == (n, f.encoder.shape[0])
    G = f.noising_matrix()
    assert np.allclose(f.workload @ G, f.decoder, atol=1e-10)
    # everything is causal: round t's noise uses only noise released by round t
    if f.encoder.shape[0] == n:
        assert np.array_equal(f.encoder, np.tril(f.encoder))
    assert np.all(np.isfinite(f.rmse())) and f.loss() > 0


def test_sqrt_closed_form():
    f = sqrt_factorization(N)
    assert np.allclose(f.encoder @ f.encoder, np.tri(N), atol=1e-12)
    binomial = [math.comb(2 * j, j) / 4**j for j in range(N)]
    assert np.allclose(sqrt_coefficients(N), binomial, rtol=1e-14)
    assert np.array_equal(f.decoder, f.encoder)


def test_sqrt_error_grows_like_log_n():
    # last-round RMSE = ln(n) / pi + O(1) (Fichtenberger, Henzinger & Upadhyay 2023):
    # each fourfold increase of n adds ln(4) / pi
    sizes = [16, 64, 256, 1024]
    last = np.array([sqrt_factorization(n).rmse()[-1] for n in sizes])
    assert np.all(last >= np.log(sizes) / math.pi)
    assert np.allclose(np.diff(last), math.log(4) / math.pi, rtol=1e-2)
    # ... and the error is flat across rounds up to that log factor
    rmse = sqrt_factorization(256).rmse()
    assert np.all(np.diff(rmse) >= 0) and rmse[-1] < 2.0 * rmse[15]


def _dyadic_covers(n, t):
    """Brute force: every set of complete nodes (end <= t) whose intervals tile [0, t]."""
    nodes = [(h, k) for h, k in tree_nodes(n) if ((k + 1) << h) - 1 <= t]
    covers = []
    for size in range(1, len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            cells = sorted(i for h, k in subset for i in range(k << h, (k + 1) << h))
            if cells == list(range(t + 1)):
                covers.append(set(subset))
        if covers:
            return covers
    return covers


@pytest.mark.parametrize("n", [8, 11])
def test_binary_tree_rows_are_the_smallest_dyadic_cover(n):
    f = binary_tree(n)
    nodes = tree_nodes(n)
    for t in range(n):
        smallest = _dyadic_covers(n, t)
        assert len(smallest) == 1
        chosen = {nodes[i] for i in np.flatnonzero(f.decoder[t])}
        assert chosen == smallest[0]
        assert set(np.unique(f.decoder[t])) <= {0.0, 1.0}
        assert len(chosen) == bin(t + 1).count("1")


@pytest.mark.parametrize("n", [16, 13])
def test_honaker_is_the_least_squares_estimate_from_complete_nodes(n):
    f = honaker_tree(n)
    C = f.encoder
    end = np.array([((k + 1) << h) - 1 for h, k in tree_nodes(n)])
    for t in range(n):
        done = end <= t
        Ct = C[done]
        a = np.zeros(n)
        a[: t + 1] = 1.0
        gls = a @ np.linalg.pinv(Ct)  # min-variance unbiased weights on the complete nodes
        assert np.allclose(f.decoder[t, done], gls, atol=1e-10)
        assert np.all(f.decoder[t, ~done] == 0)
    assert np.all(f.squared_error_per_round() <= binary_tree(n).squared_error_per_round() + 1e-12)


def test_tree_columns_have_log_n_plus_one_nodes():
    for n in (8, 64, 1024):
        assert binary_tree(n).max_column_norm() ** 2 == pytest.approx(math.log2(n) + 1)


@pytest.mark.parametrize(("n", "bands"), [(16, 4), (20, 7), (12, 1)])
def test_bandmf_columns_have_norm_one_and_sensitivity_root_k(n, bands):
    f = banded(n, bands, max_iter=100)
    assert np.max(np.abs(np.linalg.norm(f.encoder, axis=0) - 1.0)) < 1e-12
    assert np.all(f.encoder[~band_mask(n, bands)] == 0)
    for k in (1, 2, 3):
        p = Participation.separated(bands, k)
        fit = len(range(0, n, bands))
        assert f.sensitivity(p).value ** 2 == pytest.approx(min(k, fit), rel=1e-12)


def test_bandmf_optimiser_improves_on_its_start():
    n, bands = 24, 4
    start = normalize_columns(toeplitz_matrix(sqrt_coefficients(bands), n))
    start_loss = np.sum(np.linalg.solve(start.T, np.tri(n).T) ** 2) / n
    assert banded(n, bands).loss() < start_loss


def test_reverse_cholesky_orientation():
    rng = np.random.default_rng(0)
    M = rng.standard_normal((12, 12))
    X = M @ M.T + 12 * np.eye(12)
    C = reverse_cholesky(X)
    assert np.array_equal(C, np.tril(C))
    assert np.allclose(C.T @ C, X, atol=1e-10)
    assert np.allclose(np.linalg.norm(C, axis=0) ** 2, np.diag(X))
    # the plain Cholesky factor has the right rows, not the right columns
    L = np.linalg.cholesky(X)
    assert not np.allclose(np.linalg.norm(L, axis=0) ** 2, np.diag(X))


@pytest.mark.parametrize(("n", "epochs"), [(16, 1), (16, 4), (24, 3)])
def test_dense_columns_have_the_norm_the_sensitivity_uses(n, epochs):
    f = dense(n, epochs, max_iter=200)
    C = f.encoder
    X = C.T @ C
    b = n // epochs
    # participation mask holds: a user's own rounds are orthogonal
    assert np.allclose(X[~participation_mask(n, epochs)], 0.0, atol=1e-12)
    # every pattern has squared norm 1: sum of its columns' squared norms
    norms2 = np.linalg.norm(C, axis=0) ** 2
    assert np.allclose([norms2[r::b].sum() for r in range(b)], 1.0, atol=1e-12)
    p = Participation.fixed(epochs)
    result = f.sensitivity(p)
    assert result.exact and result.value == pytest.approx(1.0, abs=1e-12)
    # the wrongly oriented factor of the same X breaks that norm
    wrong = np.linalg.cholesky(X)
    assert np.linalg.norm(wrong, axis=0).max() > np.linalg.norm(C, axis=0).max() + 1e-3


def test_multi_epoch_optimised_factorizations_beat_sqrt():
    n, epochs = 32, 4
    p = Participation.fixed(epochs)
    baseline = sqrt_factorization(n).loss(p)
    candidates = {
        "dense": dense(n, epochs),
        "banded": banded(n, n // epochs),
        "banded_toeplitz": banded_toeplitz(n, n // epochs, p),
        "blt": blt(n, 3, p),
    }
    for name, f in candidates.items():
        assert f.sensitivity(p).exact, name
        assert f.loss(p) < baseline, name
    assert candidates["dense"].loss(p) <= min(f.loss(p) for f in candidates.values()) + 1e-9


def test_single_participation_blt_and_dense_beat_sqrt():
    n = 64
    baseline = sqrt_factorization(n).loss()
    assert blt(n, 3).loss() < baseline
    assert dense(n).loss() < baseline


def test_blt_coefficients_are_positive_and_non_increasing():
    f = blt(48, 3, Participation.separated(12, 4))
    c = f.params["coef"]
    assert np.all(c > 0) and np.all(np.diff(c) <= 0)
    assert np.allclose(f.encoder[:, 0], c)


@pytest.mark.parametrize("workload", [None, "momentum"])
def test_toeplitz_gradient_matches_finite_differences(workload):
    n = 12
    A = None if workload is None else momentum(n, 0.8, np.linspace(1.0, 0.3, n))
    c = np.r_[1.0, 0.6 * 0.8 ** np.arange(n - 1)]
    _, grad = toeplitz_loss_and_grad(c, A, 3, 3)
    eps, numeric = 1e-6, np.zeros(n)
    for i in range(n):
        e = np.zeros(n)
        e[i] = eps
        numeric[i] = (
            toeplitz_loss_and_grad(c + e, A, 3, 3)[0] - toeplitz_loss_and_grad(c - e, A, 3, 3)[0]
        ) / (2 * eps)
    assert np.allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("workload", [None, "momentum"])
def test_band_loss_and_gradient_match_dense_reference(workload):
    n, bands = 9, 3
    A = None if workload is None else momentum(n, 0.5, np.linspace(1.0, 0.5, n))
    dense_a = np.tri(n) if A is None else A
    valid = band_storage_mask(n, bands)
    ab = np.where(valid, np.random.default_rng(2).uniform(0.5, 1.5, (bands, n)), 0.0)

    def reference(ab):
        C = normalize_columns(from_band_storage(ab))
        return float(np.sum((dense_a @ np.linalg.inv(C)) ** 2))

    loss, grad = band_loss_and_grad(ab, A)
    assert loss == pytest.approx(reference(ab), rel=1e-12)
    eps = 1e-6
    for d, j in zip(*np.nonzero(valid), strict=True):
        E = np.zeros_like(ab)
        E[d, j] = eps
        numeric = (reference(ab + E) - reference(ab - E)) / (2 * eps)
        assert numeric == pytest.approx(grad[d, j], rel=1e-5, abs=1e-7)
    assert np.all(grad[~valid] == 0)


def test_band_storage_round_trip():
    C = np.tril(np.arange(1.0, 26.0).reshape(5, 5)) * band_mask(5, 2)
    assert np.array_equal(from_band_storage(to_band_storage(C, 2)), C)


def test_arguments_are_checked_by_name():
    with pytest.raises(ConfigError, match="bands"):
        banded_toeplitz(16, 8, Participation.separated(4, 2))
    with pytest.raises(ConfigError, match="bands"):
        banded(16, 0)
    with pytest.raises(ConfigError, match="epochs"):
        dense(16, 3)
    with pytest.raises(ConfigError, match="buffers"):
        blt(16, 0)
    with pytest.raises(ConfigError, match="workload"):
        sqrt_factorization(4, np.ones((4, 4)))
    with pytest.raises(ConfigError, match="reduction"):
        sqrt_factorization(4).loss(reduction="median")


def test_blt_inverse_is_a_blt_with_the_same_number_of_buffers():
    f = blt(40, 3, max_iter=100)
    w_hat, theta_hat = inverse_blt(f.params["weights"], f.params["thetas"])
    assert w_hat.shape == (3,) and np.isrealobj(theta_hat)
    assert np.allclose(blt_coefficients(w_hat, theta_hat, 40), f.noising_matrix()[:, 0], atol=1e-12)


@pytest.mark.parametrize("kind", ["tree", "honaker", "blt", "dense"])
def test_apply_noising_matches_the_materialised_matrix(kind):
    f = FACTORIES[kind](12, None)
    Z = np.random.default_rng(1).standard_normal((f.encoder.shape[0], 3))
    assert np.allclose(f.apply_noising(Z), f.noising_matrix() @ Z, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_save_and_load_round_trip(kind, tmp_path):
    f = FACTORIES[kind](12, None)
    path = tmp_path / "f.npz"
    f.save(path)
    g = Factorization.load(path)
    assert g.kind == f.kind and np.array_equal(g.encoder, f.encoder)
    assert g.params.keys() == f.params.keys()
    p = Participation.separated(3, 2)
    assert g.summary(p) == f.summary(p)


def test_full_band_optimiser_agrees_with_the_dense_optimiser():
    # two different parameterisations of the same problem (column-normalised lower-triangular
    # C, single participation) reach the same optimum
    n = 24
    assert banded(n, n, max_iter=2000).loss() == pytest.approx(dense(n, 1).loss(), rel=1e-6)
