"""The fast exact discrete Gaussian (fedsim.privacy.discrete_gaussian).

Distribution checks compare with the exact pmf of N_Z(0, sigma^2): chi-square on single values
(small sigma) or on cells of equal probability (large sigma), the tail mass beyond 2 and 3
sigma, and the first moments, with fixed seeds and bounds of five standard errors. The table's
exactness conditions (alias probabilities, a(x) <= 1, the float window) are checked in exact
arithmetic; the exact paths (tie-break, tail) are forced and checked against the same pmf.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import special, stats

from fedsim.config import ConfigError
from fedsim.privacy import discrete_gaussian as dg
from fedsim.privacy import mechanisms
from fedsim.privacy.discrete_gaussian import discrete_gaussian, table
from fedsim.privacy.exact import SecureRandom, exp_neg_bounds


def rng(seed):
    return np.random.default_rng(seed)


def exact_pmf(sigma, half=None):
    """Support and pmf of N_Z(0, sigma^2) on |x| <= half (mass beyond below 1e-300)."""
    half = math.ceil(40 * float(sigma)) + 10 if half is None else half
    support = np.arange(-half, half + 1)
    weights = np.exp(-(support.astype(float) ** 2) / (2 * float(sigma) ** 2))
    return support, weights / weights.sum()


def upper_tail(k, sigma):
    """P(X >= k) for integer k >= 1 and sigma >= 100, by Euler-Maclaurin: the sum of f over
    x >= k is the integral from k - 1/2 up to a relative O(sigma^-2) (1e-4 at sigma = 100) and
    Z = sqrt(2 pi) sigma up to exp(-2 pi^2 sigma^2)."""
    return 0.5 * special.erfc((k - 0.5) / (sigma * math.sqrt(2)))


def moments(support, pmf):
    var = float(np.sum(support.astype(float) ** 2 * pmf))
    return var, float(np.sum(support.astype(float) ** 4 * pmf))


def assert_moments(x, var, mu4, k=5.0):
    n = x.size
    assert abs(x.mean()) <= k * math.sqrt(var / n)
    assert abs(np.mean(x.astype(float) ** 2) - var) <= k * math.sqrt((mu4 - var**2) / n)


def assert_frequency(hits, n, p, k=5.0):
    assert abs(hits - n * p) <= k * math.sqrt(n * p * (1 - p))


def chi_square_p_value(samples, support, pmf, min_expected=5.0):
    """Pearson's chi-square on single values; the tails beyond the cells with min_expected
    counts are pooled into two cells (each with at least min_expected counts)."""
    n = samples.size
    cdf = np.cumsum(pmf)
    lo = support[np.searchsorted(cdf, min_expected / n)] + 1  # P(X < lo) >= min_expected / n
    hi = -lo
    inner = np.arange(lo, hi + 1)
    observed = np.concatenate(
        [[np.sum(samples < lo)], [np.sum(samples == v) for v in inner], [np.sum(samples > hi)]]
    )
    expected = (
        np.concatenate(
            [
                [pmf[support < lo].sum()],
                pmf[(support >= lo) & (support <= hi)],
                [pmf[support > hi].sum()],
            ]
        )
        * n
    )
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    return stats.chi2.sf(statistic, expected.size - 1)


def binned_p_value(samples, edges, probabilities):
    """Chi-square over cells (edges[j-1], edges[j]] with the given probabilities."""
    observed = np.bincount(np.searchsorted(edges, samples, side="left"), minlength=edges.size + 1)
    expected = probabilities * samples.size
    return stats.chi2.sf(float(np.sum((observed - expected) ** 2 / expected)), edges.size)


def equal_cells(sigma, cells=60):
    """Edges and probabilities of ``cells`` cells of about equal probability, from the exact
    pmf (sigma < 1e4) or the Euler-Maclaurin tails (larger sigma)."""
    if sigma < 1e4:
        support, pmf = exact_pmf(sigma)
        cdf = np.cumsum(pmf)
        cuts = np.unique(np.searchsorted(cdf, np.linspace(0, 1, cells + 1)[1:-1]))
        edges = support[cuts]
        return edges, np.diff(np.concatenate([[0.0], cdf[cuts], [1.0]]))
    edges = np.unique(np.round(stats.norm.ppf(np.linspace(0, 1, cells + 1)[1:-1]) * sigma))
    edges = edges.astype(np.int64)
    below = np.array(
        [1 - upper_tail(e + 1, sigma) if e >= 0 else upper_tail(-e, sigma) for e in edges]
    )
    return edges, np.diff(np.concatenate([[0.0], below, [1.0]]))


# ---------------------------------------------------------------- distribution


@pytest.mark.parametrize("sigma", [0.5, 1.0, Fraction(3), 3.7])
def test_small_sigma_matches_the_exact_pmf_value_by_value(sigma):
    n = 200_000
    x = discrete_gaussian(n, sigma, rng(41))
    assert x.dtype == np.int64 and x.shape == (n,)
    support, pmf = exact_pmf(sigma)
    assert chi_square_p_value(x, support, pmf) > 1e-4
    assert_moments(x, *moments(support, pmf))
    for k in (2, 3):
        tail = float(pmf[np.abs(support) > k * float(sigma)].sum())
        assert_frequency(int(np.sum(np.abs(x) > k * float(sigma))), n, tail)
    if float(sigma) <= 1:  # a rounded continuous Gaussian fails the same test
        rounded = np.rint(rng(41).normal(0.0, float(sigma), size=n)).astype(np.int64)
        assert chi_square_p_value(rounded, support, pmf) < 1e-6


@pytest.mark.parametrize("sigma", [37.5, 100, 1000.0, 1e4, 1e6, 1e8, Fraction(3 * 10**9 + 1, 3)])
def test_large_sigma_matches_the_exact_cells_tails_and_moments(sigma):
    n = 200_000
    s = float(sigma)
    x = discrete_gaussian(n, sigma, rng(43))
    edges, probabilities = equal_cells(s)
    assert binned_p_value(x, edges, probabilities) > 1e-4
    if s < 1e4:
        var, mu4 = moments(*exact_pmf(s))
    else:  # the discrete Gaussian's variance is sigma^2 up to exp(-2 pi^2 sigma^2)
        var, mu4 = s * s, 3 * s**4
    assert_moments(x, var, mu4)
    for k in (2, 3):
        cut = math.floor(k * s)  # |x| > k sigma  <=>  |x| >= cut + 1
        tail = 2 * upper_tail(cut + 1, s) if s >= 100 else None
        if tail is None:
            support, pmf = exact_pmf(s)
            tail = float(pmf[np.abs(support) > k * s].sum())
        assert_frequency(int(np.sum(np.abs(x) > k * s)), n, tail)


def test_secure_mode_is_right_and_not_reproducible():
    sigma = 4.5
    x = discrete_gaussian(20_000, sigma, SecureRandom())
    support, pmf = exact_pmf(sigma)
    assert_moments(x, *moments(support, pmf), k=6.0)
    assert chi_square_p_value(x, support, pmf) > 1e-6
    assert not np.array_equal(x, discrete_gaussian(20_000, sigma, SecureRandom()))


def test_generator_words_are_the_generator_stream():
    """The words come from the Generator's own stream (random_raw where that is the same)."""
    for bit_generator in (np.random.PCG64, np.random.SFC64, np.random.MT19937):
        words = dg.word_source(np.random.Generator(bit_generator(7)))(50)
        expected = np.random.Generator(bit_generator(7)).integers(0, 2**64, 50, dtype=np.uint64)
        assert words.dtype == np.uint64 and np.array_equal(words, expected)


