"""Noise for private aggregation: Gaussian, exact discrete Gaussian and Skellam.

Randomness is passed in, as one of

- a ``numpy.random.Generator`` -- simulation randomness, reproducible from its seed;
- a :class:`SecureRandom` -- **secure mode**: OS randomness (``secrets`` / ``os.urandom``),
  not reproducible, never seeded, for noise that must hold against a real adversary.

The integer samplers are exact: the output distribution is exactly the stated one, with no
floating-point rounding (compare Mironov 2012, "On Significance of the Least Significant Bits
for Differential Privacy"). Parameters given as ``float`` are read as the shortest decimal that
round-trips (``repr``): ``sigma=3.7`` means ``37/10`` exactly; pass a ``fractions.Fraction``
for any other rational.

:func:`discrete_gaussian` is :func:`fedsim.privacy.discrete_gaussian.discrete_gaussian`: a
table-driven proposal with a float64 fast path and an exact rational tie-break (exactness
argument in that module), for Generators and secure mode alike. The samplers of Canonne, Kamath
& Steinke 2020 ("The Discrete Gaussian for Differential Privacy", Alg. 1-3) stay here:
:func:`cks_discrete_gaussian` (the reference the benchmark experiments/bench/sampler.py
compares with; vectorised over arrays for a Generator, see :func:`_batched_discrete_gaussian`,
one by one with integer-only decisions in secure mode), :func:`sample_discrete_gaussian`,
:func:`sample_discrete_laplace` and :func:`sample_bernoulli_exp`. Exact Skellam in secure mode
runs at about 0.12 M samples/s at mu = 50; Gaussian and Generator-mode Skellam at numpy speed.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.privacy.discrete_gaussian import discrete_gaussian
from fedsim.privacy.exact import WORD as _WORD
from fedsim.privacy.exact import SecureRandom
from fedsim.privacy.exact import as_fraction as _as_fraction
from fedsim.privacy.exact import check_rng as _check_rng
from fedsim.privacy.exact import exp_neg_bounds as _exp_neg_bounds
from fedsim.privacy.exact import shape_count as _count

__all__ = [
    "SecureRandom",
    "cks_discrete_gaussian",
    "discrete_gaussian",
    "gaussian_noise",
    "is_secure",
    "sample_bernoulli_exp",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
    "sample_poisson",
    "skellam_noise",
]


def is_secure(rng: Any) -> bool:
    """Whether ``rng`` is secure-mode randomness."""
    return isinstance(rng, SecureRandom)


def _make_below(fill: Any, block: int) -> Any:
    """``below(n)``: an exactly uniform integer in ``[0, n)`` from uniform 64-bit words.

    Rejection sampling: a word ``w`` is used if ``w < 2^64 - (2^64 mod n)`` and gives
    ``w mod n`` (several words for ``n > 2^64``). ``fill(block)`` supplies words a block at a
    time: ``rng.integers(0, 2**64, size=block, dtype=uint64)`` for a Generator (which advances
    a whole block at a time), ``os.urandom`` in secure mode. A closure, because the samplers
    call it millions of times.
    """
    words: list[int] = []
    limits: dict[int, int] = {}

    def word() -> int:
        if not words:
            words.extend(reversed(fill(block)))
        return words.pop()

    def below(n: int) -> int:
        if n <= _WORD:
            limit = limits.get(n)
            if limit is None:
                limit = _WORD - _WORD % n
                if len(limits) < 4096:
                    limits[n] = limit
            while True:
                w = words.pop() if words else word()
                if w < limit:
                    return w % n
        bits = (n - 1).bit_length()
        count = -(-bits // 64)
        while True:
            x = 0
            for _ in range(count):
                x = (x << 64) | word()
            x >>= 64 * count - bits
            if x < n:
                return x

    return below


def _below(rng: Any, count: int) -> Any:
    """A callable ``below(n)`` -> uniform int in ``[0, n)`` from ``rng``."""
    block = min(4096, max(64, 16 * count))
    if isinstance(rng, SecureRandom):
        return _make_below(rng.words, block)
    if isinstance(rng, np.random.Generator):
        return _make_below(
            lambda size: rng.integers(0, _WORD, size=size, dtype=np.uint64).tolist(), block
        )
    raise ConfigError("rng", rng, "a numpy.random.Generator, or SecureRandom() for secure mode")


# --------------------------------------------------------------------------------------------
# Gaussian
# --------------------------------------------------------------------------------------------


def gaussian_noise(shape: Any, std: float, rng: np.random.Generator) -> np.ndarray:
    """Float64 samples of ``N(0, std^2)`` of the given shape (``std >= 0``).

    Simulation only: floating-point Gaussian noise is not safe as a real-world mechanism
    (Mironov 2012), so a :class:`SecureRandom` is refused -- use :func:`discrete_gaussian` on
    an integer grid in secure mode.
    """
    shape, _ = _count(shape)
    require(
        isinstance(std, (int, float, np.floating))
        and not isinstance(std, bool)
        and math.isfinite(std)
        and std >= 0,
        "std",
        std,
        "a finite number >= 0",
    )
    if isinstance(rng, SecureRandom):
        raise ConfigError(
            "rng",
            rng,
            "a numpy.random.Generator (floating-point Gaussian noise "
            "has no secure mode; use discrete_gaussian)",
        )
    require(isinstance(rng, np.random.Generator), "rng", rng, "a numpy.random.Generator")
    return rng.normal(0.0, float(std), size=shape)


# --------------------------------------------------------------------------------------------
# Exact samplers (Canonne, Kamath & Steinke 2020)
# --------------------------------------------------------------------------------------------


def _bernoulli_exp_le1(num: int, den: int, below: Any) -> bool:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den: CKS 2020 Alg. 1, case gamma in [0, 1].

    K counts successes of Bernoulli(gamma/K) (``below(den*K) < num``); P(K odd) = exp(-gamma).
    """
    k = 1
    while below(den * k) < num:
        k += 1
    return k & 1 == 1


