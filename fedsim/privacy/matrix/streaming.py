"""Streaming noise: the rows of ``G z`` (``G = C^{-1}``, or ``A^{-1} B`` for trees) one round at
a time, with bounded state.

Round t's fresh Gaussian noise is drawn from ``noise(t)`` only, a generator that depends on t
and nothing else (a strategy passes its party's secret stream,
``lambda t: secret.generator(t + 1, Purpose.NOISE, ...)``, see :mod:`fedsim.randomness`), so it
does not depend on how many rounds were drawn before: any round's fresh noise can be
regenerated on its own (:meth:`NoiseStream.fresh`), and a stream resumes at round t either from
:meth:`NoiseStream.state` (round counter plus buffers) or, storing nothing, by redrawing rounds
0..t-1 (:meth:`NoiseStream.advance_to`).

State held (``d`` = number of noise coordinates per round):

- :class:`BandedStream` -- ``bands - 1`` past outputs (forward substitution with a banded C);
- :class:`BLTStream` -- ``nbuf`` buffers (``s_i <- theta_i s_i + y``);
- :class:`TreeStream` -- at most ``floor(log2 n) + 1`` node estimates plus the last prefix;
- :class:`DenseStream` -- every past output (``O(t d)``; for dense / square-root C, whose
  inverse is dense).

:func:`noise_stream` picks the generator a :class:`Factorization`'s kind names
(:mod:`fedsim.privacy.matrix.kinds`). Outputs have unit
standard deviation per fresh coordinate; multiply by ``noise_multiplier * sens(C) * clip``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from fedsim.config import require
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.tree import nodes_completed_at

RoundNoise = Callable[[int], np.random.Generator]
"""``noise(t)``: the generator of round t's fresh noise (0-based), the same for the same t."""