def test_it_is_the_sampler_of_mechanisms():
    """The existing call sites (mechanisms.discrete_gaussian) use this sampler."""
    assert mechanisms.discrete_gaussian is discrete_gaussian


# ---------------------------------------------------------------- the exact paths, forced


@pytest.fixture
def fresh_tables():
    table.cache_clear()
    yield
    table.cache_clear()


@pytest.mark.parametrize("sigma", [Fraction(3, 2), 100])
def test_every_decision_on_the_exact_path_gives_the_same_pmf(monkeypatch, sigma):
    """With the undecided window as wide as [0, 1] every acceptance takes the rational
    tie-break; the output still matches the pmf (the exact path is the float path's reference)."""
    calls = []
    exact = dg.uniform_below

    def counted(*args):
        calls.append(1)
        return exact(*args)

    monkeypatch.setattr(dg, "_MARGIN_BITS", -80)
    monkeypatch.setattr(dg, "uniform_below", counted)
    n = 4000
    x = discrete_gaussian(n, sigma, rng(47))
    assert len(calls) >= n
    if float(sigma) < 10:
        support, pmf = exact_pmf(sigma)
        assert chi_square_p_value(x, support, pmf) > 1e-4
    else:
        assert binned_p_value(x, *equal_cells(float(sigma), cells=20)) > 1e-4
    assert_moments(x, *moments(*exact_pmf(sigma)))


