"""Neighbouring relations and the sampling models of federated rounds.

A round's participants are Poisson sampled (Mironov, Talwar & Zhang 2019), a fixed-size sample
without replacement (Wang, Balle & Kasiviswanathan 2019, Thm. 27), everyone, or chosen under
b-min-separation with at most k participations (Choquette-Choo et al. 2023), the
:class:`~fedsim.privacy.participation.Participation` every other layer reads too. The accountant
(:mod:`fedsim.privacy.accountant`) reads which combinations dp_accounting supports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa

from fedsim.config import ConfigError, require
from fedsim.privacy.participation import Participation


def is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


class NeighbouringRelation(enum.StrEnum):
    """Which datasets are neighbours: one participant added/removed, or one replaced."""

    ADD_REMOVE = "add_remove"
    REPLACE_ONE = "replace_one"

    @property
    def dp_accounting(self) -> dpa.NeighboringRelation:
        """The matching ``dp_accounting.NeighboringRelation``."""
        if self is NeighbouringRelation.ADD_REMOVE:
            return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        return dpa.NeighboringRelation.REPLACE_ONE

    @classmethod
    def parse(cls, value: Any, key: str = "relation") -> NeighbouringRelation:
        """``value`` as a relation (an instance or its string), else :class:`ConfigError`."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.value:
                return member
        raise ConfigError(key, value, "one of 'add_remove', 'replace_one'")


@dataclass(frozen=True, slots=True)
class PoissonSampling:
    """Each client takes part in each round independently with probability ``rate`` in (0, 1].

    Privacy amplification by Poisson subsampling (Mironov, Talwar & Zhang 2019; Zhu & Wang
    2019) for add/remove neighbours. ``rate == 1`` is full participation.
    """

    rate: float

    def __post_init__(self) -> None:
        require(
            is_number(self.rate) and 0 < self.rate <= 1,
            "rate",
            self.rate,
            "a sampling rate q in (0, 1]",
        )


@dataclass(frozen=True, slots=True)
class FixedSizeSampling:
    """Each round takes ``sample_size`` of ``population`` clients uniformly without replacement.

    Accounted with ``SampledWithoutReplacementDpEvent`` (Wang, Balle & Kasiviswanathan 2019,
    Thm. 27), which dp_accounting's RDP accountant supports only for replace-one neighbours
    (the population size is public). ``sample_size == population`` is full participation.
    """

    sample_size: int
    population: int

    def __post_init__(self) -> None:
        require(
            is_int(self.population) and self.population >= 1,
            "population",
            self.population,
            "an integer >= 1",
        )
        require(
            is_int(self.sample_size) and 1 <= self.sample_size <= self.population,
            "sample_size",
            self.sample_size,
            f"an integer in [1, {self.population}]",
        )


@dataclass(frozen=True, slots=True)
class FullParticipation:
    """Every client takes part in every round: no amplification."""


#: The accountant's models of a run's cohorts. A
#: :class:`~fedsim.privacy.participation.Participation` (b-min-separation, single or
#: fixed-epoch) is a deterministic schedule without subsampling: a client is seen by at most
#: ``participations(rounds)`` rounds, each one Gaussian event.
Sampling = PoissonSampling | FixedSizeSampling | FullParticipation | Participation
SAMPLINGS = (PoissonSampling, FixedSizeSampling, FullParticipation, Participation)


def relation_for(sampling: Sampling) -> NeighbouringRelation:
    """The neighbouring relation a run with ``sampling`` is accounted under.

    Fixed-size sampling of fewer than all clients is amplified by dp_accounting
    only under replace-one neighbours; everything else uses add/remove.
    """
    if isinstance(sampling, FixedSizeSampling) and sampling.sample_size < sampling.population:
        return NeighbouringRelation.REPLACE_ONE
    return NeighbouringRelation.ADD_REMOVE


def check_delta(value: Any, key: str = "delta") -> float:
    """``value`` as a delta in (0, 1), else :class:`ConfigError` naming ``key``."""
    require(is_number(value) and 0 < value < 1, key, value, "a number in (0, 1)")
    return float(value)


def check_rounds(value: Any, key: str = "rounds", minimum: int = 0) -> int:
    """``value`` as a round count ``>= minimum``, else :class:`ConfigError` naming ``key``."""
    require(is_int(value) and value >= minimum, key, value, f"an integer >= {minimum}")
    return value


def check_sampling(value: Any, key: str = "sampling") -> Sampling:
    """``value`` if it is one of the sampling models, else :class:`ConfigError`."""
    require(
        isinstance(value, SAMPLINGS),
        key,
        value,
        "PoissonSampling, FixedSizeSampling, FullParticipation or Participation",
    )
    return value
