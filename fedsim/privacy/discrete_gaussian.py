"""Fast exact discrete Gaussian N_Z(0, sigma^2): a table-driven proposal and an exact
acceptance with a float64 fast path and an exact rational tie-break.

Target: ``P(x) = f(x) / Z`` on the integers, ``f(x) = exp(-x^2 / (2 sigma^2))``, ``Z`` the sum of
``f`` (Canonne, Kamath & Steinke 2020, "The Discrete Gaussian for Differential Privacy", Def. 1).

**Proposal** (rejection from a piecewise-constant envelope, the "rectangle + tail" method of
Devroye 1986, "Non-Uniform Random Variate Generation", ch. V.4). The magnitudes are cut into
blocks ``B_0 = {0}``, ``B_q = {a_q, ..., a_q + c - 1}`` with ``a_q = 1 + (q - 1) c`` for
``q = 1..Q``, ``c = 2^j`` about ``sigma / 16`` (``c = 1`` for ``sigma < 32``), up to
``T = Q c >= 10 sigma``, then the tail ``{T + 1, ...}``. One proposal draws

1. an outcome ``q`` in ``{0, 1..Q, tail, null}`` with probability exactly ``W_q / 2^k``
   (``k = max(32, log2(2.5 sigma) + 10)``, 62 for ``sigma >= 2^28``): integer weights in a
   Walker alias table with integer thresholds (Walker 1977; Vose 1991), read off ``k`` bits;
2. in ``B_q`` a uniform position (``j`` bits) and a fair sign (one bit), ``x = +-m``; in the
   tail ``m = T + 1 + G``, ``G`` geometric with ``P(G = g) = (1 - r) r^g``,
   ``r = exp(-(T + 1) / sigma^2)`` (CKS 2020 Alg. 2's exact geometric); null is rejected;
3. accepts ``x`` with probability ``a(x) = lambda f(x) / pi(x)``, ``pi`` the proposal's pmf and
   ``lambda = L / 2^k``: ``a(0) = L / W_0 = 1`` (``W_0 = L``); in ``B_q``
   ``a(x) = 2 c L f(m) / W_q``; in the tail
   ``a(x) = [2 L exp(-(T + 1)^2 / (2 sigma^2)) / (W_t (1 - r))] exp(-G^2 / (2 sigma^2))``
   (as ``f(T + 1 + g) = f(T + 1) r^g exp(-g^2 / (2 sigma^2))``).

**Exactness.** An accepted ``x`` has probability proportional to ``pi(x) a(x) = lambda f(x)``,
whatever the weights are, provided every ``a(x) <= 1``: the output is exactly
``N_Z(0, sigma^2)``, the tail included. The weights guarantee ``a(x) <= 1``:
``W_q = ceil(2 c L hi_q)`` with ``hi_q`` a decimal upper bound of ``f(a_q)``, the largest ``f``
in ``B_q`` (correctly rounded decimal ``exp``, every rounding upward), ``W_t`` likewise from
upper bounds of ``f(T + 1)`` and ``r``; ``L`` is chosen so that the weights sum to at most
``2^k`` (checked in integers), the rest is ``null``. Step 1 is exact: every outcome has
probability ``W_q / 2^k`` exactly (tests/privacy/test_discrete_gaussian.py rebuilds it from the
table); step 2's uniforms are bit fields. Step 3 decides ``U < a(x)`` for ``U`` uniform on [0, 1),
whose binary digits are read only as far as the decision needs: its first ``b`` bits ``u1``
come from the proposal's word (``b = 63 - k - j``, 1 for ``sigma >= 2^28``), the next 53 ``u2``
from a fresh word, then 64 at a time. Each stage settles the decision where ``U``'s known
digits put it below or above ``a(x)`` whatever the unread ones are: the float stages against
``p_hat +- 2^-40``, ``p_hat = fl(exp(-fl((m - a_q)(m + a_q) / (2 sigma^2))) * beta_q)`` with
``beta_q = fl(2 c L f(a_q) / W_q)`` (``u1 + 1 <= (p_hat - 2^-40) 2^b`` accepts,
``u1 >= (p_hat + 2^-40) 2^b`` rejects; then the same with ``u2`` on ``p_hat 2^b - u1``), and
what is left (about ``2^-38`` of the proposals) against rational enclosures of
``a(x) = exp(-m^2 / (2 sigma^2)) 2 c L / W_q`` of growing precision until they separate (the
exact rational tie-break). The tail's two acceptances are decided by the rational comparison
alone. The float stages are right whenever ``|p_hat - a(x)| <= 2^-40``: the exponent
``(m - a_q)(m + a_q) / (2 sigma^2) <= 0.7`` carries at most four roundings (relative
``4 * 2^-53``, so ``exp`` moves by at most ``4/e * 2^-53``), numpy's float64 ``exp`` is within
a few ulps, ``beta_q`` and the product one rounding each: the total is below ``2^-49``, 500
times inside the window (tests/privacy/test_discrete_gaussian.py checks it against 60-digit
decimals). Were the bound ever exceeded, a decision would be wrong with probability at most
``|p_hat - a(x)|``.

Cost: one uniform 64-bit word per proposal (two for ``sigma >= 2^28``), a second for about
``2^(1-b)`` of them, about twenty numpy passes over chunks of 4096, about 97% of proposals
accepted (100% for ``sigma < 32``); the table (at most 323 blocks, decimal arithmetic, one or
two milliseconds) is built once per ``sigma`` and cached. Randomness is a
``numpy.random.Generator`` (its stream fixes every draw) or a
:class:`~fedsim.privacy.exact.SecureRandom` (``os.urandom`` words, same algorithm). ``sigma``
is read exactly (floats as their decimal repr), see :func:`fedsim.privacy.exact.as_fraction`.
Speed against the CKS sampler: experiments/bench/sampler.py.
"""

