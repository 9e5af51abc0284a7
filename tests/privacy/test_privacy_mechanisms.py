"""Noise mechanisms: statistics against the true distributions, determinism, secure mode, errors.

Statistical checks use fixed seeds and bounds of five standard errors (the standard errors from
the true distribution's moments), so they test the samplers, not luck; the secure-mode checks,
which cannot be seeded, use six.
"""

import decimal
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedsim.config import ConfigError
from fedsim.privacy import mechanisms as mech
from fedsim.privacy.mechanisms import (
    SecureRandom,
    cks_discrete_gaussian,
    discrete_gaussian,
    gaussian_noise,
    is_secure,
    sample_bernoulli_exp,
    sample_discrete_gaussian,
    sample_discrete_laplace,
    sample_poisson,
    skellam_noise,
)


def rng(seed):
    return np.random.default_rng(seed)


def discrete_gaussian_pmf(sigma):
    """Support and pmf of N_Z(0, sigma^2), normalised by summing exp(-x^2 / 2 sigma^2)."""
    half = math.ceil(40 * sigma) + 10
    support = np.arange(-half, half + 1)
    weights = np.exp(-(support.astype(float) ** 2) / (2 * sigma**2))
    return support, weights / weights.sum()


def moments(support, pmf):
    """Mean, variance and fourth central moment of a pmf."""
    mean = float(np.sum(support * pmf))
    var = float(np.sum((support - mean) ** 2 * pmf))
    mu4 = float(np.sum((support - mean) ** 4 * pmf))
    return mean, var, mu4


def assert_mean_and_variance(x, mean, var, mu4, k=5.0):
    """Sample mean and variance within ``k`` standard errors of the true ones."""
    n = x.size
    assert abs(x.mean() - mean) <= k * math.sqrt(var / n)
    assert abs(x.var(ddof=1) - var) <= k * math.sqrt((mu4 - var**2) / n)


def assert_frequency(hits, n, p, k=5.0):
    """A count of Binomial(n, p) events within ``k`` standard deviations of n p."""
    assert abs(hits - n * p) <= k * math.sqrt(n * p * (1 - p))


def chi_square_p_value(samples, support, pmf, min_expected=5.0):
    """Pearson's chi-square p-value of ``samples`` against ``pmf`` on ``support``; cells with
    fewer than ``min_expected`` expected counts are pooled into the two tails."""
    n = samples.size
    keep = pmf * n >= min_expected
    lo, hi = support[keep].min(), support[keep].max()
    inner = np.arange(lo, hi + 1)
    observed = [np.sum(samples < lo)] + [np.sum(samples == v) for v in inner]
    observed.append(np.sum(samples > hi))
    expected = [pmf[support < lo].sum()] + [pmf[support == v].sum() for v in inner]
    expected.append(pmf[support > hi].sum())
    observed, expected = np.array(observed, float), np.array(expected) * n
    cells = expected > 0
    statistic = float(np.sum((observed[cells] - expected[cells]) ** 2 / expected[cells]))
    return stats.chi2.sf(statistic, cells.sum() - 1)


# ---------------------------------------------------------------- Gaussian


def test_gaussian_noise_mean_variance_and_shape():
    x = gaussian_noise((200, 100), 2.5, rng(1))
    assert x.shape == (200, 100) and x.dtype == np.float64
    assert_mean_and_variance(x.ravel(), 0.0, 2.5**2, 3 * 2.5**4)
    assert_frequency(int(np.sum(np.abs(x) > 3 * 2.5)), x.size, 2 * stats.norm.sf(3))


def test_gaussian_noise_is_deterministic_per_seed_and_zero_without_noise():
    a = gaussian_noise(1000, 1.0, rng(7))
    assert np.array_equal(a, gaussian_noise(1000, 1.0, rng(7)))
    assert not np.array_equal(a, gaussian_noise(1000, 1.0, rng(8)))
    assert np.array_equal(gaussian_noise(5, 0.0, rng(7)), np.zeros(5))


def test_gaussian_noise_has_no_secure_mode():
    with pytest.raises(ConfigError) as err:
        gaussian_noise(3, 1.0, SecureRandom())
    assert err.value.key == "rng"
    assert "discrete_gaussian" in err.value.allowed


# ---------------------------------------------------------------- discrete Gaussian


@pytest.mark.parametrize("sigma", [2.5, Fraction(7, 3)])
def test_discrete_gaussian_mean_variance_and_tails(sigma):
    n = 20_000
    x = discrete_gaussian(n, sigma, rng(11))
    assert x.dtype == np.int64 and x.shape == (n,)
    support, pmf = discrete_gaussian_pmf(float(sigma))
    mean, var, mu4 = moments(support, pmf)
    assert_mean_and_variance(x, mean, var, mu4)
    tail = float(pmf[np.abs(support) > 3 * float(sigma)].sum())
    assert_frequency(int(np.sum(np.abs(x) > 3 * float(sigma))), n, tail)
    assert chi_square_p_value(x, support, pmf) > 1e-4


