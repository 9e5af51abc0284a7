"""The distributed discrete Gaussian (DDGauss) client encoding and its server-side inverse.

Kairouz, Liu & Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning
with Secure Aggregation", ICML 2021 (KLS21, arXiv 2102.06387), Sec. 4. A client's real update
x in R^d becomes a vector of field elements in five steps:

1. **clip**: x <- x * min(1, c / ||x||_2), so ||x||_2 <= c;
2. **rotate**: pad to D = 2^ceil(log2 d) and apply the randomised Hadamard transform
   x <- H_D diag(s) x / sqrt(D) with Rademacher signs s drawn from a seed shared by every client
   of the round (orthonormal: norms are unchanged, coordinates are flattened to about c/sqrt(D));
3. **scale**: x <- x / gamma, gamma being KLS21's granularity (one integer step is gamma real
   units; the fixed-point scale factor is 1/gamma);
4. **conditional randomised rounding**: each coordinate rounds up with probability equal to its
   fractional part (unbiased), and the whole vector is redrawn until
   ||round(x)||_2 <= Delta_2 (:func:`rounding_norm_bound`, KLS21 Sec. 4.1); a draw fails with
   probability at most beta, so ``max_tries`` redraws fail with probability beta^max_tries;
5. **noise and field**: add N_Z(0, (sigma/gamma)^2) per coordinate (exact discrete Gaussian
   draws from the sampler the caller passes in: :data:`NoiseSampler`, e.g.
   ``fedsim.privacy.mechanisms.discrete_gaussian``) and map the signed integers to F_p.

The server decodes the modular sum of n encodings: centered representative (signed), times
gamma, inverse rotation diag(s) H_D / sqrt(D), drop the padding. Units: ``clip`` and ``noise_std``
are in the update's real units; ``gamma`` in real units per integer step; the integer-domain
noise standard deviation is noise_std / gamma.

:func:`choose_gamma` picks the finest granularity for which the worst-case modular sum of n
encodings (n * Delta_2 per coordinate plus a tail bound on the summed noise) fits in a
``bits``-bit signed range, checked with :meth:`protocols.field.MersenneField.sum_headroom_bits`
for the field itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from protocols.field import DEFAULT_FIELD, MersenneField

DEFAULT_BETA = math.exp(-0.5)
"""KLS21's default conditional-rounding parameter beta = e^(-1/2)."""

DEFAULT_FAILURE_PROBABILITY = 1e-12
"""Chance, per round, that the summed noise exceeds the tail bound used by :func:`choose_gamma`."""

NoiseSampler = Callable[[int, float, Any], np.ndarray]
"""``sampler(count, sigma, rng)``: ``count`` independent exact N_Z(0, sigma^2) draws (int64),
randomness from ``rng`` (e.g. :func:`fedsim.privacy.mechanisms.discrete_gaussian`)."""


def padded_dimension(dim: int) -> int:
    """D = 2^ceil(log2 dim), the length the Hadamard transform needs (1 for dim = 1)."""
    if not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return 1 << (int(dim) - 1).bit_length()