@pytest.mark.parametrize("sigma", [Fraction(3), 40, 5000])
def test_the_tail_beyond_the_table_is_exact(monkeypatch, fresh_tables, sigma):
    """With the table cut at about one sigma, about 30% of the draws come from the tail
    sampler (geometric proposal, two exact acceptances): pmf, tail mass and moments hold."""
    monkeypatch.setattr(dg, "TAIL_SIGMAS", 1)
    tab = table(Fraction(sigma) ** 2)
    n = 6000
    x = discrete_gaussian(n, sigma, rng(53))
    s = float(sigma)
    support, pmf = exact_pmf(s)
    beyond = float(pmf[np.abs(support) > tab.top].sum())
    assert beyond > 0.2
    assert_frequency(int(np.sum(np.abs(x) > tab.top)), n, beyond)
    if s < 10:
        assert chi_square_p_value(x, support, pmf) > 1e-4
    else:
        assert binned_p_value(x, *equal_cells(s, cells=20)) > 1e-4
    assert_moments(x, *moments(support, pmf))


def test_the_tie_break_compares_the_extended_uniform():
    """U = (top + V) / 2^53 < exp(-1) for the 53-bit integer just below exp(-1) 2^53: true
    with probability equal to the fractional part of exp(-1) 2^53."""
    lo, _ = exp_neg_bounds(Fraction(1), 60)
    scaled = lo * (1 << 53)
    top = math.floor(scaled)
    fraction = float(scaled - top)
    bits = dg._Bits(dg.word_source(rng(59)))

    def bounds(digits):
        return exp_neg_bounds(Fraction(1), digits)

    n = 4000
    hits = sum(dg.uniform_below(bounds, bits, top, 53) for _ in range(n))
    assert_frequency(hits, n, fraction)
    assert all(dg.uniform_below(bounds, bits, top - 1, 53) for _ in range(50))
    assert not any(dg.uniform_below(bounds, bits, top + 1, 53) for _ in range(50))


def test_the_exact_geometric_has_the_geometric_pmf():
    bits = dg._Bits(dg.word_source(rng(61)))
    rate = Fraction(2, 7)
    draws = np.array([dg._geometric(rate, bits) for _ in range(4000)])
    r = math.exp(-float(rate))
    support = np.arange(0, 120)
    pmf = (1 - r) * r**support
    observed = np.bincount(np.minimum(draws, 29), minlength=30)
    expected = np.append(pmf[:29], pmf[29:].sum()) * draws.size
    assert stats.chi2.sf(float(np.sum((observed - expected) ** 2 / expected)), 29) > 1e-4


# ---------------------------------------------------------------- the table's exactness conditions


@pytest.mark.parametrize(
    "sigma", [Fraction(1, 2), Fraction(37, 10), 100, 10**6, 10**8, 2**30, 10**12]
)
def test_table_probabilities_and_acceptances_are_exactly_right(sigma):
    """The alias table gives outcome q with probability W_q / 2^k exactly; the weights sum to
    2^k; W_0 = L; and every acceptance a(x) = 2 c L f(m) / W_q <= 1 (checked at the block's
    smallest m, 50-digit lower bounds of f) -- the tail's first acceptance likewise."""
    tab = table(Fraction(sigma) ** 2)
    total = 1 << tab.alias_bits
    assert sum(tab.weights) == total
    assert tab.weights[0] == tab.scale
    height = total >> tab.column_bits
    mass = np.zeros(1 << tab.column_bits, dtype=object)
    for i in range(1 << tab.column_bits):
        mass[i] += int(tab.threshold[i])
        mass[int(tab.alias[i])] += height - int(tab.threshold[i])
    assert list(mass[: len(tab.weights)]) == list(tab.weights)
    assert not any(mass[len(tab.weights) :])
    c = tab.width
    for q in range(1, tab.blocks + 1):
        a_q = 1 + (q - 1) * c
        f_lo, _ = exp_neg_bounds(Fraction(a_q * a_q) / (2 * tab.s2), 50)
        assert 2 * c * tab.scale * f_lo <= tab.weights[q]
    tail_lo, _ = tab.tail_bounds(50)
    assert tail_lo <= 1
    assert tab.acceptance > 0.95