class NoiseStream(ABC):
    """Base class: round counter, per-round fresh noise, state save / restore."""

    #: names of the ndarray attributes that make up the state
    _buffers: tuple[str, ...] = ()

    def __init__(self, n: int, noise: RoundNoise, shape: tuple[int, ...] | int) -> None:
        require(callable(noise), "noise", noise, "a function: round -> numpy Generator")
        self.n = int(n)
        self.noise = noise
        self.shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        self.round = 0

    def fresh(self, t: int, count: int = 1) -> np.ndarray:
        """The fresh noise of round t: ``count`` standard normal arrays of ``shape``."""
        rng = self.noise(int(t))
        require(
            isinstance(rng, np.random.Generator), "noise", rng, "a numpy.random.Generator"
        )
        return rng.standard_normal((count, *self.shape))

    def fresh_per_round(self, t: int) -> int:
        """How many fresh noise arrays round t draws (rows of z that belong to round t)."""
        return 1

    def next(self) -> np.ndarray:
        """The noise for round ``self.round`` (then advance)."""
        require(self.round < self.n, "round", self.round, f"a round < n = {self.n}")
        y = self._step(self.round)
        self.round += 1
        return y

    def advance_to(self, t: int) -> None:
        """Redraw rounds ``self.round .. t - 1`` so that :meth:`next` gives round t: how a
        stream resumes from its noise source alone, with nothing stored."""
        require(self.round <= t <= self.n, "round", t, f"a round in [{self.round}, {self.n}]")
        while self.round < t:
            self.next()

    @abstractmethod
    def _step(self, t: int) -> np.ndarray:
        """The noise of round ``t``, updating the buffers."""

    def state(self) -> dict[str, Any]:
        """A copy of the state (round counter and buffers)."""
        out: dict[str, Any] = {"round": self.round}
        for name in self._buffers:
            value = getattr(self, name)
            out[name] = [v.copy() for v in value] if isinstance(value, list) else value.copy()
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state` taken on a stream with the same parameters."""
        self.round = int(state["round"])
        for name in self._buffers:
            value = state[name]
            setattr(
                self, name, [v.copy() for v in value] if isinstance(value, list) else value.copy()
            )

    def state_size(self) -> int:
        """Number of float64 noise values held (constants of C excluded)."""
        total = 0
        for name in self._buffers:
            value = getattr(self, name)
            total += sum(v.size for v in value) if isinstance(value, list) else value.size
        return total


class BandedStream(NoiseStream):
    """``y = C^{-1} z`` for lower-triangular C with ``bands`` diagonals:
    ``y_t = (z_t - sum_{j=1}^{bands-1} C[t, t-j] y_{t-j}) / C[t, t]``."""

    _buffers = ("history",)

    def __init__(self, C: np.ndarray, bands: int, noise: RoundNoise, shape: Any) -> None:
        n = C.shape[0]
        super().__init__(n, noise, shape)
        self.bands = int(bands)
        # coefficients[t, j] = C[t, t - j] for j < bands (0 off the matrix)
        self.coefficients = np.zeros((n, self.bands))
        for j in range(self.bands):
            self.coefficients[j:, j] = np.diagonal(C, offset=-j)
        self.history = np.zeros((self.bands - 1, *self.shape))  # history[j-1] = y_{t-j}

    def _step(self, t: int) -> np.ndarray:
        z = self.fresh(t)[0]
        c = self.coefficients[t]
        y = (z - np.tensordot(c[1:], self.history, axes=1)) / c[0]
        if self.bands > 1:
            self.history = np.concatenate([y[None], self.history[:-1]])
        return y


class BLTStream(NoiseStream):
    """``y = C^{-1} z`` for a BLT C (``c_j = sum_i w_i theta_i^{j-1}``):
    ``y_t = z_t - sum_i w_i s_i``, then ``s_i <- theta_i s_i + y_t``."""

    _buffers = ("buffers",)

    def __init__(
        self, n: int, weights: np.ndarray, thetas: np.ndarray, noise: RoundNoise, shape: Any
    ) -> None:
        super().__init__(n, noise, shape)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.thetas = np.asarray(thetas, dtype=np.float64)
        self.buffers = np.zeros((self.weights.shape[0], *self.shape))

    def _step(self, t: int) -> np.ndarray:
        z = self.fresh(t)[0]
        y = z - np.tensordot(self.weights, self.buffers, axes=1)
        expand = (slice(None),) + (None,) * len(self.shape)
        self.buffers = self.thetas[expand] * self.buffers + y[None]
        return y


class TreeStream(NoiseStream):
    """Tree-aggregation noise in gradient space: ``y_t = p_t - p_{t-1}`` where ``p_t`` is the
    noise of the prefix estimate, the sum of the estimates of the nodes in the binary
    expansion of ``t + 1``. Round t draws one fresh value per node completing at t (leaf
    first); ``alphas`` are the per-height own-value weights (all 1: binary tree; Honaker's
    otherwise)."""

    _buffers = ("stack", "prefix")

    def __init__(self, n: int, alphas: np.ndarray, noise: RoundNoise, shape: Any) -> None:
        super().__init__(n, noise, shape)
        self.alphas = np.asarray(alphas, dtype=np.float64)
        # estimates of the nodes in the expansion of the rounds so far, lowest height last
        self.stack: list[np.ndarray] = []
        self.prefix = np.zeros(self.shape)

    def fresh_per_round(self, t: int) -> int:
        return nodes_completed_at(t)

    def _step(self, t: int) -> np.ndarray:
        count = nodes_completed_at(t)
        z = self.fresh(t, count)
        est = z[0]
        for h in range(1, count):
            # the node of height h ending at t: its left child is the stack's lowest node
            left = self.stack.pop()
            a = self.alphas[h]
            est = a * z[h] + (1.0 - a) * (left + est)
        self.stack.append(est)
        prefix = np.sum(self.stack, axis=0)
        y = prefix - self.prefix
        self.prefix = prefix
        return y


class DenseStream(NoiseStream):
    """``y = C^{-1} z`` for any lower-triangular C by forward substitution over all past
    outputs (state grows as ``t d``)."""

    _buffers = ("history",)

    def __init__(self, C: np.ndarray, noise: RoundNoise, shape: Any) -> None:
        super().__init__(C.shape[0], noise, shape)
        self.C = C
        self.history = np.zeros((0, *self.shape))

    def _step(self, t: int) -> np.ndarray:
        z = self.fresh(t)[0]
        row = self.C[t, :t]
        y = (z - np.tensordot(row, self.history, axes=1)) / self.C[t, t]
        self.history = np.concatenate([self.history, y[None]])
        return y


def noise_stream(
    factorization: Factorization, noise: RoundNoise, shape: tuple[int, ...] | int
) -> NoiseStream:
    """The bounded-state generator for ``factorization``'s noise, where one exists (its
    kind's, :mod:`fedsim.privacy.matrix.kinds`; a kind no family saves under: forward
    substitution over its C); round t's fresh noise comes from ``noise(t)``."""
    from fedsim.privacy.matrix.kinds import saved_kind  # noqa: PLC0415  (the kinds import this)

    kind = saved_kind(factorization.kind)
    if kind is None:
        return DenseStream(factorization.encoder, noise, shape)
    return kind.stream(factorization, noise, shape)


def dense_fresh_noise(stream: NoiseStream) -> np.ndarray:
    """All rounds' fresh noise stacked as the z of ``G z`` (rows in the order of C's rows)."""
    return np.concatenate([stream.fresh(t, stream.fresh_per_round(t)) for t in range(stream.n)])