def hadamard_transform(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform H_D x / sqrt(D) along the last axis (D a power of
    two), in O(D log D) by the butterfly recursion; it is its own inverse.

    Stage h (h = 1, 2, ..., D/2 in turn) maps each pair (a, b) = (x[i], x[i + h]) to
    (a + b, a - b). For D >= 2^12 the stages run on x as a matrix of R x C = D (C = 2^floor(
    log2(D) / 2)): the stages h < C act within rows and run on the transpose, so that every
    stage adds and subtracts whole contiguous rows; then the stages h >= C act across rows.
    Every value is the same sum of the same two numbers in the same stage order, so the
    result is the plain butterfly's to the bit.
    """
    return _transform_in_place(np.array(x, dtype=np.float64))


def _transform_in_place(x: np.ndarray) -> np.ndarray:
    """:func:`hadamard_transform` of a float64 array it may overwrite (and may return)."""
    length = x.shape[-1]
    if length < 1 or length & (length - 1):
        raise ValueError(f"x's last axis has length {length}; allowed: a power of two")
    if length < _BLOCKED_FROM:
        out = _butterfly(x)
        return np.divide(out, math.sqrt(length), out=out)
    lead = x.shape[:-1]
    low_bits = (length.bit_length() - 1) // 2
    cols, rows = 1 << low_bits, length >> low_bits
    low = np.ascontiguousarray(np.swapaxes(x.reshape(*lead, rows, cols), -1, -2))
    low = _row_stages(low, np.empty_like(low))  # stages h < C, on the transpose (C, R)
    high = x.reshape(*lead, rows, cols)
    np.copyto(high, np.swapaxes(low, -1, -2))
    high = _row_stages(high, low.reshape(*lead, rows, cols)).reshape(*lead, length)
    return np.divide(high, math.sqrt(length), out=high)  # stages h >= C, then the scale


_BLOCKED_FROM = 1 << 12
"""From this length on :func:`hadamard_transform` runs its stages on whole rows."""


def _butterfly(x: np.ndarray) -> np.ndarray:
    """The unnormalised butterfly stages of ``x`` (its last axis a power of two), in place."""
    lead, length, h = x.shape[:-1], x.shape[-1], 1
    while h < length:
        view = x.reshape(*lead, -1, 2, h)
        a, b = view[..., 0, :].copy(), view[..., 1, :]
        view[..., 0, :] += b
        view[..., 1, :] = a - b
        h *= 2
    return x


def _row_stages(a: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """The butterfly stages across axis -2 of ``a`` (shape (..., K, L), K a power of two),
    pairing whole rows, between ``a`` and ``spare`` in turn; returns the one holding them."""
    *lead, count, width = a.shape
    h = 1
    while h < count:
        pairs = a.reshape(*lead, -1, 2, h, width)
        out = spare.reshape(*lead, -1, 2, h, width)
        np.add(pairs[..., 0, :, :], pairs[..., 1, :, :], out=out[..., 0, :, :])
        np.subtract(pairs[..., 0, :, :], pairs[..., 1, :, :], out=out[..., 1, :, :])
        a, spare = spare, a
        h *= 2
    return a


def rotation_signs(padded_dim: int, seed: int | np.random.SeedSequence) -> np.ndarray:
    """Rademacher signs (+1.0/-1.0) of the randomised Hadamard rotation, drawn from ``seed``
    (the round's public seed, the same for every client). Integer seeds are cached: every
    client of a worker rotates with the round's one vector (returned read-only)."""
    if isinstance(seed, int | np.integer):
        return _cached_signs(int(padded_dim), int(seed))
    return _draw_signs(padded_dim, seed)


def _draw_signs(padded_dim: int, seed: int | np.random.SeedSequence) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.integers(0, 2, size=padded_dim) == 1, 1.0, -1.0)


@functools.lru_cache(maxsize=4)
def _cached_signs(padded_dim: int, seed: int) -> np.ndarray:
    signs = _draw_signs(padded_dim, seed)
    signs.flags.writeable = False
    return signs


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """H diag(signs) x / sqrt(D), x zero-padded to D = len(signs)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] > signs.size:
        raise ValueError(f"x has {x.shape[-1]} coordinates, more than D = {signs.size}")
    padded = np.zeros((*x.shape[:-1], signs.size))
    padded[..., : x.shape[-1]] = x
    return _transform_in_place(np.multiply(padded, signs, out=padded))


def unrotate(y: np.ndarray, signs: np.ndarray, dim: int) -> np.ndarray:
    """The inverse of :func:`rotate`: diag(signs) H y / sqrt(D), then the first ``dim``."""
    return (hadamard_transform(y) * signs)[..., :dim]


def clip_l2(x: np.ndarray, clip: float) -> np.ndarray:
    """x * min(1, clip / ||x||_2) (x unchanged when its norm is at most ``clip``)."""
    x = np.asarray(x, dtype=np.float64)
    norm = float(np.linalg.norm(x))
    return x if norm <= clip else x * (clip / norm)


def rounding_norm_bound(scaled_norm: float, padded_dim: int, beta: float = DEFAULT_BETA) -> float:
    """Delta_2: the L2 bound conditional randomised rounding enforces (KLS21 Sec. 4.1).

    For ||x||_2 <= c (integer units, ``scaled_norm``) in dimension D, unconditional randomised
    rounding exceeds

        sqrt(c^2 + D/4 + sqrt(2 ln(1/beta)) * (c + sqrt(D)/2))

    with probability at most beta, and never exceeds c + sqrt(D) (triangle inequality, each
    coordinate moves by < 1); Delta_2 is the smaller of the two (beta = 0: the second).
    """
    if not (math.isfinite(scaled_norm) and scaled_norm >= 0):
        raise ValueError(f"scaled_norm must be finite and >= 0, got {scaled_norm!r}")
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    padded_dim = int(padded_dim)
    if padded_dim < 1:
        raise ValueError(f"padded_dim must be >= 1, got {padded_dim!r}")
    worst = scaled_norm + math.sqrt(padded_dim)
    if beta == 0:
        return worst
    squared = (
        scaled_norm**2
        + padded_dim / 4
        + math.sqrt(2 * math.log(1 / beta)) * (scaled_norm + math.sqrt(padded_dim) / 2)
    )
    return min(worst, math.sqrt(squared))


def rounded_l1_bound(l2_bound: float, padded_dim: int) -> float:
    """Delta_1 of an integer vector with ||v||_2 <= Delta_2 in dimension D:
    min(sqrt(D) * Delta_2, Delta_2^2) (Cauchy-Schwarz; |v_j| <= v_j^2 for integers)."""
    return l2_bound * min(math.sqrt(padded_dim), l2_bound)


def randomised_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased randomised rounding: floor(x) + Bernoulli(x - floor(x)), as int64."""
    floor = np.floor(x)
    up = rng.random(x.shape) < (x - floor)
    rounded = floor.astype(np.int64)
    rounded += up
    return rounded


def conditional_round(
    x: np.ndarray, bound: float, rng: np.random.Generator, max_tries: int = 100
) -> tuple[np.ndarray, int]:
    """Randomised rounding of ``x`` redrawn until ||result||_2 <= ``bound`` (KLS21 Sec. 4.1);
    returns (integers, tries). Raises ``RuntimeError`` after ``max_tries`` failed draws."""
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries!r}")
    bound_sq = bound * bound
    for tries in range(1, max_tries + 1):
        rounded = randomised_round(x, rng)
        if float(np.dot(rounded, rounded)) <= bound_sq:
            return rounded, tries
    raise RuntimeError(
        f"conditional rounding failed {max_tries} times: ||round(x)||_2 stayed above the bound "
        f"Delta_2 = {bound:.6g} (||x||_2 = {float(np.linalg.norm(x)):.6g}); raise beta or "
        "max_tries"
    )