@pytest.mark.parametrize(
    "sigma", [Fraction(3, 5), Fraction(271, 100), 100, Fraction(4_000_001, 1000), 10**6, 2**40]
)
def test_float_acceptance_is_within_the_exact_window(sigma):
    """|p_hat - a(x)| stays far inside the 2^-40 window that is settled exactly, over random
    proposals in the table's blocks (60-digit decimal reference)."""
    tab = table(Fraction(sigma) ** 2)
    g = rng(67)
    outcome = g.integers(1, tab.blocks + 1, size=300)
    position = g.integers(0, tab.width, size=300)
    magnitude, scaled = dg._scaled_acceptance(tab, outcome, position)
    worst = 0.0
    for i in range(outcome.size):
        m, q = int(magnitude[i]), int(outcome[i])
        lo, hi = exp_neg_bounds(Fraction(m * m) / (2 * tab.s2), 60)
        assert hi - lo < Fraction(1, 2**150)
        exact = lo * tab.ratio(q)
        assert exact <= 1
        p_hat = Fraction(float(scaled[i])) / (1 << tab.uniform_bits)
        worst = max(worst, abs(float(p_hat - exact)))
    assert worst < 2.0**-46


# ---------------------------------------------------------------- determinism and arguments


def test_deterministic_given_a_seeded_generator():
    for sigma in (0.7, 4.2, 1234.5, 10**6, 2**30):
        a = discrete_gaussian((300, 7), sigma, rng(3))
        assert a.shape == (300, 7)
        assert np.array_equal(a, discrete_gaussian((300, 7), sigma, rng(3)))
        assert not np.array_equal(a, discrete_gaussian((300, 7), sigma, rng(4)))
    assert np.array_equal(discrete_gaussian(6, 0, rng(3)), np.zeros(6, dtype=np.int64))
    assert discrete_gaussian((0, 3), 2.0, rng(3)).shape == (0, 3)


@pytest.mark.parametrize(
    ("call", "key", "value"),
    [
        (lambda: discrete_gaussian(3, -0.5, rng(0)), "sigma", Fraction(-1, 2)),
        (lambda: discrete_gaussian(3, float("inf"), rng(0)), "sigma", math.inf),
        (lambda: discrete_gaussian(3, float("nan"), rng(0)), "sigma", None),
        (lambda: discrete_gaussian(3, "2", rng(0)), "sigma", "2"),
        (lambda: discrete_gaussian(3, True, rng(0)), "sigma", True),
        (lambda: discrete_gaussian(3, 2**57, rng(0)), "sigma", 2**57),
        (lambda: discrete_gaussian(3, 2.0, 42), "rng", 42),
        (lambda: discrete_gaussian(3, 2.0, np.random.RandomState(0)), "rng", None),
        (lambda: discrete_gaussian((2, 1.5), 2.0, rng(0)), "shape", (2, 1.5)),
        (lambda: discrete_gaussian(-1, 2.0, rng(0)), "shape", (-1,)),
    ],
)
def test_bad_arguments_name_the_argument(call, key, value):
    with pytest.raises(ConfigError) as err:
        call()
    assert err.value.key == key
    if value is not None:
        assert err.value.value == value
    assert str(err.value).startswith(f"{key} = ")


def test_the_benchmark_measures_both_samplers_in_one_run(tmp_path):
    """experiments/bench/sampler.py writes old and new medians and their ratio per sigma (no
    assertion on the times themselves)."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sampler.json"
    subprocess.run(
        [sys.executable, str(root / "experiments/bench/sampler.py"), "--sigmas", "1", "1e6"]
        + ["--draws", "2000", "--repeats", "2", "--secure-sigma", "10", "--secure-repeats", "2"]
        + ["--out", str(out)],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert [row["sigma"] for row in result["generator"]] == [1.0, 1e6]
    assert [row["sigma"] for row in result["secure"]] == [10.0]
    for row in result["generator"] + result["secure"]:
        assert row["draws"] == 2000 and len(row["old_wall_all_s"]) == 2
        assert row["ratio_wall"] == pytest.approx(row["old_wall_s"] / row["new_wall_s"])
    printed = subprocess.run(
        [sys.executable, str(root / "experiments/bench/sampler.py"), "--table-only"]
        + ["--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert printed.count("\n") == 2 + 3  # header, two Generator rows, one secure row
    assert "| 10⁶ |" in printed and "| 10, secure mode |" in printed
