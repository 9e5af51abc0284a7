"""Layer-wise unbiased stochastic quantisation (QODA; Nguyen et al., ICML 2025).

For one layer ``v`` (any shape, flattened to ``d`` coordinates) and levels
``0 = l_0 < l_1 < ... < l_{s+1} = 1``, let ``u_i = |v_i| / ||v||_2`` and
``l_tau <= u_i < l_{tau+1}``. The quantiser rounds ``u_i`` up to ``l_{tau+1}``
with probability ``(u_i - l_tau) / (l_{tau+1} - l_tau)`` and down to ``l_tau``
otherwise, and returns ``Q(v)_i = ||v|| * sign(v_i) * q_i`` (the paper's
eq. for the layer-wise quantiser, generalising QSGD; Alistarh et al. 2017). It is
unbiased, ``E[Q(v)] = v``, with variance
``E||Q(v) - v||^2 = ||v||^2 * sum_i (l_{tau+1} - u_i)(u_i - l_tau)``, which for
uniform levels with ``n = s + 1`` intervals is at most
``min(d / n^2, sqrt(d) / n) * ||v||^2`` (QSGD's Lemma 3.1).

"Layer-wise" means each layer has its own norm and its own level sequence;
levels may be chosen per layer type (``weight`` for tensors of two or more
dimensions, ``bias`` for vectors and scalars) and adapted to the statistics of
``u`` by :func:`adapt_levels`, which minimises the variance above.

On the wire a layer is one float32 norm plus ``bits`` bits per coordinate: a
sign bit and a ``bits - 1``-bit level index, so ``bits`` allows
``2**(bits - 1) - 1`` intervals (``s = 2**(bits - 1) - 2`` interior levels).
:func:`encode` packs those codes into bytes and :func:`wire_bits` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedsim.config import require

NORM_BITS = 32  # one float32 norm per layer


def uniform_levels(intervals: int) -> np.ndarray:
    """QSGD's levels ``j / intervals`` for ``j = 0..intervals`` (float64)."""
    if intervals < 1:
        raise ValueError(f"intervals = {intervals!r} is not allowed: an integer >= 1")
    return np.arange(intervals + 1, dtype=np.float64) / intervals


def intervals_for_bits(bits: int) -> int:
    """Intervals a sign bit plus a ``bits - 1``-bit level index can address."""
    if not 2 <= bits <= 16:
        raise ValueError(f"bits = {bits!r} is not allowed: an integer in [2, 16]")
    return 2 ** (bits - 1) - 1


def check_levels(levels: np.ndarray, key: str = "levels") -> np.ndarray:
    """``levels`` as float64, after checking ``0 = l_0 < ... < l_{s+1} = 1``."""
    levels = np.asarray(levels, dtype=np.float64)
    if levels.ndim != 1 or len(levels) < 2:
        raise ValueError(f"{key} has shape {levels.shape}: a 1-D sequence of at least 2 levels")
    if levels[0] != 0.0 or levels[-1] != 1.0 or np.any(np.diff(levels) <= 0):
        raise ValueError(f"{key} = {levels.tolist()} is not allowed: 0 = l_0 < l_1 < ... = 1")
    return levels