def noise_tail_bound(std: float, count: int, failure_probability: float) -> float:
    """t with P(max of ``count`` |N_Z(0, std^2)| draws > t) <= ``failure_probability``.

    The discrete Gaussian is sub-Gaussian with variance proxy std^2 (Canonne, Kamath & Steinke
    2020, Cor. 9), so P(|X| > t) <= 2 exp(-t^2 / (2 std^2)); a union bound over ``count``.
    """
    if std == 0:
        return 0.0
    if not 0 < failure_probability < 1:
        raise ValueError(f"failure_probability must be in (0, 1), got {failure_probability!r}")
    return std * math.sqrt(2 * math.log(2 * count / failure_probability))


@dataclass(frozen=True)
class EncodedUpdate:
    """One client's encoding: ``signed`` (the D signed integers, rounded update plus noise),
    the rounding ``tries``, whether the update was clipped and the ``field``;
    :attr:`elements` are the integers in the field (computed when first read; ValueError if
    one lies beyond its signed range)."""

    signed: np.ndarray
    tries: int
    clipped: bool
    field: MersenneField = DEFAULT_FIELD

    @cached_property
    def elements(self) -> np.ndarray:
        """The D field elements (centered representatives of :attr:`signed`)."""
        return self.field.encode_signed(self.signed)