def test_discrete_gaussian_pmf_on_a_small_support():
    """sigma = 0.8: the discrete Gaussian differs visibly from a rounded continuous one, and
    its variance lies below sigma^2 (Canonne, Kamath & Steinke 2020, Cor. 9)."""
    sigma = 0.8
    x = discrete_gaussian(30_000, sigma, rng(12))
    support, pmf = discrete_gaussian_pmf(sigma)
    assert set(np.unique(x)) <= set(range(-5, 6))
    assert chi_square_p_value(x, support, pmf) > 1e-4
    mean, var, mu4 = moments(support, pmf)
    assert var < sigma**2
    assert_mean_and_variance(x, mean, var, mu4)
    # A rounded N(0, sigma^2) has a different pmf; the test can tell them apart.
    rounded = np.rint(rng(12).normal(0.0, sigma, size=30_000)).astype(np.int64)
    assert chi_square_p_value(rounded, support, pmf) < 1e-6


def test_discrete_gaussian_is_deterministic_per_seed():
    a = discrete_gaussian((40, 5), 4.2, rng(3))
    assert a.shape == (40, 5)
    assert np.array_equal(a, discrete_gaussian((40, 5), 4.2, rng(3)))
    assert not np.array_equal(a, discrete_gaussian((40, 5), 4.2, rng(4)))
    assert np.array_equal(discrete_gaussian(6, 0, rng(3)), np.zeros(6, dtype=np.int64))
    assert discrete_gaussian((0, 3), 2.0, rng(3)).shape == (0, 3)
    assert sample_discrete_gaussian(0, rng(3)) == 0


def binned_chi_square_p_value(samples, support, pmf, bins=60):
    """Chi-square p-value over ``bins`` cells of about equal probability under ``pmf`` (cells
    are runs of consecutive support points), for pmfs with too many points to test one by one."""
    cdf = np.cumsum(pmf)
    cuts = np.unique(np.searchsorted(cdf, np.linspace(0, 1, bins + 1)[1:-1]))
    edges = support[cuts]  # cell j holds support values in (edges[j-1], edges[j]]
    expected = np.diff(np.concatenate([[0.0], cdf[cuts], [1.0]])) * samples.size
    observed = np.bincount(np.searchsorted(edges, samples, side="left"), minlength=edges.size + 1)
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    return stats.chi2.sf(statistic, edges.size)


@pytest.mark.parametrize("sigma", [0.45, 1.0, 37.5, Fraction(12_000, 1)])
def test_batched_discrete_gaussian_matches_the_exact_pmf(sigma):
    """The reference sampler's vectorised Generator path, for sigma < 1 (mass on a few points)
    up to sigma = 12000: mean, variance, and chi-square against the exact pmf (cells pooled to
    equal probability)."""
    n = 200_000
    x = cks_discrete_gaussian(n, sigma, rng(31))
    assert x.dtype == np.int64 and x.shape == (n,)
    support, pmf = discrete_gaussian_pmf(float(sigma))
    mean, var, mu4 = moments(support, pmf)
    assert_mean_and_variance(x, mean, var, mu4)
    if float(sigma) < 2:
        assert chi_square_p_value(x, support, pmf) > 1e-4
    assert binned_chi_square_p_value(x, support, pmf) > 1e-4
    # a continuous Gaussian rounded to integers is rejected by the same test at sigma < 1
    if float(sigma) < 1:
        rounded = np.rint(rng(31).normal(0.0, float(sigma), size=n)).astype(np.int64)
        assert chi_square_p_value(rounded, support, pmf) < 1e-6


def test_batched_discrete_gaussian_is_deterministic_per_seed():
    """The reference (CKS) sampler; the fast one has its tests in test_discrete_gaussian.py."""
    a = cks_discrete_gaussian((300, 70), 1234.5, rng(13))
    assert np.array_equal(a, cks_discrete_gaussian((300, 70), 1234.5, rng(13)))
    assert not np.array_equal(a, cks_discrete_gaussian((300, 70), 1234.5, rng(14)))
    # the batches' sizes depend only on how many draws are still missing
    assert np.array_equal(
        cks_discrete_gaussian(5000, 0.7, rng(2)), cks_discrete_gaussian(5000, 0.7, rng(2))
    )