from __future__ import annotations

import decimal
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from fedsim.config import require
from fedsim.privacy.exact import (
    as_fraction,
    exp_neg_bounds,
    exp_neg_upper,
    shape_count,
    word_source,
)

#: uniform bits that pick the alias-table outcome: probabilities are multiples of 2^-k, k at
#: least 32 (log2(2.5 sigma) + 10 for large sigma), 62 when the position has its own word
ALIAS_BITS = 32
WIDE_ALIAS_BITS = 62
#: the table reaches T >= TAIL_SIGMAS * sigma; the tail beyond it has mass below e^-50
TAIL_SIGMAS = 10
#: block width c = 2^floor(log2(sigma / BLOCKS_PER_SIGMA)): 16 to 32 blocks per sigma
BLOCKS_PER_SIGMA = 16
#: largest sigma: the draws are int64 and the tail must stay far from 2^63
MAX_SIGMA = 1 << 56
#: half-width of the undecided window around p_hat, as a power of two (2^-40)
_MARGIN_BITS = 40
_UNIFORM_BITS = 53
#: the first word: bits 63..64-k alias, bit 63-k sign, bits 62-k..j the first 63 - k - j bits
#: of U, bits j-1..0 the position; wide (j > 23, or no room): 63..2 alias, bit 1 sign, bit 0
#: U's first bit, the position from a second word
_POSITION_BITS = 23
_DIGITS = 30
#: proposals per vectorised pass: small enough that the temporaries stay in cache
_CHUNK = 4096