@dataclass(frozen=True)
class DDGaussEncoder:
    """Client encoding and server decoding of KLS21 for vectors of length ``dim``.

    ``clip``: L2 bound c (real units); ``gamma``: granularity (real units per integer step);
    ``noise_std``: each client's noise standard deviation sigma in real units (integer-domain
    std sigma/gamma, 0 for no noise); ``beta``: conditional-rounding parameter in [0, 1);
    ``max_tries``: cap on rounding redraws.
    """

    dim: int
    clip: float
    gamma: float
    noise_std: float
    beta: float = DEFAULT_BETA
    max_tries: int = 100
    field: MersenneField = DEFAULT_FIELD

    def __post_init__(self) -> None:
        padded_dimension(self.dim)
        for name in ("clip", "gamma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"noise_std must be finite and >= 0, got {self.noise_std!r}")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")
        if self.max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {self.max_tries!r}")
        if self.l2_bound >= self.field.max_signed:
            raise ValueError(
                f"clip / gamma = {self.clip / self.gamma:.6g} gives integers beyond the field "
                f"(p = 2^{self.field.exponent} - 1); raise gamma"
            )

    @cached_property
    def padded_dim(self) -> int:
        return padded_dimension(self.dim)

    @property
    def scaled_noise_std(self) -> float:
        """sigma / gamma: the per-client discrete Gaussian's parameter in integer units."""
        return self.noise_std / self.gamma

    @cached_property
    def l2_bound(self) -> float:
        """Delta_2 (integer units): the L2 sensitivity of one client's rounded vector."""
        return rounding_norm_bound(self.clip / self.gamma, self.padded_dim, self.beta)

    @cached_property
    def l1_bound(self) -> float:
        """Delta_1 (integer units)."""
        return rounded_l1_bound(self.l2_bound, self.padded_dim)

    def signs(self, rotation_seed: int | np.random.SeedSequence) -> np.ndarray:
        return rotation_signs(self.padded_dim, rotation_seed)

    def quantise(
        self, x: np.ndarray, rotation_seed: int | np.random.SeedSequence, rng: np.random.Generator
    ) -> tuple[np.ndarray, int, bool]:
        """Steps 1-4: clip, rotate, scale, conditionally round; (int64 vector, tries, clipped)."""
        x = np.asarray(x, dtype=np.float64).ravel()
        if x.size != self.dim:
            raise ValueError(f"x has {x.size} coordinates; the encoder's dim={self.dim}")
        if not np.all(np.isfinite(x)):
            raise ValueError("x must be finite (found NaN or inf)")
        clipped = clip_l2(x, self.clip)
        scaled = rotate(clipped, self.signs(rotation_seed))
        scaled /= self.gamma
        rounded, tries = conditional_round(scaled, self.l2_bound, rng, self.max_tries)
        return rounded, tries, clipped is not x

    def encode(
        self,
        x: np.ndarray,
        rotation_seed: int | np.random.SeedSequence,
        rng: np.random.Generator,
        noise_rng=None,
        *,
        sampler: NoiseSampler | None = None,
    ) -> EncodedUpdate:
        """All five steps; rounding draws from ``rng``, noise from ``sampler`` with ``noise_rng``
        (default ``rng``; pass a :class:`fedsim.privacy.mechanisms.SecureRandom` for secure
        mode). ``sampler`` (:data:`NoiseSampler`) is required when ``noise_std > 0``; with no
        noise nothing is drawn."""
        if self.scaled_noise_std > 0 and not callable(sampler):
            raise ValueError(
                f"sampler={sampler!r} with noise_std={self.noise_std!r}; allowed: a discrete "
                "Gaussian sampler(count, sigma, rng), e.g. "
                "fedsim.privacy.mechanisms.discrete_gaussian"
            )
        rounded, tries, clipped = self.quantise(x, rotation_seed, rng)
        if self.scaled_noise_std > 0:
            noise = sampler(
                self.padded_dim, self.scaled_noise_std, rng if noise_rng is None else noise_rng
            )
            rounded += np.asarray(noise, dtype=np.int64)
        return EncodedUpdate(rounded, tries, clipped, self.field)

    def decode(self, total, rotation_seed: int | np.random.SeedSequence) -> np.ndarray:
        """The server's inverse for a modular sum of encodings: signed, times gamma, inverse
        rotation, unpadded; returns the (noisy) real sum, length ``dim``."""
        total = self.field.asarray(total, "total").ravel()
        if total.size != self.padded_dim:
            raise ValueError(f"total has {total.size} elements; padded_dim={self.padded_dim}")
        signed = self.field.decode_signed(total).astype(np.float64)
        return unrotate(signed * self.gamma, self.signs(rotation_seed), self.dim)

    def headroom_bits(
        self,
        count: int,
        bits: int | None = None,
        failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
    ) -> float:
        """Spare bits of the worst-case sum of ``count`` encodings in a ``bits``-bit signed range
        (default: the field's); raises ``ValueError`` with the budget when it can wrap."""
        return sum_headroom_bits(
            count,
            self.l2_bound,
            self.scaled_noise_std,
            self.padded_dim,
            bits=bits,
            field=self.field,
            failure_probability=failure_probability,
        )


