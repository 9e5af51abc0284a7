"""Quantized Optimistic Dual Averaging (QODA; Nguyen et al., ICML 2025, Alg. 1) for min-max games.

``K`` workers each hold an operator ``A_k``; the game's operator is their mean
``A = (1/K) sum_k A_k`` and a solution is ``z*`` with ``A(z*) = 0`` (here
monotone, so ``z*`` is the equilibrium). Every worker sends its operator value
layer-wise quantised (:mod:`fedsim.workloads.compression`) and the server runs
optimistic dual averaging with the adaptive step::

    Z_{t+1/2} = Z_t - gamma_t * V_{t-1/2}                          (optimistic extrapolation)
    V_{t+1/2} = (1/K) sum_k Q_k(A_k(Z_{t+1/2}))                    (quantised uploads)
    Y_{t+1}   = Y_t - V_{t+1/2}                                    (dual accumulation)
    gamma_{t+1} = lr / sqrt(1 + sum_{s<=t} ||V_{s+1/2} - V_{s-1/2}||^2)
    Z_{t+1}   = Z_1 + gamma_{t+1} * Y_{t+1}

with ``V_{1/2} = 0`` and ``Y_1 = 0``. One exchange per step (the optimism
reuses the previous step's ``V``), which is what makes QODA cheaper than
extra-gradient. Without quantisation and with ``optimistic=False`` it is plain
dual averaging, which cycles on bilinear games.

The workload :class:`LinearGame` is the (strongly) monotone quadratic game
``min_x max_y mu/2 |x|^2 + x^T A y + b^T x - c^T y - mu/2 |y|^2`` split over workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedsim.workloads.compression import (
    Quantization,
    intervals_for_bits,
    layer_type,
    quantize,
    uniform_levels,
    wire_bits,
)

Point = dict[str, np.ndarray]
Operator = Callable[[Mapping[str, np.ndarray]], Point]


@dataclass(frozen=True)
class LinearGame:
    """``K`` workers' shares ``(A_k, b_k, c_k)`` of a quadratic game (module docstring).

    The operator of worker ``k`` at ``z = (x, y)`` is
    ``(mu x + A_k y + b_k, -A_k^T x + mu y + c_k)``; its Jacobian's symmetric
    part is ``mu I``, so the game is monotone (strongly if ``mu > 0``).
    """

    matrices: tuple[np.ndarray, ...]
    b: tuple[np.ndarray, ...]
    c: tuple[np.ndarray, ...]
    mu: float = 0.0

    def __post_init__(self) -> None:
        if not len(self.matrices) == len(self.b) == len(self.c) >= 1:
            raise ValueError(
                f"{len(self.matrices)} matrices, {len(self.b)} b and {len(self.c)} c: "
                "one of each per worker (at least one worker)"
            )
        if self.mu < 0:
            raise ValueError(f"mu = {self.mu!r} is not allowed: a number >= 0")

    @classmethod
    def random(
        cls, rng: np.random.Generator, n: int, m: int, workers: int, mu: float = 0.0, spread=0.5
    ) -> LinearGame:
        """Workers' matrices scattered (``spread``) around a shared ``A`` with
        singular values in [0.5, 1]."""
        left, _ = np.linalg.qr(rng.standard_normal((n, n)))
        right, _ = np.linalg.qr(rng.standard_normal((m, m)))
        core = np.zeros((n, m))
        k = min(n, m)
        core[np.arange(k), np.arange(k)] = rng.uniform(0.5, 1.0, k)
        shared = left @ core @ right.T
        noise = [spread * rng.standard_normal((n, m)) / np.sqrt(n + m) for _ in range(workers)]
        mean_noise = sum(noise) / workers
        matrices = tuple(shared + e - mean_noise for e in noise)
        b = tuple(rng.standard_normal(n) for _ in range(workers))
        c = tuple(rng.standard_normal(m) for _ in range(workers))
        return cls(matrices, b, c, mu)

    @property
    def workers(self) -> int:
        return len(self.matrices)

    def operator(self, k: int) -> Operator:
        a, b, c, mu = self.matrices[k], self.b[k], self.c[k], self.mu

        def value(z: Mapping[str, np.ndarray]) -> Point:
            x, y = z["x"], z["y"]
            return {"x": mu * x + a @ y + b, "y": -a.T @ x + mu * y + c}

        return value

    def equilibrium(self) -> Point:
        """The ``z*`` where the mean operator vanishes."""
        a = sum(self.matrices) / self.workers
        b, c = sum(self.b) / self.workers, sum(self.c) / self.workers
        n, m = a.shape
        jacobian = np.block([[self.mu * np.eye(n), a], [-a.T, self.mu * np.eye(m)]])
        z = np.linalg.solve(jacobian, -np.concatenate([b, c]))
        return {"x": z[:n], "y": z[n:]}


@dataclass(frozen=True)
class QODAResult:
    """Last iterate ``Z_{T+1}``, ergodic mean of ``Z_{t+1/2}``, and bits each worker sent."""

    last: Point
    average: Point
    bits_per_worker: int
    steps: int


def _mean_operator(
    operators: Sequence[Operator],
    point: Point,
    levels: dict[str, np.ndarray] | None,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """The workers' mean operator value at ``point``, each worker's sent exactly (float32;
    ``levels`` None) or quantised to the block's ``levels``."""
    value = {n: np.zeros_like(v) for n, v in point.items()}
    for op in operators:
        out = op(point)
        for n in value:
            if levels is None:
                value[n] += np.asarray(out[n], np.float32)
            else:
                value[n] += quantize(out[n], levels[n], rng).value()
    for n in value:
        value[n] /= len(operators)
    return value


