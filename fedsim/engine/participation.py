"""Which clients are available in each phase: the engine's participation model.

A Flower strategy samples its cohort from ``grid.get_node_ids()``. With a
participation model, the grid answers with the clients available in the current
phase instead of the whole population, so that (a) the cohort is drawn from a
seeded generator and the run is reproducible, (b) the sampling scheme is one a
privacy accountant understands (Poisson with rate q, or fixed size without
replacement), and (c) an unmodified strategy such as ``FedAvg(fraction_train=1)``
costs O(cohort) per round instead of O(population).

Each phase (one ``send_and_receive``, or one ``push_messages``) gets a fresh,
independent draw from ``default_rng([seed, phase])``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from fedsim.config import require


class Participation(ABC):
    """Draws the partition ids available in one phase."""

    num_clients: int

    @abstractmethod
    def cohort(self, phase: int) -> np.ndarray:
        """Sorted int64 partition ids available in ``phase`` (deterministic in the seed)."""


@dataclass(frozen=True, slots=True)
class FullParticipation(Participation):
    """Every client is available in every phase (Flower's default)."""

    num_clients: int

    def cohort(self, phase: int) -> np.ndarray:
        return np.arange(self.num_clients, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class UniformCohort(Participation):
    """``cohort_size`` clients drawn uniformly without replacement, O(cohort) per draw."""

    num_clients: int
    cohort_size: int
    seed: int

    def __post_init__(self) -> None:
        require(self.cohort_size >= 1, "cohort_size", self.cohort_size, "an integer >= 1")
        require(
            self.cohort_size <= self.num_clients,
            "cohort_size",
            self.cohort_size,
            f"at most the population size {self.num_clients}",
        )

    def cohort(self, phase: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, phase])
        return np.sort(rng.choice(self.num_clients, size=self.cohort_size, replace=False))


@dataclass(frozen=True, slots=True)
class PoissonCohort(Participation):
    """Each client independently with probability ``rate`` (Poisson sampling).

    Drawn as ``n ~ Binomial(N, rate)`` followed by a uniform ``n``-subset, which
    has exactly the distribution of independent Bernoulli(rate) inclusions and
    costs O(cohort) instead of O(N).
    """

    num_clients: int
    rate: float
    seed: int

    def __post_init__(self) -> None:
        require(0.0 < self.rate <= 1.0, "rate", self.rate, "a probability in (0, 1]")

    def cohort(self, phase: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, phase])
        size = int(rng.binomial(self.num_clients, self.rate))
        return np.sort(rng.choice(self.num_clients, size=size, replace=False))