@dataclass(frozen=True)
class Table:
    """Everything one ``sigma^2`` needs (see the module docstring for the symbols)."""

    s2: Fraction
    width_bits: int  # j: block width c = 2^j
    blocks: int  # Q
    scale: int  # L
    weights: tuple[int, ...]  # W_0, W_1..W_Q, W_t, W_null (sum 2^k)
    threshold: np.ndarray  # alias table: column i keeps i when v < threshold[i] (int64)
    alias: np.ndarray  # ... and gives alias[i] otherwise (int64)
    column_bits: int  # n: 2^n columns
    alias_bits: int  # k: the weights sum to 2^k (32 or more; 62 when wide)
    level_mask: int  # 2^(k - n) - 1
    sign_shift: int  # 63 - the sign's bit in the first word
    uniform_bits: int  # b: the bits of U in the first word (63 - k - j, or 1 when wide)
    uniform_shift: int  # their lowest bit (j, or 0 when wide)
    wide: bool  # the position comes from a word of its own
    integer_exponent: bool  # c * 2 T < 2^62: (m - a_q)(m + a_q) computed in int64
    base: np.ndarray  # a_q per outcome (0 for 0, tail, null; int64)
    position_mask: np.ndarray  # c - 1 for q in 1..Q, else 0 (int64)
    beta: np.ndarray  # float64 beta_q 2^53 (see _proposals)
    inv_two_s2: float  # fl(1 / (2 sigma^2))
    acceptance: float  # about lambda Z, the fraction of proposals accepted

    @property
    def width(self) -> int:
        return 1 << self.width_bits

    @property
    def tail(self) -> int:
        """Index of the tail outcome."""
        return self.blocks + 1

    @property
    def top(self) -> int:
        """T, the largest magnitude inside the table."""
        return self.blocks * self.width

    def ratio(self, q: int) -> Fraction:
        """``a(x) / f(m)`` in block q: ``2 c L / W_q`` for q >= 1, ``L / W_0 = 1`` for q = 0."""
        if q == 0:
            return Fraction(self.scale, self.weights[0])
        return Fraction(2 * self.width * self.scale, self.weights[q])

    def tail_bounds(self, digits: int) -> tuple[Fraction, Fraction]:
        """Rationals enclosing ``2 L f(T + 1) / (W_t (1 - r))``, the tail's first acceptance."""
        edge, rate = _tail_exponents(self.s2, self.top)
        digits += _tail_digits(rate)
        f_lo, f_hi = exp_neg_bounds(edge, digits)
        r_lo, r_hi = exp_neg_bounds(rate, digits)
        factor = Fraction(2 * self.scale, self.weights[self.tail])
        return factor * f_lo / (1 - r_lo), factor * f_hi / (1 - r_hi)


def _tail_exponents(s2: Fraction, top: int) -> tuple[Fraction, Fraction]:
    """``((T + 1)^2 / (2 sigma^2), (T + 1) / sigma^2)``: ``f(T + 1) = exp(-first)`` and
    ``r = exp(-second)``."""
    return Fraction((top + 1) ** 2) / (2 * s2), Fraction(top + 1) / s2


