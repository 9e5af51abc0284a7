"""Sensitivity of C: exact methods against enumeration of every participation pattern."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.privacy.matrix import sensitivity as sens
from fedsim.privacy.matrix.toeplitz import sqrt_coefficients, toeplitz_matrix
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.participation import Participation


def _random_banded(n, bands, rng, nonneg=True):
    C = rng.uniform(0.1, 1.0, (n, n)) if nonneg else rng.standard_normal((n, n))
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    return np.where((lag >= 0) & (lag < bands), C, 0.0)


def test_single_participation_is_the_largest_column_norm():
    C = np.array([[1.0, 0.0], [3.0, 2.0]])
    result = sens.sensitivity(C, Participation.single())
    assert result.value == pytest.approx(np.sqrt(10.0))
    assert result.exact


@pytest.mark.parametrize(("n", "sep", "k"), [(8, 1, 3), (8, 3, None), (10, 4, 2), (5, 2, 9)])
def test_identity_min_sep_sensitivity_squared_is_the_participation_count(n, sep, k):
    result = sens.sensitivity(np.eye(n), Participation.separated(sep, k))
    fit = len(range(0, n, sep))
    assert result.value**2 == pytest.approx(min(fit, k or fit))
    assert result.exact


@pytest.mark.parametrize(("n", "bands", "sep", "k"), [(9, 3, 3, 3), (10, 2, 4, None), (8, 4, 5, 2)])
def test_banded_exact_method_equals_enumeration(n, bands, sep, k):
    C = _random_banded(n, bands, np.random.default_rng(n + bands))
    p = Participation.separated(sep, k)
    result = sens.sensitivity(C, p)
    assert result.method == "banded_diag_dp" and result.exact
    assert result.value == pytest.approx(sens.brute_force(C, p), rel=1e-12)


@pytest.mark.parametrize(("n", "sep", "k"), [(10, 2, 3), (12, 3, None), (9, 4, 2), (11, 1, 4)])
def test_toeplitz_theorem_equals_enumeration(n, sep, k):
    p = Participation.separated(sep, k)
    for coef in (sqrt_coefficients(n), 0.8 ** np.arange(n), np.r_[1.0, np.full(n - 1, 0.3)]):
        C = toeplitz_matrix(coef, n)
        result = sens.sensitivity(C, p)
        assert result.method == "toeplitz_theorem" and result.exact
        assert result.value == pytest.approx(sens.brute_force(C, p), rel=1e-12)


@pytest.mark.parametrize(("n", "sep", "k"), [(8, 2, 3), (9, 3, None), (7, 1, 2)])
def test_dispatcher_enumerates_small_non_negative_dense_c(n, sep, k):
    C = np.tril(np.random.default_rng(n).uniform(0.0, 1.0, (n, n)))
    p = Participation.separated(sep, k)
    result = sens.sensitivity(C, p)
    assert result.method == "enumeration" and result.exact
    assert result.value == pytest.approx(sens.brute_force(C, p), rel=1e-12)


@pytest.mark.parametrize("factory", [binary_tree, honaker_tree])
def test_tree_min_sep_sensitivity_is_exact_for_small_n(factory):
    f = factory(8)
    p = Participation.separated(2, 3)
    result = f.sensitivity(p)
    assert result.exact
    assert result.value == pytest.approx(sens.brute_force(f.encoder, p), rel=1e-12)


@pytest.mark.parametrize(("n", "sep", "k"), [(10, 2, 3), (12, 3, 2), (9, 1, 4)])
def test_dp_upper_bound_bounds_and_is_tight_for_banded(n, sep, k):
    rng = np.random.default_rng(7)
    p = Participation.separated(sep, k)
    C = np.tril(rng.uniform(0.0, 1.0, (n, n)))
    assert sens.min_sep_upper_bound(C, sep, k) >= sens.brute_force(C, p) - 1e-12
    B = _random_banded(n, sep, rng)
    assert sens.min_sep_upper_bound(B, sep, k) == pytest.approx(sens.brute_force(B, p))


def test_signed_c_gets_an_upper_bound_that_covers_every_signed_pattern():
    n, sep, k = 8, 2, 3
    C = np.tril(np.random.default_rng(11).standard_normal((n, n)))
    p = Participation.separated(sep, k)
    result = sens.sensitivity(C, p)
    assert not result.exact and result.method == "dp_upper_bound"
    lower = 0.0
    for pattern in p.patterns(n):
        for signs in itertools.product((-1.0, 1.0), repeat=len(pattern)):
            u = np.zeros(n)
            u[list(pattern)] = signs
            lower = max(lower, float(np.linalg.norm(C @ u)))
    assert result.value >= lower - 1e-12


def test_brute_force_refuses_signed_gram():
    C = np.array([[1.0, 0.0], [-1.0, 1.0]])
    with pytest.raises(ConfigError, match="C"):
        sens.brute_force(C, Participation.separated(1, 2))


@pytest.mark.parametrize("epochs", [1, 2, 4])
def test_fixed_epoch_equals_enumeration(epochs):
    n = 12
    C = np.tril(np.random.default_rng(epochs).uniform(0.0, 1.0, (n, n)))
    p = Participation.fixed(epochs)
    result = sens.sensitivity(C, p)
    assert result.exact
    assert result.value == pytest.approx(sens.brute_force(C, p), rel=1e-12)


def test_fixed_epoch_patterns_are_every_b_th_round():
    assert Participation.fixed(3).patterns(6) == [(0, 2, 4), (1, 3, 5)]


def test_fixed_epoch_with_signed_off_diagonal_is_an_upper_bound():
    C = np.array([[1.0, 0.0], [-1.0, 1.0]])
    result = sens.sensitivity(C, Participation.fixed(2))
    assert not result.exact
    assert result.value == pytest.approx(np.sqrt(2 + 1 + 2 * 1))


@pytest.mark.parametrize(("n", "sep", "k"), [(7, 1, 3), (10, 3, 4), (9, 2, 2)])
def test_pattern_count_matches_listing(n, sep, k):
    assert sens.count_patterns(n, sep, k) == len(Participation.separated(sep, k).patterns(n))


def test_max_separated_sum_matches_enumeration():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(11)
    for sep, k in [(1, 3), (2, 4), (3, 2)]:
        best = max([0.0] + [x[list(p)].sum() for p in Participation.separated(sep, k).patterns(11)])
        assert sens.max_separated_sum(x, sep, k) == pytest.approx(best)


def test_bad_schemas_name_the_argument():
    with pytest.raises(ConfigError, match="epochs"):
        sens.sensitivity(np.eye(10), Participation.fixed(3))
    with pytest.raises(ConfigError, match="min_sep"):
        Participation.separated(0)
    with pytest.raises(ConfigError, match="kind"):
        Participation("sometimes")
    with pytest.raises(ConfigError, match="coef"):
        sens.toeplitz_min_sep(np.array([1.0, 2.0]), 1, 2)