def _bernoulli_exp(num: int, den: int, below: Any) -> bool:
    """Bernoulli(exp(-num/den)) for num >= 0: CKS 2020 Alg. 1 (gamma > 1 as a product of
    Bernoulli(exp(-1)) draws and one Bernoulli(exp(-(gamma - floor))))."""
    while num > den:
        if not _bernoulli_exp_le1(1, 1, below):
            return False
        num -= den
    return _bernoulli_exp_le1(num, den, below)


def _discrete_laplace(t: int, below: Any) -> int:
    """P(x) proportional to exp(-|x|/t) on the integers, t >= 1: CKS 2020 Alg. 2 with s = 1.

    U uniform in [0, t) kept with probability exp(-U/t); V geometric with P(V >= v) = exp(-v),
    counting Bernoulli(exp(-1)) successes (Alg. 1 with gamma = 1, inlined: K starts at 2
    because Bernoulli(gamma/1) = Bernoulli(1) always succeeds; success iff K ends odd);
    x = U + t V; a fair sign, -0 rejected.
    """
    while True:
        u = below(t)
        if u and not _bernoulli_exp_le1(u, t, below):
            continue
        v = 0
        while True:  # one Bernoulli(exp(-1)) per pass
            k = 2
            while below(k) == 0:
                k += 1
            if not k & 1:
                break
            v += 1
        x = u + t * v
        negative = below(2)
        if negative and x == 0:
            continue
        return -x if negative else x


def _discrete_gaussian(n: int, d: int, t: int, below: Any) -> int:
    """N_Z(0, n/d): CKS 2020 Alg. 3, discrete Laplace proposal with t = floor(sigma) + 1 and
    acceptance exp(-(|y| - sigma^2/t)^2 / (2 sigma^2)) = exp(-(|y| d t - n)^2 / (2 n d t^2))."""
    den = 2 * n * d * t * t
    while True:
        y = _discrete_laplace(t, below)
        a = abs(y) * d * t - n
        if _bernoulli_exp(a * a, den, below):
            return y


def sample_bernoulli_exp(gamma: Any, rng: Any) -> bool:
    """One exact draw of Bernoulli(exp(-gamma)), rational ``gamma >= 0`` (CKS 2020 Alg. 1)."""
    g = _as_fraction(gamma, "gamma")
    _check_rng(rng)
    return _bernoulli_exp(g.numerator, g.denominator, _below(rng, 1))


def sample_discrete_laplace(scale: int, rng: Any) -> int:
    """One exact draw with P(x) proportional to exp(-|x|/scale), integer ``scale >= 1``
    (CKS 2020 Alg. 2)."""
    require(
        isinstance(scale, (int, np.integer)) and not isinstance(scale, bool) and scale >= 1,
        "scale",
        scale,
        "an integer >= 1",
    )
    _check_rng(rng)
    return _discrete_laplace(int(scale), _below(rng, 1))