def _tail_digits(rate: Fraction) -> int:
    """Extra decimal digits so that ``1 - r`` is resolved although ``r = exp(-rate)`` is near 1."""
    return 2 if rate >= 1 else len(str(rate.denominator // rate.numerator)) + 2


def _alias(weights: list[int], column_bits: int, alias_bits: int) -> tuple[np.ndarray, ...]:
    """Walker's alias table for integer weights summing to ``2^alias_bits`` (Vose 1991), in
    integers: ``2^n`` columns of height ``H = 2^(alias_bits - n)``; column ``i`` keeps ``i`` for
    ``v < threshold[i]`` (``v`` uniform below ``H``) and gives ``alias[i]`` otherwise, so
    outcome ``k`` has probability exactly ``weights[k] / 2^alias_bits``."""
    columns = 1 << column_bits
    height = 1 << (alias_bits - column_bits)
    left = list(weights) + [0] * (columns - len(weights))
    threshold = [height] * columns
    alias = list(range(columns))
    small = [i for i in range(columns) if left[i] < height]
    large = [i for i in range(columns) if left[i] >= height]
    while small and large:
        s, g = small.pop(), large.pop()
        threshold[s], alias[s] = left[s], g
        left[g] -= height - left[s]
        (small if left[g] < height else large).append(g)
    # exact integers: whatever is left holds exactly `height` (the total is columns * height)
    return np.asarray(threshold, dtype=np.int64), np.asarray(alias, dtype=np.int64)


def _block_heights(
    s2: Fraction, c: int, blocks: int, up: decimal.Context
) -> list[decimal.Decimal]:
    """Upper bounds ``hi_q >= f(a_q) = exp(-a_q^2 / (2 s2))`` of each block's left end, by
    ``f(a_{q+1}) = f(a_q) r0 r1^(q-1)``, ``r0 = exp(-(2c + c^2) / (2 s2))``,
    ``r1 = exp(-c^2 / s2)``: products of upper bounds, rounded up (``up``)."""
    r0 = exp_neg_upper(Fraction(2 * c + c * c) / (2 * s2), _DIGITS)
    r1 = exp_neg_upper(Fraction(c * c) / s2, _DIGITS)
    hi = [exp_neg_upper(1 / (2 * s2), _DIGITS)]
    power = decimal.Decimal(1)
    for _ in range(blocks - 1):
        hi.append(up.multiply(up.multiply(hi[-1], r0), power))
        power = up.multiply(power, r1)
    return hi


def _tail_mass(s2: Fraction, top: int, up: decimal.Context) -> decimal.Decimal:
    """An upper bound ``>= 2 f(T + 1) / (1 - r)`` of the mass beyond ``top`` (both sides)."""
    edge, rate = _tail_exponents(s2, top)
    digits = _DIGITS + _tail_digits(rate)
    f_edge = exp_neg_upper(edge, digits)
    gap = decimal.Context(prec=digits, rounding=decimal.ROUND_FLOOR).subtract(
        1, exp_neg_upper(rate, digits)
    )  # <= 1 - r
    return up.divide(up.multiply(2, f_edge), gap)


def _alias_weights(
    s2: Fraction,
    alias_bits: int,
    block_hi: list[decimal.Decimal],
    tail_hi: decimal.Decimal,
    total: decimal.Decimal,
    up: decimal.Context,
) -> tuple[int, list[int]]:
    """The scale ``L`` and the integer alias weights (0, each block, the tail, the null
    remainder) summing to ``2^k``, ``k = alias_bits``. ``W_q <= L * bound + 1`` each, so this
    L keeps the sum within ``2^k``; k is at least 10 bits more than the proposals per draw
    need (L >= 2^10 / 2.5, so rounding L down costs under 0.1% of the proposals)."""
    sigma = math.sqrt(float(s2))
    free = (1 << alias_bits) - (len(block_hi) + 2)
    scale = int(decimal.Context(prec=_DIGITS, rounding=decimal.ROUND_FLOOR).divide(free, total))
    require(scale >= 1, "sigma", sigma, f"a standard deviation <= {MAX_SIGMA}")

    def ceil(value: decimal.Decimal) -> int:
        return int(up.multiply(scale, value).to_integral_value(rounding=decimal.ROUND_CEILING))

    weights = [scale] + [max(1, ceil(b)) for b in block_hi] + [max(1, ceil(tail_hi))]
    null = (1 << alias_bits) - sum(weights)
    if null < 0:  # cannot happen (see above); an exactness guard, not an input check
        raise RuntimeError(f"discrete Gaussian table for sigma^2 = {s2} overfull by {-null}")
    weights.append(null)
    return scale, weights


def _columns(
    columns: int,
    c: int,
    hi: list[decimal.Decimal],
    weights: list[int],
    scale: int,
    uniform_bits: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per alias column: the first value of its block, the in-block position mask and the
    acceptance threshold ``beta`` (column 0: the value 0, always accepted; the tail's: NaN,
    decided exactly; null and padding: never accepted)."""
    blocks = len(hi)
    base = np.zeros(columns, dtype=np.int64)
    base[1 : blocks + 1] = 1 + np.arange(blocks, dtype=np.int64) * c
    mask = np.zeros(columns, dtype=np.int64)
    mask[1 : blocks + 1] = c - 1
    beta = np.full(columns, -(2.0**60))  # null and padding: never accepted
    beta[0] = 2.0 ** (uniform_bits + 1)  # a(0) = 1: always accepted
    beta[1 : blocks + 1] = [
        float(2 * c * scale * h) / w * 2.0**uniform_bits
        for h, w in zip(hi, weights[1:], strict=False)
    ]
    beta[blocks + 1] = math.nan  # the tail: always decided exactly
    return base, mask, beta


@functools.lru_cache(maxsize=64)
def table(s2: Fraction) -> Table:
    """The proposal table of ``N_Z(0, s2)``, ``0 < s2``, built once per ``s2`` (cached)."""
    sigma = math.sqrt(float(s2))
    width_bits = max(0, math.floor(math.log2(sigma / BLOCKS_PER_SIGMA))) if sigma >= 32 else 0
    c = 1 << width_bits
    blocks = max(1, math.ceil(TAIL_SIGMAS * sigma / c))
    top = blocks * c
    up = decimal.Context(
        prec=_DIGITS + 10,
        rounding=decimal.ROUND_CEILING,
        Emin=decimal.MIN_EMIN,
        Emax=decimal.MAX_EMAX,
    )
    hi = _block_heights(s2, c, blocks, up)
    tail_hi = _tail_mass(s2, top, up)
    two_c = decimal.Decimal(2 * c)
    block_hi = [up.multiply(two_c, h) for h in hi]  # >= 2 c f(a_q)
    total = up.add(up.add(1, functools.reduce(up.add, block_hi)), tail_hi)
    # the position moves to its own word when the first word has no room left for it and
    # one bit of U
    alias_bits = max(ALIAS_BITS, math.ceil(math.log2(2.5 * max(sigma, 1.0))) + 10)
    wide = width_bits > _POSITION_BITS or alias_bits + 1 + width_bits > 63
    if wide:
        alias_bits = WIDE_ALIAS_BITS
    scale, weights = _alias_weights(s2, alias_bits, block_hi, tail_hi, total, up)
    column_bits = max(1, (len(weights) - 1).bit_length())
    threshold, alias = _alias(weights, column_bits, alias_bits)
    uniform_bits = 1 if wide else 63 - alias_bits - width_bits
    base, mask, beta = _columns(1 << column_bits, c, hi, weights, scale, uniform_bits)
    z = (
        math.sqrt(2 * math.pi * float(s2))
        if sigma >= 2
        else float(sum(math.exp(-(x * x) / (2 * float(s2))) for x in range(-top, top + 1)))
    )
    return Table(
        s2=s2,
        width_bits=width_bits,
        blocks=blocks,
        scale=scale,
        weights=tuple(weights),
        threshold=threshold,
        alias=alias,
        column_bits=column_bits,
        alias_bits=alias_bits,
        level_mask=(1 << (alias_bits - column_bits)) - 1,
        sign_shift=alias_bits,
        uniform_bits=uniform_bits,
        uniform_shift=0 if wide else width_bits,
        wide=wide,
        integer_exponent=c * 2 * top < 1 << 62,
        base=base,
        position_mask=mask,
        beta=beta,
        inv_two_s2=float(1 / (2 * s2)),
        acceptance=min(1.0, scale * z / (1 << alias_bits)),
    )


# --------------------------------------------------------------------------------------------
# exact decisions (rare: the tie-break window and the tail)
# --------------------------------------------------------------------------------------------


class _Bits:
    """Scalar uniform words and integers from the sampler's word source, for the exact paths."""

    __slots__ = ("_fill",)

    def __init__(self, fill: Callable[[int], np.ndarray]) -> None:
        self._fill = fill

    def word(self) -> int:
        return int(self._fill(1)[0])

    def below(self, n: int) -> int:
        """A uniform integer in ``[0, n)``: rejection from ``bits(n - 1)`` uniform bits."""
        bits = max(1, (n - 1).bit_length())
        words = -(-bits // 64)
        while True:
            x = 0
            for _ in range(words):
                x = (x << 64) | self.word()
            x >>= 64 * words - bits
            if x < n:
                return x


def uniform_below(
    bounds: Callable[[int], tuple[Fraction, Fraction]],
    bits: _Bits,
    top: int | None = None,
    width: int = 64,
) -> bool:
    """Whether ``U < p`` for ``U = (top + V) / 2^width`` (``top``: ``width`` uniform bits
    already drawn; a fresh word if None), ``V`` uniform on [0, 1) whose binary digits are drawn
    64 at a time only as far as the comparison needs; ``bounds(digits)`` encloses ``p`` in
    rationals, tighter as ``digits`` grows. Exactly Bernoulli(p)."""
    if top is None:
        numerator, width = bits.word(), 64
    else:
        numerator = int(top)
    digits = _DIGITS
    while True:
        lo, hi = bounds(digits)
        if Fraction(numerator + 1, 1 << width) <= lo:
            return True
        if Fraction(numerator, 1 << width) >= hi:
            return False
        numerator, width, digits = (numerator << 64) | bits.word(), width + 64, digits + 20


def _bernoulli_exp(gamma: Fraction, bits: _Bits) -> bool:
    """Bernoulli(exp(-gamma)), exactly."""
    return uniform_below(lambda digits: exp_neg_bounds(gamma, digits), bits)


def _geometric(rate: Fraction, bits: _Bits) -> int:
    """``G`` with ``P(G = g) = (1 - r) r^g``, ``r = exp(-rate)``, ``rate = s / t`` > 0: CKS 2020
    Alg. 2 without its sign. ``X = U + t V`` is geometric with ratio ``exp(-1/t)`` (``U``
    uniform below ``t`` kept with probability ``exp(-U/t)``, ``V`` geometric with ratio
    ``exp(-1)``), and ``floor(X / s)`` geometric with ratio ``exp(-s/t)``."""
    s, t = rate.numerator, rate.denominator
    while True:
        u = bits.below(t)
        if u and not _bernoulli_exp(Fraction(u, t), bits):
            continue
        v = 0
        while _bernoulli_exp(Fraction(1), bits):
            v += 1
        return (u + t * v) // s


def _tail_magnitude(tab: Table, bits: _Bits) -> int | None:
    """The tail outcome: ``T + 1 + G`` if accepted, None if rejected (module docstring, 2-3)."""
    g = _geometric(_tail_exponents(tab.s2, tab.top)[1], bits)
    if not uniform_below(tab.tail_bounds, bits):
        return None
    if g and not _bernoulli_exp(Fraction(g * g) / (2 * tab.s2), bits):
        return None
    return tab.top + 1 + g


def _block_bounds(tab: Table, q: int, m: int) -> Callable[[int], tuple[Fraction, Fraction]]:
    """Enclosures of ``a(x) = exp(-m^2 / (2 sigma^2)) 2 c L / W_q`` for ``|x| = m`` in block q."""
    gamma, ratio = Fraction(m * m) / (2 * tab.s2), tab.ratio(q)

    def bounds(digits: int) -> tuple[Fraction, Fraction]:
        lo, hi = exp_neg_bounds(gamma, digits)
        return lo * ratio, hi * ratio

    return bounds


# --------------------------------------------------------------------------------------------
# the vectorised sampler
# --------------------------------------------------------------------------------------------


def _scaled_acceptance(tab: Table, outcome: np.ndarray, position: np.ndarray) -> Any:
    """``(m, p_hat 2^53)`` for proposals ``(q, position)``: ``m = a_q + position`` and
    ``p_hat = fl(exp(-fl((m - a_q)(m + a_q) / (2 sigma^2))) beta_q)`` (module docstring)."""
    base = tab.base[outcome]
    magnitude = base + position
    scaled = tab.beta[outcome]
    if tab.width_bits:  # c = 1: every block is one magnitude and a(x) = beta_q
        if tab.integer_exponent:  # (m - a_q)(m + a_q) < 2^62: exact in int64, one rounding
            exponent = (position * (magnitude + base)).astype(np.float64)
        else:  # two roundings and one for m + a_q
            exponent = position.astype(np.float64) * (magnitude + base).astype(np.float64)
        scaled = np.exp(exponent * -tab.inv_two_s2) * scaled
    return magnitude, scaled


def _proposals(tab: Table, size: int, fill: Callable[[int], np.ndarray], bits: _Bits) -> Any:
    """``size`` proposals and their decisions: (signed values, accepted mask).

    The first word's fields (layout above ``_POSITION_BITS``) give the outcome, the position,
    the sign and U's first ``b`` bits ``u1``; ``beta`` holds ``beta_q 2^b`` (NaN for the tail,
    which always reaches the exact path; ``-2^60`` for null, never accepted). U's digits are
    read lazily: ``u1`` settles all but about ``2^(1-b)`` of the decisions; those read 53 more
    bits ``u2`` from a fresh word (vectorised); what they leave (about ``2^-38``) goes to the
    exact rational comparison (see the module docstring for the window).
    """
    word = fill(size)
    first = word.view(np.int64)
    column = (word >> np.uint64(64 - tab.column_bits)).view(np.int64)
    level = (first >> 64 - tab.alias_bits) & tab.level_mask
    outcome = np.where(level < tab.threshold[column], column, tab.alias[column])
    if not tab.wide:
        position = first & tab.position_mask[outcome]
    else:
        third = fill(size) >> np.uint64(64 - tab.width_bits)
        position = third.view(np.int64) & tab.position_mask[outcome]
    magnitude, scaled = _scaled_acceptance(tab, outcome, position)
    u1 = (first >> tab.uniform_shift) & ((1 << tab.uniform_bits) - 1)
    # certain: u1 + 1 <= (p - 2^-40) 2^b accepts, u1 >= (p + 2^-40) 2^b rejects
    margin = 2.0 ** (tab.uniform_bits - _MARGIN_BITS)
    diff = u1.astype(np.float64) - scaled
    accepted = diff <= -1.0 - margin
    open_ = np.flatnonzero(~accepted & ~(diff >= margin))  # NaN (the tail) lands here
    if open_.size:
        block = open_[outcome[open_] <= tab.blocks]
        # V < r for U = (u1 + V) / 2^b, r = p 2^b - u1 (exact subtraction), V = (u2 + W) / 2^53
        reach = (scaled[block] - u1[block]) * 2.0**_UNIFORM_BITS
        u2 = (fill(block.size) >> np.uint64(64 - _UNIFORM_BITS)).view(np.int64)
        u2f = u2.astype(np.float64)
        wide = margin * 2.0**_UNIFORM_BITS
        accepted[block] = u2f <= reach - wide - 1.0
        exact = np.zeros(size, dtype=bool)
        exact[block[~accepted[block] & ~(u2f >= reach + wide)]] = True
        exact[open_[outcome[open_] == tab.tail]] = True
        prefix = dict(zip(block.tolist(), u2.tolist(), strict=True))
        for i in np.flatnonzero(exact):  # in index order: the seed fixes every word
            q = int(outcome[i])
            if q == tab.tail:
                m = _tail_magnitude(tab, bits)
                accepted[i] = m is not None
                if m is not None:
                    magnitude[i] = m
            else:
                top = (int(u1[i]) << _UNIFORM_BITS) | prefix[int(i)]
                m = int(magnitude[i])
                accepted[i] = uniform_below(
                    _block_bounds(tab, q, m), bits, top, tab.uniform_bits + _UNIFORM_BITS
                )
    sign = (first << tab.sign_shift) >> 63  # 0 or -1
    return (magnitude ^ sign) - sign, accepted


def discrete_gaussian(shape: Any, sigma: Any, rng: Any) -> np.ndarray:
    """An int64 array of independent exact N_Z(0, sigma^2) draws (module docstring).

    ``sigma`` in ``[0, 2^56]`` (int, float read as its decimal repr, or Fraction; the variance
    parameter is ``sigma^2`` exactly). The discrete Gaussian's variance is slightly below
    ``sigma^2`` (CKS 2020, Cor. 9); for ``sigma >= 1`` the gap is negligible. ``rng``: a
    ``numpy.random.Generator`` (reproducible from its seed) or ``SecureRandom()``.
    """
    shape, count = shape_count(shape)
    s = as_fraction(sigma, "sigma")
    fill = word_source(rng)
    require(s <= MAX_SIGMA, "sigma", sigma, f"a number in [0, 2^56 = {MAX_SIGMA}]")
    out = np.zeros(count, dtype=np.int64)
    if s == 0 or count == 0:
        return out.reshape(shape)
    tab = table(s * s)
    bits = _Bits(fill)
    filled = 0
    while filled < count:
        need = count - filled
        size = min(_CHUNK, math.ceil(need / tab.acceptance) + 4 * math.isqrt(need) + 16)
        values, accepted = _proposals(tab, size, fill, bits)
        kept = values[accepted][:need]
        out[filled : filled + kept.size] = kept
        filled += kept.size
    return out.reshape(shape)