def qoda(
    operators: Sequence[Operator],
    start: Mapping[str, np.ndarray],
    steps: int,
    *,
    lr: float,
    quantization: Quantization | None,
    rng: np.random.Generator,
    optimistic: bool = True,
    on_step: Callable[[int, Point, int], None] | None = None,
) -> QODAResult:
    """Run QODA (module docstring) for ``steps`` exchanges.

    ``quantization`` None sends exact float32 values (32 bits per coordinate).
    Each worker quantises each block of its operator value with its own norm
    and the levels of the block's type. ``on_step(t, Z_{t+1}, bits)``, if given,
    sees each step's iterate and the bits each worker has sent so far; it draws
    nothing, so the run is the same with or without it.
    """
    if steps < 1:
        raise ValueError(f"steps = {steps!r} is not allowed: an integer >= 1")
    if lr <= 0:
        raise ValueError(f"lr = {lr!r} is not allowed: a number > 0")
    if not operators:
        raise ValueError("operators is empty: give one operator per worker")
    origin = {name: np.asarray(v, np.float64).copy() for name, v in start.items()}
    sizes = {name: v.size for name, v in origin.items()}
    if quantization is None:
        levels, bits = {}, {name: 32 for name in origin}
        per_step = sum(32 * s for s in sizes.values())
    else:
        kinds = {name: layer_type(name, v.shape) for name, v in origin.items()}
        bits = {name: quantization.bits_of(kinds[name]) for name in origin}
        levels = {n: uniform_levels(intervals_for_bits(bits[n])) for n in origin}
        per_step = wire_bits(sizes, bits)
    z = {name: v.copy() for name, v in origin.items()}
    dual = {name: np.zeros_like(v) for name, v in origin.items()}
    previous = {name: np.zeros_like(v) for name, v in origin.items()}
    total = {name: np.zeros_like(v) for name, v in origin.items()}
    squares, gamma = 0.0, lr
    for step in range(1, steps + 1):
        half = {n: z[n] - gamma * previous[n] if optimistic else z[n].copy() for n in z}
        value = _mean_operator(operators, half, levels if quantization is not None else None, rng)
        for n in value:
            dual[n] -= value[n]
            total[n] += half[n]
        squares += sum(float(np.sum((value[n] - previous[n]) ** 2)) for n in value)
        gamma = lr / np.sqrt(1.0 + squares)
        z = {n: origin[n] + gamma * dual[n] for n in z}
        previous = value
        if on_step is not None:
            on_step(step, z, per_step * step)
    average = {n: v / steps for n, v in total.items()}
    return QODAResult(z, average, per_step * steps, steps)