def _bracket(u: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index ``tau`` with ``l_tau <= u < l_{tau+1}`` (``u = 1`` falls in the last interval)
    and the probability of rounding up."""
    tau = np.clip(np.searchsorted(levels, u, side="right") - 1, 0, len(levels) - 2)
    low, high = levels[tau], levels[tau + 1]
    return tau, (u - low) / (high - low)


@dataclass(frozen=True)
class QuantizedLayer:
    """One quantised layer: its norm, the signs and the level indices."""

    norm: np.float32
    signs: np.ndarray  # int8 in {-1, 0, +1}, flattened
    index: np.ndarray  # level index per coordinate (uint16), flattened
    levels: np.ndarray
    shape: tuple[int, ...]

    def value(self) -> np.ndarray:
        """``Q(v) = ||v|| * sign(v) * l[index]`` in the layer's shape (float32)."""
        q = float(self.norm) * self.signs * self.levels[self.index]
        return q.reshape(self.shape).astype(np.float32)


def quantize_with_uniforms(v: np.ndarray, levels: np.ndarray, r: np.ndarray) -> QuantizedLayer:
    """Quantise ``v`` with the uniform draws ``r`` in [0, 1) (one per coordinate).

    A coordinate rounds up when its draw is below its probability of rounding
    up; :func:`quantize` draws ``r`` from a generator.
    """
    levels = check_levels(levels)
    flat = np.asarray(v, dtype=np.float64).reshape(-1)
    r = np.asarray(r, dtype=np.float64).reshape(-1)
    if r.shape != flat.shape:
        raise ValueError(f"r has {r.size} draws for a layer of {flat.size} coordinates")
    norm = np.float32(np.linalg.norm(flat))
    if norm == 0:
        zeros = np.zeros(flat.size, np.int8)
        return QuantizedLayer(norm, zeros, zeros.astype(np.uint16), levels, np.shape(v))
    u = np.minimum(np.abs(flat) / float(norm), 1.0)
    tau, p_up = _bracket(u, levels)
    index = (tau + (r < p_up)).astype(np.uint16)
    signs = np.sign(flat).astype(np.int8)
    return QuantizedLayer(norm, signs, index, levels, np.shape(v))


def quantize(v: np.ndarray, levels: np.ndarray, rng: np.random.Generator) -> QuantizedLayer:
    """The unbiased stochastic quantiser ``Q(v)`` of one layer (module docstring)."""
    return quantize_with_uniforms(v, levels, rng.random(np.size(v)))


def variance(v: np.ndarray, levels: np.ndarray) -> float:
    """``E||Q(v) - v||^2 = ||v||^2 * sum_i (l_{tau+1} - u_i)(u_i - l_tau)`` (exact)."""
    levels = check_levels(levels)
    flat = np.asarray(v, dtype=np.float64).reshape(-1)
    norm = float(np.linalg.norm(flat))
    if norm == 0:
        return 0.0
    u = np.minimum(np.abs(flat) / norm, 1.0)
    tau, _ = _bracket(u, levels)
    return norm**2 * float(np.sum((levels[tau + 1] - u) * (u - levels[tau])))


def adapt_levels(u: np.ndarray, interior: int, sweeps: int = 20) -> np.ndarray:
    """Levels with ``interior`` interior points minimising ``sum_i (l_{tau+1}-u_i)(u_i-l_tau)``.

    Coordinate descent from uniform levels: with its neighbours ``a < c`` fixed,
    the cost of one level ``l`` is convex and piecewise linear in ``l`` with
    slope ``sum_{u<l}(u - a) - sum_{u>=l}(c - u)``, so its minimiser is the
    sample at which the slope turns non-negative. ``u`` are normalised
    magnitudes in [0, 1] (e.g. ``|v| / ||v||`` of recent updates of one layer type).
    """
    if interior < 0:
        raise ValueError(f"interior = {interior!r} is not allowed: an integer >= 0")
    u = np.sort(np.clip(np.asarray(u, dtype=np.float64).reshape(-1), 0.0, 1.0))
    levels = uniform_levels(interior + 1)
    for _ in range(sweeps):
        before = levels.copy()
        for j in range(1, interior + 1):
            a, c = levels[j - 1], levels[j + 1]
            lo, hi = np.searchsorted(u, a, side="right"), np.searchsorted(u, c, side="left")
            inside = u[lo:hi]
            if inside.size == 0:
                levels[j] = 0.5 * (a + c)
                continue
            below = np.concatenate([[0.0], np.cumsum(inside - a)])  # sum over the first m
            above = np.concatenate([np.cumsum((c - inside)[::-1])[::-1], [0.0]])  # over m..
            m = int(np.argmax(below - above >= 0))  # the slope on (u_{m-1}, u_m)
            best = inside[m - 1] if m >= 1 else a
            levels[j] = min(max(best, np.nextafter(a, 1.0)), np.nextafter(c, 0.0))
        if np.array_equal(levels, before):
            break
    return levels


def layer_type(name: str, shape: tuple[int, ...]) -> str:
    """``"weight"`` for tensors of two or more dimensions, ``"bias"`` otherwise."""
    return "weight" if len(shape) >= 2 else "bias"


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """Layer-wise quantisation of client uploads (``[client.compression]``).

    Attributes:
        bits: bits per coordinate (sign + level index), 2..16.
        bits_by_type: per layer type (``weight``/``bias``) overrides of ``bits``.
        levels: ``uniform`` (QSGD) or ``adaptive`` (fitted per layer type to the
            upload being sent by :func:`adapt_levels`; the levels then travel with
            it, 32 bits each).
        seed: root seed of the quantisation draws (per round and client).
    """

    bits: int = 4
    bits_by_type: Mapping[str, int] = field(default_factory=dict)
    levels: Literal["uniform", "adaptive"] = "uniform"
    seed: int = 0

    def __post_init__(self) -> None:
        require(2 <= self.bits <= 16, "client.compression.bits", self.bits, "an integer in [2, 16]")
        for kind, bits in self.bits_by_type.items():
            require(
                kind in ("weight", "bias"),
                "client.compression.bits_by_type",
                kind,
                "keys 'weight' or 'bias'",
            )
            require(
                2 <= bits <= 16,
                f"client.compression.bits_by_type.{kind}",
                bits,
                "an integer in [2, 16]",
            )
        require(
            self.levels in ("uniform", "adaptive"),
            "client.compression.levels",
            self.levels,
            "'uniform' or 'adaptive'",
        )

    def bits_of(self, kind: str) -> int:
        return int(self.bits_by_type.get(kind, self.bits))


def layer_levels(
    arrays: Mapping[str, np.ndarray],
    config: Quantization,
    kind_of: Callable[[str, tuple[int, ...]], str] = layer_type,
) -> dict[str, np.ndarray]:
    """One level sequence per layer type present in ``arrays``."""
    kinds = {kind_of(name, np.shape(a)) for name, a in arrays.items()}
    result = {}
    for kind in sorted(kinds):
        intervals = intervals_for_bits(config.bits_of(kind))
        if config.levels == "uniform":
            result[kind] = uniform_levels(intervals)
            continue
        u = [
            np.abs(a).reshape(-1) / max(float(np.linalg.norm(a)), np.finfo(np.float64).tiny)
            for name, a in arrays.items()
            if kind_of(name, np.shape(a)) == kind
        ]
        result[kind] = adapt_levels(np.concatenate(u), intervals - 1)
    return result


def encode(layer: QuantizedLayer, bits: int) -> np.ndarray:
    """The layer's codes (sign bit, then a ``bits - 1``-bit index) packed into bytes (uint8)."""
    limit = 2 ** (bits - 1) - 1
    if layer.index.size and int(layer.index.max()) > limit:
        raise ValueError(f"a level index exceeds {limit}, the most {bits} bits can carry")
    codes = (layer.signs < 0).astype(np.uint32) << (bits - 1) | layer.index.astype(np.uint32)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint32)
    bit_matrix = ((codes[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bit_matrix.reshape(-1))


def decode(
    packed: np.ndarray, norm: float, levels: np.ndarray, bits: int, shape: tuple[int, ...]
) -> np.ndarray:
    """The float32 layer that :func:`encode` packed (``Q(v)``, not ``v``)."""
    d = int(np.prod(shape, dtype=np.int64))
    bit_matrix = np.unpackbits(np.asarray(packed, np.uint8))[: d * bits].reshape(d, bits)
    weights = (1 << np.arange(bits - 1, -1, -1, dtype=np.uint32)).astype(np.uint32)
    codes = bit_matrix.astype(np.uint32) @ weights
    negative = codes >> (bits - 1)
    index = codes & ((1 << (bits - 1)) - 1)
    levels = check_levels(levels)
    if index.size and int(index.max()) >= len(levels):
        raise ValueError(f"a level index exceeds the {len(levels)} levels given")
    magnitude = float(norm) * levels[index]
    value = np.where(negative == 1, -magnitude, magnitude)
    return value.reshape(shape).astype(np.float32)


def wire_bits(sizes: Mapping[str, int], bits: Mapping[str, int], adapted_levels: int = 0) -> int:
    """Bits on the wire for layers of ``sizes`` coordinates at ``bits`` bits each:
    one float32 norm per layer, ``bits`` per coordinate, 32 per adapted level sent."""
    return sum(NORM_BITS + sizes[name] * bits[name] for name in sizes) + 32 * adapted_levels
