"""Which clients are available in each phase: the engine's participation model.

A Flower strategy samples its cohort from ``grid.get_node_ids()``. With a
participation model, the grid answers with the clients available in the current
phase instead of the whole population, so that (a) the cohort is drawn from a
seeded generator and the run is reproducible, (b) the sampling scheme is one a
privacy accountant understands (Poisson with rate q, fixed size without
replacement, or a fixed schedule with b-min-separation), and (c) an unmodified
strategy such as ``FedAvg(fraction_train=1)`` costs O(cohort) per round instead
of O(population).

A draw is keyed by ``(round, kind)``: kind 0 is training, 1 is evaluation.
fedsim's round loop declares each phase (:meth:`SimulationGrid.begin_phase`);
for a ServerApp whose loop fedsim does not see, the grid uses the number of the
phase (one per ``send_and_receive`` or ``push_messages``) as the round and 0 as
the kind. Every model costs O(cohort) time and memory per draw.

Whose draw a cohort is. Drawn from the public seed, every client (and anyone holding
config.json) recomputes each cohort: against that adversary no amplification by sampling
holds. A :class:`UniformCohort` or :class:`PoissonCohort` given the server's secret
(``secret``, a :class:`~fedsim.randomness.PartySecret`) draws from
``secret.generator(round, Purpose.COHORT, kind)`` instead: reproducible under the run's root,
unknown to the clients; :attr:`CohortModel.secret_draws` says which, and a DP strategy claims
amplification only for secret draws (:mod:`strategies.plumbing.observed_sampling`).

Each model also gives its accounting view (:meth:`CohortModel.accounting`): the sampling
model of :mod:`fedsim.privacy.sampling` that describes its training cohorts, so that the
cohorts drawn and the amplification claimed are one fact. The names of the models here say
*cohort*; the names ``FullParticipation`` and ``Participation`` belong to the privacy side
(:mod:`fedsim.privacy.sampling`, :mod:`fedsim.privacy.participation`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from math import gcd
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim.config import require
from fedsim.privacy.participation import Participation

if TYPE_CHECKING:  # dp_accounting loads when a run asks for its accounting, not with the grid
    from fedsim.privacy.sampling import (
        FixedSizeSampling,
        FullParticipation,
        PoissonSampling,
        Sampling,
    )

TRAIN, EVALUATE = 0, 1


class CohortModel(ABC):
    """Draws the partition ids available in one phase."""

    num_clients: int

    @property
    def secret_draws(self) -> bool:
        """Whether the cohorts come from the server's secret (else: the public seed)."""
        return getattr(self, "secret", None) is not None

    def _generator(self, server_round: int, kind: int) -> np.random.Generator:
        secret = getattr(self, "secret", None)
        if secret is not None:
            from fedsim.randomness import Purpose  # noqa: PLC0415

            return secret.generator(int(server_round), Purpose.COHORT, int(kind))
        return np.random.default_rng([self.seed, server_round, kind])

    @abstractmethod
    def cohort(self, server_round: int, kind: int = TRAIN) -> np.ndarray:
        """Sorted int64 partition ids available (deterministic in the seed)."""

    @abstractmethod
    def accounting(self, rounds: int) -> Sampling:
        """The privacy accountant's model of the training cohorts of a ``rounds``-round run
        (the amplification, if any, that these draws justify)."""


@dataclass(frozen=True, slots=True)
class FullCohort(CohortModel):
    """Every client is available in every phase (Flower's default)."""

    num_clients: int

    def cohort(self, server_round: int, kind: int = TRAIN) -> np.ndarray:
        return np.arange(self.num_clients, dtype=np.int64)

    def accounting(self, rounds: int) -> FullParticipation:
        """Every client in every round: no amplification claimed."""
        from fedsim.privacy.sampling import FullParticipation  # noqa: PLC0415

        return FullParticipation()


@dataclass(frozen=True, slots=True)
class UniformCohort(CohortModel):
    """``cohort_size`` clients drawn uniformly without replacement."""

    num_clients: int
    cohort_size: int
    seed: int
    #: the server's secret to draw from (None: the public seed)
    secret: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        require(self.cohort_size >= 1, "cohort_size", self.cohort_size, "an integer >= 1")
        require(
            self.cohort_size <= self.num_clients,
            "cohort_size",
            self.cohort_size,
            f"at most the population size {self.num_clients}",
        )

    def cohort(self, server_round: int, kind: int = TRAIN) -> np.ndarray:
        rng = self._generator(server_round, kind)
        return np.sort(rng.choice(self.num_clients, size=self.cohort_size, replace=False))

    def accounting(self, rounds: int) -> FixedSizeSampling:
        """Fixed-size sampling of ``cohort_size`` of ``num_clients`` without replacement."""
        from fedsim.privacy.sampling import FixedSizeSampling  # noqa: PLC0415

        return FixedSizeSampling(self.cohort_size, self.num_clients)


