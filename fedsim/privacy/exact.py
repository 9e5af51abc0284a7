"""What the exact samplers share: their sources of randomness, exact parameters, and rational
enclosures of ``exp(-gamma)``.

Randomness is one of

- a ``numpy.random.Generator`` -- simulation randomness, reproducible from its seed;
- a :class:`SecureRandom` -- **secure mode**: OS randomness (``secrets`` / ``os.urandom``),
  not reproducible, never seeded, for noise that must hold against a real adversary.

Both give exactly uniform 64-bit words (:func:`word_source`), which is all the samplers use.
Parameters given as ``float`` are read as the shortest decimal that round-trips (``repr``):
``sigma=3.7`` means ``37/10`` exactly.
"""

from __future__ import annotations

import decimal
import math
import os
import secrets
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require

WORD = 1 << 64
#: exp_neg_bounds clamps gamma at _CLAMP * digits, keeping its rationals small
_CLAMP = 8
#: bit generators whose random_raw() is Generator.integers(0, 2^64, dtype=uint64)'s output
_RAW_64 = (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64)
RNG_ALLOWED = "a numpy.random.Generator, or SecureRandom() for secure mode"


class SecureRandom:
    """Secure-mode randomness from the operating system (``secrets`` / ``os.urandom``).

    Exposes the part of ``numpy.random.Generator``'s interface the samplers use
    (``integers``), plus ``randbelow`` (``secrets.randbelow``) and ``words`` /
    ``word_array`` (64-bit words from ``os.urandom``, which the samplers read in blocks). It
    takes no seed and cannot be reproduced: use it where the noise protects real data, a seeded
    ``Generator`` in simulations.
    """

    __slots__ = ()
    #: How results drawn with this source are labelled.
    label = "secure: OS randomness (os.urandom / secrets)"

    def randbelow(self, n: int) -> int:
        """A uniform integer in ``[0, n)`` (``n >= 1``, any size) from the OS."""
        return secrets.randbelow(n)

    def word_array(self, count: int) -> np.ndarray:
        """``count`` uniform 64-bit words from ``os.urandom``, as a uint64 array."""
        return np.frombuffer(os.urandom(8 * count), dtype="<u8").astype(np.uint64)

    def words(self, count: int) -> list[int]:
        """``count`` uniform 64-bit words from ``os.urandom``, as Python ints."""
        return self.word_array(count).tolist()

    def integers(self, low: int, high: int | None = None, size: Any = None) -> Any:
        """Uniform integers in ``[low, high)`` (``[0, low)`` if ``high`` is None), like
        ``Generator.integers``; an ``int`` if ``size`` is None, else an int64 array."""
        if high is None:
            low, high = 0, low
        require(int(high) > int(low), "high", high, f"an integer > low = {low}")
        span = int(high) - int(low)
        if size is None:
            return int(low) + secrets.randbelow(span)
        count = int(np.prod(size))
        values = [int(low) + secrets.randbelow(span) for _ in range(count)]
        return np.asarray(values, dtype=np.int64).reshape(size)

    def __repr__(self) -> str:
        return "SecureRandom()"


def check_rng(rng: Any) -> None:
    """A :class:`ConfigError` on ``rng`` unless it is a Generator or a :class:`SecureRandom`."""
    if not isinstance(rng, (SecureRandom, np.random.Generator)):
        raise ConfigError("rng", rng, RNG_ALLOWED)


def word_source(rng: Any) -> Callable[[int], np.ndarray]:
    """``fill(count)``: ``count`` exactly uniform 64-bit words (uint64 array) from ``rng``.

    A Generator gives ``rng.integers(0, 2^64, size=count, dtype=uint64)`` (its stream, in
    order, so a seed fixes every draw; for the bit generators whose raw output is 64 uniform
    bits that is ``random_raw``, the same words faster); a :class:`SecureRandom` reads
    ``os.urandom``.
    """
    check_rng(rng)
    if isinstance(rng, SecureRandom):
        return rng.word_array
    if isinstance(rng.bit_generator, _RAW_64):  # the same words, without integers()'s overhead
        return rng.bit_generator.random_raw
    return lambda count: rng.integers(0, WORD, size=count, dtype=np.uint64)


def as_fraction(value: Any, key: str) -> Fraction:
    """An exact non-negative rational; floats are read as their shortest decimal repr."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
        raise ConfigError(key, value, "a number >= 0 (int, float or fractions.Fraction)")
    if isinstance(value, float):
        require(math.isfinite(value), key, value, "a finite number >= 0")
        value = Fraction(repr(value))
    value = Fraction(value)
    require(value >= 0, key, value, "a number >= 0")
    return value


def shape_count(shape: Any) -> tuple[tuple[int, ...], int]:
    """``(shape, number of elements)`` for an int or a tuple of ints >= 0."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    require(
        all(isinstance(s, (int, np.integer)) and s >= 0 for s in shape),
        "shape",
        shape,
        "a tuple of integers >= 0",
    )
    return tuple(int(s) for s in shape), int(math.prod(shape))


def exp_neg_bounds(gamma: Fraction, digits: int) -> tuple[Fraction, Fraction]:
    """Rationals ``lo <= exp(-gamma) <= hi`` at about ``digits`` significant digits.

    gamma is enclosed by directed-rounding decimal divisions; ``Decimal.exp`` is correctly
    rounded (error <= half a unit in the last digit), widened here by a full unit. A gamma
    above ``8 digits`` gives ``(0, exp(-8 digits))`` (still an enclosure, and small rationals;
    it tightens as ``digits`` grows).
    """
    if gamma > _CLAMP * digits:
        return Fraction(0), Fraction(exp_neg_upper(gamma, digits))
    ctx = _context(digits, decimal.ROUND_FLOOR)
    num, den = decimal.Decimal(gamma.numerator), decimal.Decimal(gamma.denominator)
    gamma_lo = ctx.divide(num, den)
    ctx.rounding = decimal.ROUND_CEILING
    gamma_hi = ctx.divide(num, den)
    ctx.rounding = decimal.ROUND_HALF_EVEN
    upper, lower = ctx.exp(gamma_lo.copy_negate()), ctx.exp(gamma_hi.copy_negate())
    unit = Fraction(1, 10 ** (digits - 1))
    return Fraction(lower) * (1 - unit), Fraction(upper) * (1 + unit)


def exp_neg_upper(gamma: Fraction, digits: int) -> decimal.Decimal:
    """A decimal ``hi >= exp(-gamma)`` within a relative ``10^-(digits-2)`` of it (one decimal
    ``exp``, all roundings upward); ``exp(-8 digits)`` for a gamma above ``8 digits``."""
    gamma = min(gamma, Fraction(_CLAMP * digits))
    ctx = _context(digits, decimal.ROUND_FLOOR)
    gamma_lo = ctx.divide(decimal.Decimal(gamma.numerator), decimal.Decimal(gamma.denominator))
    ctx.rounding = decimal.ROUND_HALF_EVEN
    value = ctx.exp(gamma_lo.copy_negate())  # within half an ulp <= value * 10^-(digits-1) / 2
    ctx.rounding = decimal.ROUND_CEILING
    return ctx.multiply(value, 1 + decimal.Decimal(1).scaleb(1 - digits))


def _context(digits: int, rounding: str) -> decimal.Context:
    """A decimal context of ``digits`` digits whose exponent range never under- or overflows
    for the exponents here (an underflow to 0 would break an upper bound)."""
    return decimal.Context(
        prec=digits, rounding=rounding, Emin=decimal.MIN_EMIN, Emax=decimal.MAX_EMAX
    )