def _gaussian_params(sigma_squared: Fraction) -> tuple[int, int, int]:
    n, d = sigma_squared.numerator, sigma_squared.denominator
    t = math.isqrt(n // d) + 1  # floor(sigma) + 1, exactly: floor(sqrt(x)) = isqrt(floor(x))
    return n, d, t


def sample_discrete_gaussian(sigma_squared: Any, rng: Any) -> int:
    """One exact draw of the discrete Gaussian N_Z(0, sigma^2): P(x) proportional to
    exp(-x^2 / (2 sigma^2)) on the integers (CKS 2020 Alg. 3); rational ``sigma_squared``
    (``0`` gives 0)."""
    s2 = _as_fraction(sigma_squared, "sigma_squared")
    _check_rng(rng)
    if s2 == 0:
        return 0
    return _discrete_gaussian(*_gaussian_params(s2), _below(rng, 1))


def cks_discrete_gaussian(shape: Any, sigma: Any, rng: Any) -> np.ndarray:
    """An int64 array of independent exact N_Z(0, sigma^2) draws (CKS 2020 Alg. 3): the
    reference sampler (:func:`discrete_gaussian` is the fast one, same distribution).

    ``sigma >= 0`` (int, float read as its decimal repr, or Fraction; the variance parameter is
    ``sigma^2`` exactly). Note that the discrete Gaussian's variance is slightly below
    ``sigma^2`` (CKS 2020, Cor. 9); for ``sigma >= 1`` the gap is negligible.

    With a ``numpy.random.Generator`` the draws are vectorised (:func:`_batched_discrete_gaussian`,
    same distribution, tens of times faster; about 2.7 M samples/s on a 2-core x86 VM); in
    secure mode (:class:`SecureRandom`) they are drawn one by one in Python with integer-only
    decisions (about 0.1-0.3 M/s).
    """
    shape, count = _count(shape)
    s = _as_fraction(sigma, "sigma")
    _check_rng(rng)
    out = np.zeros(count, dtype=np.int64)
    if s == 0 or count == 0:
        return out.reshape(shape)
    n, d, t = _gaussian_params(s * s)
    if isinstance(rng, np.random.Generator) and t <= _MAX_BATCHED_T:
        return _batched_discrete_gaussian(count, s * s, rng).reshape(shape)
    below = _below(rng, count)
    for i in range(count):
        out[i] = _discrete_gaussian(n, d, t, below)
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# Vectorised exact discrete Gaussian for numpy Generators
# --------------------------------------------------------------------------------------------

#: Half-width of the undecided window around a float64 acceptance probability, as a power of
#: two: decisions within 2^-_MARGIN_BITS of the float64 estimate are settled exactly.
_MARGIN_BITS = 40
_UNIFORM_BITS = 53
#: Largest CKS scale t = floor(sigma) + 1 for the batched path (x = U + t V stays in int64
#: and exact in float64); larger sigma falls back to the one-by-one sampler.
_MAX_BATCHED_T = 1 << 40


def _exact_uniform_below_exp(top: int, gamma: Fraction, rng: np.random.Generator) -> bool:
    """Whether ``U < exp(-gamma)`` for ``U = (top + W) / 2^53``, ``W`` a fresh uniform in
    [0, 1) whose binary digits are drawn 64 at a time only as far as the comparison needs
    (the exact tie-break of :func:`_bernoulli_exp_batch`)."""
    numerator, bits, digits = int(top), _UNIFORM_BITS, 40
    while True:
        lo, hi = _exp_neg_bounds(gamma, digits)
        if Fraction(numerator + 1, 1 << bits) <= lo:
            return True
        if Fraction(numerator, 1 << bits) >= hi:
            return False
        word = int(rng.integers(0, _WORD, dtype=np.uint64))
        numerator, bits, digits = (numerator << 64) | word, bits + 64, digits + 20


def _bernoulli_exp_batch(
    gamma: np.ndarray | float, exact_gamma: Any, rng: np.random.Generator, size: int | None = None
) -> np.ndarray:
    """Independent Bernoulli(exp(-gamma_i)) decisions, exact given a float64 error bound.

    Decision i is ``U_i < exp(-gamma_i)`` for ``U_i = (u_i + W_i) / 2^53`` uniform on [0, 1),
    ``u_i`` a uniform 53-bit integer. With ``p_hat = fl(exp(-fl(gamma_i)))`` and the bound
    ``|p_hat - exp(-gamma_i)| <= 2^-40`` (see :func:`_batched_discrete_gaussian`), every ``u_i``
    below ``floor(p_hat 2^53) - 2^13`` accepts and every ``u_i`` from ``ceil(p_hat 2^53) + 2^13``
    on rejects, whatever ``W_i`` is; the rest (probability about 2^-39 each) are settled by
    :func:`_exact_uniform_below_exp` on the rational ``exact_gamma(i)``. A scalar ``gamma``
    with ``size`` decides ``size`` Bernoulli(exp(-gamma)) with one window (the same draws and
    decisions as an array of ``size`` equal gammas, without the per-element exp).
    """
    count = gamma.size if size is None else size
    top = rng.integers(0, 1 << _UNIFORM_BITS, size=count)
    scaled = np.exp(-gamma) * float(1 << _UNIFORM_BITS)
    margin = float(1 << (_UNIFORM_BITS - _MARGIN_BITS))
    lower, upper = np.floor(scaled) - margin, np.ceil(scaled) + margin
    top_f = top.astype(np.float64)  # exact: top < 2^53
    accept = top_f < lower
    for i in np.flatnonzero((top_f >= lower) & (top_f < upper)):
        accept[i] = _exact_uniform_below_exp(int(top[i]), exact_gamma(int(i)), rng)
    return accept


def _float_exponent(
    u: np.ndarray, magnitude: np.ndarray, t: int, shift: float, inv_two_s2: float
) -> np.ndarray:
    """float64 ``U/t + (|y| - sigma^2/t)^2 / (2 sigma^2)``, the merged CKS acceptance exponent
    (``shift = fl(sigma^2/t)``, ``inv_two_s2 = fl(1/(2 sigma^2))``)."""
    return u / t + (magnitude - shift) ** 2 * inv_two_s2


def _batched_discrete_gaussian(count: int, s2: Fraction, rng: np.random.Generator) -> np.ndarray:
    """``count`` exact N_Z(0, s2) draws, CKS 2020 Alg. 3 vectorised over numpy arrays.

    Proposals (exact, integer): ``U`` uniform in [0, t), ``V`` geometric with
    ``P(V >= v) = exp(-v)`` (counted Bernoulli(exp(-1)) successes), a fair sign, ``-0``
    rejected; ``y = +-(U + t V)``, ``t = floor(sigma) + 1``. CKS's two acceptance steps
    (Alg. 2's ``exp(-U/t)`` and Alg. 3's ``exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))``) are
    independent, so they are merged into one Bernoulli(exp(-gamma)) with
    ``gamma = U/t + (|y| - sigma^2/t)^2 / (2 sigma^2)``. Batched rejection: a batch of
    proposals is drawn, the accepted ones are kept in order, and the shortfall is redrawn.

    Exactness. Each Bernoulli is decided by :func:`_bernoulli_exp_batch`: a float64 comparison
    outside a window of half-width 2^-40 around ``p_hat = fl(exp(-gamma_hat))``, exact rational
    arithmetic inside it. The output is exactly N_Z(0, sigma^2) provided
    ``|p_hat - exp(-gamma)| <= 2^-40``. Error of the float64 path: sigma^2/t and 1/(2 sigma^2)
    are rounded once from exact rationals, so ``|gamma_hat - gamma| <= 2^-53 (5 gamma +
    sqrt(2 gamma) + 2)``, hence ``exp(-gamma) |gamma_hat - gamma| <= 5 * 2^-53``; with numpy's
    float64 ``exp`` within a few ulps the total is below 2^-49, 500 times inside the window
    (tests/privacy/test_privacy_mechanisms.py checks the bound against 60-digit decimals). Were the
    bound ever exceeded, a decision would still be wrong with probability at most
    ``|p_hat - exp(-gamma)|``.
    """
    t = _gaussian_params(s2)[2]
    shift_exact = s2 / t
    shift, inv_two_s2 = float(shift_exact), float(1 / (2 * s2))
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        size = 2 * (count - filled) + 64
        u = rng.integers(0, t, size=size)
        v = np.zeros(size, dtype=np.int64)
        active = np.arange(size)
        while active.size:  # V: Bernoulli(exp(-1)) successes until the first failure
            success = _bernoulli_exp_batch(1.0, lambda i: Fraction(1), rng, size=active.size)
            active = active[success]
            v[active] += 1
        negative = rng.integers(0, 2, size=size).astype(bool)
        magnitude = u + t * v
        gamma = _float_exponent(u, magnitude, t, shift, inv_two_s2)

        def exact_gamma(i: int, u: np.ndarray = u, magnitude: np.ndarray = magnitude) -> Fraction:
            return Fraction(int(u[i]), t) + (int(magnitude[i]) - shift_exact) ** 2 / (2 * s2)

        keep = _bernoulli_exp_batch(gamma, exact_gamma, rng) & ~(negative & (magnitude == 0))
        accepted = np.where(negative, -magnitude, magnitude)[keep][: count - filled]
        out[filled : filled + accepted.size] = accepted
        filled += accepted.size
    return out


# --------------------------------------------------------------------------------------------
# Poisson and Skellam
# --------------------------------------------------------------------------------------------


class _ExactPoisson:
    """Exact Poisson(lam), rational ``lam > 0``, by rejection from a two-sided geometric.

    Proposal: ``k = c + D`` with ``c = floor(lam)`` (the mode) and ``P(D = d)`` proportional to
    ``rho^|d|``, ``rho = (m-1)/m``, ``m = isqrt(c) + 2`` (sampled exactly: the magnitude counts
    ``below(m) != 0`` draws, a uniform sign, ``-0`` rejected). Target ``lam^k / k!`` for
    ``k >= 0``. The ratio ``h(k) = (lam^k/k!) / (lam^c/c!) / rho^|k-c|`` is a rational number;
    it is unimodal on each side of ``c`` (consecutive ratios ``lam/((k+1) rho)`` and
    ``k/(lam rho)`` are monotone), so its maximum ``H`` is found by walking out from ``c``, and
    ``k`` is accepted with probability ``h(k)/H`` via an integer comparison. The accepted ``k``
    has probability proportional to ``rho^|k-c| h(k)``, i.e. to ``lam^k/k!``. Cost: about
    ``sqrt(lam)`` uniform draws per sample; acceptance probabilities are cached per ``k``.
    """

    def __init__(self, lam: Fraction) -> None:
        self.lam = lam
        self.c = lam.numerator // lam.denominator
        self.m = math.isqrt(self.c) + 2
        self.rho = Fraction(self.m - 1, self.m)
        best, h, k = Fraction(1), Fraction(1), self.c
        while (ratio := lam / ((k + 1) * self.rho)) > 1:
            h, k = h * ratio, k + 1
            best = max(best, h)
        h, k = Fraction(1), self.c
        while k >= 1 and (ratio := k / (lam * self.rho)) > 1:
            h, k = h * ratio, k - 1
            best = max(best, h)
        self.top = best
        self._accept: dict[int, tuple[int, int]] = {}

    def _acceptance(self, k: int) -> tuple[int, int]:
        cached = self._accept.get(k)
        if cached is None:
            h = Fraction(1)
            if k >= self.c:
                for j in range(self.c + 1, k + 1):
                    h *= self.lam / (j * self.rho)
            else:
                for j in range(k + 1, self.c + 1):
                    h *= j / (self.lam * self.rho)
            p = h / self.top
            cached = self._accept[k] = (p.numerator, p.denominator)
        return cached

    def sample(self, below: Any) -> int:
        m, c = self.m, self.c
        while True:
            g = 0
            while below(m):
                g += 1
            negative = below(2)
            if negative and g == 0:
                continue
            k = c - g if negative else c + g
            if k < 0:
                continue
            num, den = self._acceptance(k)
            if below(den) < num:
                return k


def sample_poisson(lam: Any, rng: Any) -> int:
    """One exact Poisson(lam) draw, rational ``lam >= 0`` (see :class:`_ExactPoisson`)."""
    lam = _as_fraction(lam, "lam")
    _check_rng(rng)
    if lam == 0:
        return 0
    return _ExactPoisson(lam).sample(_below(rng, 1))


def skellam_noise(shape: Any, mu: Any, rng: Any) -> np.ndarray:
    """An int64 array of Skellam(mu, mu) noise: ``Poisson(mu) - Poisson(mu)``, variance
    ``2 mu`` (Agarwal, Kairouz & Liu 2021, "The Skellam Mechanism for Differentially Private
    Federated Learning"). ``mu >= 0``.

    With a Generator: numpy's ``Generator.poisson`` twice (simulation speed; numpy's Poisson
    uses floating point inside, fine for simulation). In secure mode: the exact rational
    sampler (:func:`sample_poisson`) on OS randomness, ``mu`` read exactly (floats as their
    decimal repr), about ``sqrt(mu)`` uniform draws per Poisson sample.
    """
    shape, count = _count(shape)
    mu_exact = _as_fraction(mu, "mu")
    _check_rng(rng)
    if mu_exact == 0 or count == 0:
        return np.zeros(shape, dtype=np.int64)
    if isinstance(rng, np.random.Generator):
        lam = float(mu_exact)
        return (rng.poisson(lam, size=shape) - rng.poisson(lam, size=shape)).astype(np.int64)
    sampler = _ExactPoisson(mu_exact)
    below = _below(rng, count)
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        out[i] = sampler.sample(below) - sampler.sample(below)
    return out.reshape(shape)