@dataclass(frozen=True, slots=True)
class PoissonCohort(CohortModel):
    """Each client independently with probability ``rate`` (Poisson sampling).

    Drawn as ``n ~ Binomial(N, rate)`` followed by a uniform ``n``-subset, which
    has exactly the distribution of independent Bernoulli(rate) inclusions and
    costs O(cohort) instead of O(N).
    """

    num_clients: int
    rate: float
    seed: int
    #: the server's secret to draw from (None: the public seed)
    secret: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        require(0.0 < self.rate <= 1.0, "rate", self.rate, "a probability in (0, 1]")

    def cohort(self, server_round: int, kind: int = TRAIN) -> np.ndarray:
        rng = self._generator(server_round, kind)
        size = int(rng.binomial(self.num_clients, self.rate))
        return np.sort(rng.choice(self.num_clients, size=size, replace=False))

    def accounting(self, rounds: int) -> PoissonSampling:
        """Poisson sampling at ``rate``."""
        from fedsim.privacy.sampling import PoissonSampling  # noqa: PLC0415

        return PoissonSampling(self.rate)


@dataclass(frozen=True, slots=True)
class MinSeparationCohort(CohortModel):
    """A fixed schedule in which a client trains at most once every ``b`` rounds.

    The population is split by a seeded permutation into ``b`` groups of equal
    size (up to one); training round ``r`` (1-based) uses group ``(r - 1) mod b``,
    so any two participations of a client are exactly ``b`` rounds apart and a
    client takes part in at most ``ceil(T / b)`` of ``T`` rounds: the
    b-min-separation participation of multi-epoch matrix factorisation
    (Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for
    Private Machine Learning", ICML 2023). The permutation is affine,
    ``pi(k) = (a k + c) mod N`` with ``a`` coprime to ``N``, so a group is listed
    in O(N / b) without storing anything per client. Evaluation phases draw a
    uniform cohort of the same size.
    """

    num_clients: int
    min_separation: int
    seed: int

    def __post_init__(self) -> None:
        require(
            1 <= self.min_separation <= self.num_clients,
            "min_separation",
            self.min_separation,
            f"an integer in [1, {self.num_clients}] (the population size)",
        )

    def _permutation(self) -> tuple[int, int]:
        rng = np.random.default_rng([self.seed, 0x5EED])
        n = self.num_clients
        while True:
            a = int(rng.integers(1, n)) if n > 1 else 1
            if gcd(a, n) == 1:
                return a, int(rng.integers(0, n))

    def group_size(self, group: int) -> int:
        n, b = self.num_clients, self.min_separation
        return n // b + (1 if group < n % b else 0)

    def cohort(self, server_round: int, kind: int = TRAIN) -> np.ndarray:
        n, b = self.num_clients, self.min_separation
        if kind != TRAIN:
            rng = np.random.default_rng([self.seed, server_round, kind])
            return np.sort(rng.choice(n, size=self.group_size(0), replace=False))
        group = (server_round - 1) % b
        a, c = self._permutation()
        positions = np.arange(group, n, b, dtype=np.int64)  # pi(k) in this group
        inverse = pow(a, -1, n) if n > 1 else 0
        return np.sort(((positions - c) % n * inverse) % n)

    def group_of(self, partition_id: int) -> int:
        """The group (0..b-1) of a client; it trains in rounds r with (r-1) mod b == group."""
        a, c = self._permutation()
        return ((a * partition_id + c) % self.num_clients) % self.min_separation

    def accounting(self, rounds: int) -> Participation:
        """b-min-separation with at most ``ceil(rounds / b)`` participations per client: the
        one :class:`~fedsim.privacy.participation.Participation` that the accountant, the
        matrix mechanism's sensitivity and the participation guard all read."""
        b = self.min_separation
        return Participation.separated(b, -(-rounds // b))


def secret_cohorts(model: CohortModel, secret: Any) -> CohortModel:
    """``model`` drawing from the server's ``secret`` (a
    :class:`~fedsim.randomness.PartySecret`); models without a secret draw (full cohorts,
    min-separation schedules, which amplify nothing) are returned as they are."""
    if isinstance(model, (UniformCohort, PoissonCohort)):
        return replace(model, secret=secret)
    return model