def test_float_acceptance_probability_is_within_the_exact_window():
    """|fl(exp(-gamma_hat)) - exp(-gamma)| stays far inside the 2^-40 window that the batched
    sampler settles exactly, over proposals of several sigmas (60-digit decimal reference)."""
    g = rng(17)
    worst = 0.0
    for sigma in (Fraction(3, 5), Fraction(271, 100), Fraction(4_000_001, 1000), Fraction(10**6)):
        _, _, t = mech._gaussian_params(sigma * sigma)
        shift_exact = sigma * sigma / t
        u = g.integers(0, t, size=150)
        magnitude = u + t * g.integers(0, 6, size=150)
        gamma = mech._float_exponent(
            u, magnitude, t, float(shift_exact), float(1 / (2 * sigma * sigma))
        )
        approx = np.exp(-gamma)
        for i in range(u.size):
            exact = Fraction(int(u[i]), t) + (int(magnitude[i]) - shift_exact) ** 2 / (
                2 * sigma * sigma
            )
            lo, hi = mech._exp_neg_bounds(exact, 60)
            assert hi - lo < Fraction(1, 2**150)
            worst = max(worst, abs(float(Fraction(approx[i]) - lo)))
    assert worst < 2.0**-46


def test_exact_tie_break_compares_the_extended_uniform():
    """(top + W) / 2^53 < exp(-1) for the 53-bit integer just below exp(-1) * 2^53: accepted
    with probability equal to the fractional part of exp(-1) * 2^53."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        scaled = decimal.Decimal(-1).exp() * (1 << 53)
    top = int(scaled)
    fraction = float(scaled - top)
    g = rng(19)
    n = 4000
    hits = sum(mech._exact_uniform_below_exp(top, Fraction(1), g) for _ in range(n))
    assert_frequency(hits, n, fraction)
    assert all(mech._exact_uniform_below_exp(top - 1, Fraction(1), g) for _ in range(50))
    assert not any(mech._exact_uniform_below_exp(top + 1, Fraction(1), g) for _ in range(50))


@pytest.mark.parametrize("margin_bits", [2, 0])
def test_batched_sampler_with_a_wide_exact_window(monkeypatch, margin_bits):
    """Widening the window so that many (2^-2) or all (2^0) decisions take the exact rational
    path leaves the distribution unchanged: the exact path is the reference for the float one."""
    calls = []
    exact = mech._exact_uniform_below_exp

    def counted(top, gamma, generator):
        calls.append(1)
        return exact(top, gamma, generator)

    monkeypatch.setattr(mech, "_MARGIN_BITS", margin_bits)
    monkeypatch.setattr(mech, "_exact_uniform_below_exp", counted)
    sigma = Fraction(3, 2)
    x = cks_discrete_gaussian(3000, sigma, rng(23))
    assert len(calls) > (7000 if margin_bits == 0 else 500)
    support, pmf = discrete_gaussian_pmf(float(sigma))
    assert chi_square_p_value(x, support, pmf) > 1e-4
    mean, var, mu4 = moments(support, pmf)
    assert_mean_and_variance(x, mean, var, mu4)


def test_single_draws_follow_the_same_distributions():
    g = rng(5)
    draws = np.array([sample_discrete_gaussian(Fraction(9, 4), g) for _ in range(3000)])
    support, pmf = discrete_gaussian_pmf(1.5)
    assert chi_square_p_value(draws, support, pmf) > 1e-4

    for gamma in (Fraction(1, 3), 2.5):
        n = 4000
        hits = sum(sample_bernoulli_exp(gamma, g) for _ in range(n))
        assert_frequency(hits, n, math.exp(-float(gamma)))

    t = 3
    laplace = np.array([sample_discrete_laplace(t, g) for _ in range(6000)])
    support = np.arange(-200, 201)
    weights = np.exp(-np.abs(support) / t)
    pmf = weights / weights.sum()
    assert chi_square_p_value(laplace, support, pmf) > 1e-4


def test_exact_poisson_matches_the_poisson_pmf():
    g = rng(9)
    for lam in (Fraction(7, 2), 12):
        draws = np.array([sample_poisson(lam, g) for _ in range(4000)])
        support = np.arange(0, 80)
        pmf = stats.poisson.pmf(support, float(lam))
        assert chi_square_p_value(draws, support, pmf / pmf.sum()) > 1e-4
        assert_mean_and_variance(draws, float(lam), float(lam), float(lam) + 3 * float(lam) ** 2)
    assert sample_poisson(0, g) == 0


# ---------------------------------------------------------------- Skellam


@pytest.mark.parametrize("mu", [0.6, 7.5, 50])
def test_skellam_mean_zero_variance_two_mu(mu):
    x = skellam_noise((100, 200), mu, rng(21))
    assert x.dtype == np.int64 and x.shape == (100, 200)
    var = 2 * mu
    assert_mean_and_variance(x.ravel(), 0.0, var, var + 3 * var**2)
    # The pmf of Poisson(mu) - Poisson(mu), on the small-mu case where cells are few.
    if mu < 1:
        support = np.arange(-30, 31)
        pmf = stats.skellam.pmf(support, mu, mu)
        assert chi_square_p_value(x.ravel(), support, pmf / pmf.sum()) > 1e-4


def test_skellam_is_deterministic_per_seed_and_zero_without_noise():
    a = skellam_noise(500, 3.0, rng(2))
    assert np.array_equal(a, skellam_noise(500, 3.0, rng(2)))
    assert not np.array_equal(a, skellam_noise(500, 3.0, rng(1)))
    assert np.array_equal(skellam_noise(4, 0, rng(2)), np.zeros(4, dtype=np.int64))


# ---------------------------------------------------------------- secure mode


def test_secure_mode_discrete_gaussian_is_right_and_not_reproducible():
    secure = SecureRandom()
    assert is_secure(secure) and not is_secure(rng(0))
    sigma = 3.0
    x = discrete_gaussian(6000, sigma, secure)
    support, pmf = discrete_gaussian_pmf(sigma)
    mean, var, mu4 = moments(support, pmf)
    assert_mean_and_variance(x, mean, var, mu4, k=6.0)
    # 6000 draws with about 7.5 bits of entropy each: two equal arrays would be a broken source.
    assert not np.array_equal(x, discrete_gaussian(6000, sigma, SecureRandom()))
    # the reference sampler's secure mode: one draw at a time, integer-only decisions
    y = cks_discrete_gaussian(3000, sigma, secure)
    assert_mean_and_variance(y, mean, var, mu4, k=6.0)


def test_secure_mode_skellam_uses_the_exact_sampler():
    mu = Fraction(5, 2)
    x = skellam_noise(3000, mu, SecureRandom())
    var = 2 * float(mu)
    assert_mean_and_variance(x, 0.0, var, var + 3 * var**2, k=6.0)
    assert not np.array_equal(x, skellam_noise(3000, mu, SecureRandom()))


def test_secure_random_draws_uniform_integers():
    secure = SecureRandom()
    values = secure.integers(0, 10, size=5000)
    assert values.shape == (5000,) and values.min() >= 0 and values.max() <= 9
    counts = np.bincount(values, minlength=10)
    assert stats.chisquare(counts).pvalue > 1e-6
    assert 3 <= secure.integers(3, 4) < 4
    words = secure.words(4)
    assert len(words) == 4 and all(0 <= w < 2**64 for w in words)
    assert secure.words(4) != words
    with pytest.raises(ConfigError) as err:
        secure.integers(5, 5)
    assert err.value.key == "high"


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("call", "key", "value"),
    [
        (lambda: gaussian_noise(3, -1.0, rng(0)), "std", -1.0),
        (lambda: gaussian_noise(3, float("nan"), rng(0)), "std", None),
        (lambda: gaussian_noise(3, True, rng(0)), "std", True),
        (lambda: gaussian_noise(3, 1.0, None), "rng", None),
        (lambda: gaussian_noise(-2, 1.0, rng(0)), "shape", (-2,)),
        (lambda: discrete_gaussian(3, -0.5, rng(0)), "sigma", Fraction(-1, 2)),
        (lambda: discrete_gaussian(3, float("inf"), rng(0)), "sigma", math.inf),
        (lambda: discrete_gaussian(3, "2", rng(0)), "sigma", "2"),
        (lambda: discrete_gaussian(3, 2.0, 42), "rng", 42),
        (lambda: discrete_gaussian(3, 2.0, np.random.RandomState(0)), "rng", None),
        (lambda: discrete_gaussian((2, 1.5), 2.0, rng(0)), "shape", (2, 1.5)),
        (lambda: sample_discrete_gaussian(-4, rng(0)), "sigma_squared", -4),
        (lambda: skellam_noise(3, -1, rng(0)), "mu", -1),
        (lambda: skellam_noise(3, 1.0, "os"), "rng", "os"),
        (lambda: sample_poisson(-0.5, rng(0)), "lam", Fraction(-1, 2)),
        (lambda: sample_discrete_laplace(0, rng(0)), "scale", 0),
        (lambda: sample_bernoulli_exp(-1, rng(0)), "gamma", -1),
    ],
)
def test_bad_arguments_name_the_argument(call, key, value):
    with pytest.raises(ConfigError) as err:
        call()
    assert err.value.key == key
    if value is not None:
        assert err.value.value == value
    assert str(err.value).startswith(f"{key} = ")
