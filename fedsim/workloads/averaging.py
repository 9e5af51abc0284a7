"""LAWA and EMA weight averaging (Ajroldi et al., ICML 2025; AlgoPerf).

Train the raw weights, evaluate (or upload) the averaged ones.

* **LAWA** keeps the last ``k`` checkpoints, taken every ``every`` steps once
  ``burn_in`` steps have passed, and returns their exact mean
  ``(1/k) * sum_{j<k} theta_{t-j}`` (fewer than ``k`` pushes: their mean). Each
  checkpoint counts ``1/k``: the mean is recomputed from the stored
  checkpoints, never seeded with a whole first checkpoint.
* **EMA** starts at the first pushed checkpoint and then
  ``theta_bar <- beta * theta_bar + (1 - beta) * theta``.

Defaults follow the paper: ``k = 10``, a checkpoint every 0.2 % of the step
budget after a 2 % burn-in (:meth:`Averaging.for_budget`). Both work on a
client (over its local steps) and on the server (over rounds;
``strategies.methods.averaging.AveragedGlobalModel``). Arrays are ``{name: ndarray}``;
averages are computed in float64 and returned in the pushed dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsim.config import ConfigError, from_mapping, require

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True, kw_only=True)
class Averaging:
    """Which average to keep (``[client.averaging]`` / ``[server.averaging]``).

    Attributes:
        kind: "lawa" or "ema".
        k: checkpoints in LAWA's window.
        beta: EMA's decay, in [0, 1).
        every: steps (rounds on the server) between checkpoints; 0: 0.2 % of
            the budget given to :meth:`for_budget` (at least 1).
        burn_in: steps before the first checkpoint; -1: 2 % of the budget.
    """

    kind: Literal["lawa", "ema"] = "lawa"
    k: int = 10
    beta: float = 0.99
    every: int = 0
    burn_in: int = -1

    def __post_init__(self) -> None:
        require(self.kind in ("lawa", "ema"), "averaging.kind", self.kind, "'lawa' or 'ema'")
        require(self.k >= 1, "averaging.k", self.k, "an integer >= 1")
        require(0 <= self.beta < 1, "averaging.beta", self.beta, "a number in [0, 1)")
        require(self.every >= 0, "averaging.every", self.every, "an integer >= 0 (0: 0.2 %)")
        require(self.burn_in >= -1, "averaging.burn_in", self.burn_in, "an integer >= 0 (-1: 2 %)")

    @classmethod
    def from_table(cls, table: Mapping[str, object], key: str) -> Averaging:
        """Build from a config table at ``key`` (``client.averaging`` or
        ``strategy.averaging``); errors name the full key."""
        try:
            return from_mapping(cls, dict(table), key)
        except ConfigError as err:
            if not err.key.startswith("averaging."):
                raise
            raise ConfigError(key + err.key[len("averaging") :], err.value, err.allowed) from None

    def for_budget(self, steps: int) -> Averager:
        """An averager for a run of ``steps`` steps (defaults resolved against it)."""
        if steps < 1:
            raise ValueError(f"steps = {steps!r} is not allowed: an integer >= 1")
        every = self.every or max(1, round(0.002 * steps))
        burn_in = self.burn_in if self.burn_in >= 0 else round(0.02 * steps)
        if self.kind == "lawa":
            return LAWA(self.k, every=every, burn_in=burn_in)
        return EMA(self.beta, every=every, burn_in=burn_in)


class Averager(ABC):
    """Pushes checkpoints on a schedule; subclasses define the average."""

    def __init__(self, every: int, burn_in: int) -> None:
        if every < 1:
            raise ValueError(f"every = {every!r} is not allowed: an integer >= 1")
        if burn_in < 0:
            raise ValueError(f"burn_in = {burn_in!r} is not allowed: an integer >= 0")
        self.every, self.burn_in = every, burn_in
        self.pushes = 0

    def due(self, step: int) -> bool:
        """Whether ``step`` (1-based count of steps taken) is a checkpoint step."""
        return step >= max(self.burn_in, 1) and (step - self.burn_in) % self.every == 0

    def observe(self, step: int, arrays: Arrays) -> bool:
        """Push ``arrays`` if ``step`` is due; returns whether it was pushed."""
        if not self.due(step):
            return False
        self.push(arrays)
        return True

    @abstractmethod
    def push(self, arrays: Arrays) -> None:
        """Add one checkpoint to the average."""

    @abstractmethod
    def average(self) -> dict[str, np.ndarray]:
        """The current average of the pushed checkpoints."""

    @property
    def ready(self) -> bool:
        return self.pushes > 0

    def average_or(self, arrays: Arrays) -> dict[str, np.ndarray]:
        """The average, or ``arrays`` themselves before the first push."""
        return self.average() if self.ready else {n: np.asarray(a) for n, a in arrays.items()}


def _copy(arrays: Arrays) -> dict[str, np.ndarray]:
    return {name: np.array(a, copy=True) for name, a in arrays.items()}


class LAWA(Averager):
    """Mean of the last ``k`` checkpoints (module docstring)."""

    def __init__(self, k: int = 10, *, every: int = 1, burn_in: int = 0) -> None:
        if k < 1:
            raise ValueError(f"k = {k!r} is not allowed: an integer >= 1")
        super().__init__(every, burn_in)
        self.k = k
        self.window: deque[dict[str, np.ndarray]] = deque(maxlen=k)

    def push(self, arrays: Arrays) -> None:
        if self.window and set(arrays) != set(self.window[0]):
            raise ValueError(f"pushed layers {sorted(arrays)} differ from {sorted(self.window[0])}")
        self.window.append(_copy(arrays))
        self.pushes += 1

    def average(self) -> dict[str, np.ndarray]:
        if not self.window:
            raise RuntimeError("LAWA has no checkpoint yet: push one before averaging")
        first = self.window[0]
        return {
            name: np.mean(np.stack([c[name] for c in self.window]), axis=0, dtype=np.float64)
            .astype(first[name].dtype, copy=False)
            .reshape(np.shape(first[name]))
            for name in first
        }


class EMA(Averager):
    """Exponential moving average from the first checkpoint (module docstring)."""

    def __init__(self, beta: float = 0.99, *, every: int = 1, burn_in: int = 0) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"beta = {beta!r} is not allowed: a number in [0, 1)")
        super().__init__(every, burn_in)
        self.beta = beta
        self._mean: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}

    def push(self, arrays: Arrays) -> None:
        if not self._mean:
            self._mean = {n: np.array(a, dtype=np.float64) for n, a in arrays.items()}
            self._dtypes = {n: np.asarray(a).dtype for n, a in arrays.items()}
        else:
            if set(arrays) != set(self._mean):
                raise ValueError(f"pushed layers {sorted(arrays)} differ from {sorted(self._mean)}")
            for name, a in arrays.items():
                mean = self._mean[name]
                mean *= self.beta
                mean += (1.0 - self.beta) * np.asarray(a, dtype=np.float64)
        self.pushes += 1

    def average(self) -> dict[str, np.ndarray]:
        if not self._mean:
            raise RuntimeError("EMA has no checkpoint yet: push one before averaging")
        return {n: m.astype(self._dtypes[n]) for n, m in self._mean.items()}