def sum_headroom_bits(
    count: int,
    l2_bound: float,
    scaled_noise_std: float,
    padded_dim: int,
    *,
    bits: int | None = None,
    field: MersenneField = DEFAULT_FIELD,
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
) -> float:
    """Bits to spare before the sum of ``count`` encodings can wrap.

    Per coordinate |sum| <= count * Delta_2 + t, t the tail bound of the summed noise
    (a discrete Gaussian sum is sub-Gaussian with proxy count * (sigma/gamma)^2) over the
    ``padded_dim`` coordinates at ``failure_probability``. ``bits=None`` checks the field with
    ``field.sum_headroom_bits``; otherwise the signed range of Z_{2^bits} is [-2^(bits-1),
    2^(bits-1)).
    """
    noise = noise_tail_bound(math.sqrt(count) * scaled_noise_std, padded_dim, failure_probability)
    if bits is None or bits == field.exponent:
        return field.sum_headroom_bits(count, l2_bound, noise)
    if not isinstance(bits, int | np.integer) or not 2 <= bits <= 64:
        raise ValueError(f"bits must be an integer in [2, 64], got {bits!r}")
    limit = 2.0 ** (bits - 1) - 1
    worst = count * l2_bound + noise
    if worst > limit:
        raise ValueError(
            f"a sum of count={count} encodings with Delta_2={l2_bound:.6g} and noise bound "
            f"{noise:.6g} can reach {worst:.6g} > 2^{bits - 1} - 1 and would wrap mod 2^{bits}; "
            f"needs {math.log2(worst / limit):.2f} more bits (raise gamma or bits)"
        )
    return math.log2(limit / worst) if worst else math.inf


def choose_gamma(
    dim: int,
    count: int,
    clip: float,
    noise_std: float,
    bits: int = 61,
    *,
    beta: float = DEFAULT_BETA,
    margin_bits: float = 0.0,
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
    field: MersenneField = DEFAULT_FIELD,
) -> float:
    """The smallest granularity gamma (finest quantisation) for which the sum of ``count``
    encodings fits ``bits`` signed bits with ``margin_bits`` to spare.

    The worst-case sum count * Delta_2(clip/gamma) + tail(count, noise_std/gamma) decreases in
    gamma, so a bisection on log gamma finds the boundary; the result passes
    :func:`sum_headroom_bits` (with the field's own check when ``bits`` is its exponent).
    """
    padded = padded_dimension(dim)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count!r}")
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be finite and > 0, got {clip!r}")
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std!r}")
    if not isinstance(bits, int) or not 2 <= bits <= 64 or bits > field.exponent:
        raise ValueError(
            f"bits must be an integer in [2, {min(64, field.exponent)}] (the field holds "
            f"{field.exponent} bits), got {bits!r}"
        )

    def spare(gamma: float) -> float:
        try:
            return sum_headroom_bits(
                count,
                rounding_norm_bound(clip / gamma, padded, beta),
                noise_std / gamma,
                padded,
                bits=bits,
                field=field,
                failure_probability=failure_probability,
            )
        except ValueError:
            return -math.inf

    low, high = math.log(clip) - 200.0, math.log(clip) + 10.0
    if spare(math.exp(high)) < margin_bits:
        raise ValueError(
            f"even gamma = {math.exp(high):.3g} (clip={clip}) leaves no room: the rounding term "
            f"count * (1 + sqrt(D)/2) with count={count}, D={padded} alone needs more than "
            f"bits={bits}; raise bits or lower count"
        )
    for _ in range(200):
        mid = (low + high) / 2
        if spare(math.exp(mid)) >= margin_bits:
            high = mid
        else:
            low = mid
    return math.exp(high)
