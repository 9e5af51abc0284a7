"""The sampling a DP strategy may account for inside a Flower app: the one that happens.

In a plain Flower ServerApp the wrapped strategy picks each round's nodes itself. Flower's
FedAvg family (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad: their
``configure_train`` is FedAvg's, Flower 1.42) takes ``m = max(int(N * fraction_train),
min_train_nodes)`` of the ``N`` nodes the grid offers with ``random.sample``: a cohort of
fixed size drawn uniformly without replacement, accounted as ``FixedSizeSampling(m, N)``
(all of them: ``FullParticipation``, no amplification). The draw is the strategy's own:
DPFedAvg takes the wrapped strategy's instructions and addresses them to ``m`` nodes it
draws from the server's secret stream (``Purpose.COHORT``), so neither a patched
``random.sample`` nor a seed every client knows decides who trains. Under fedsim's engine
with a cohort model (``fedsim flwr-run --sampling uniform|poisson``) the grid offers only
the engine's cohort; a strategy that takes all of it is accounted with that model
(:meth:`fedsim.engine.participation.CohortModel.accounting`: fixed-size or Poisson) when the
engine draws it from the server's secret; an engine cohort drawn from the public seed is
accounted without amplification (``public_cohorts``: each round an unsampled Gaussian for the
clients in it, composed over the rounds of the client that trained most).

:func:`planned_sampling` says, before a round, which model applies;
:meth:`SamplingPlan.check_round` checks every round's instructions against it before they
leave. What cannot be accounted is refused with a :class:`~fedsim.config.ConfigError` naming
what and why: a strategy whose own sampling is not Flower's uniform draw, a part of an
engine cohort, a min-separation schedule (its ledger and guard need ``sampling=`` before the
first round), nodes that change between rounds (then the population is unknown), a round
that sent other nodes than the model allows, and a sample Flower would wait for forever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM, FedProx, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt

from fedsim.config import ConfigError, require
from fedsim.engine.participation import CohortModel, FullCohort, MinSeparationCohort
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import (
    FixedSizeSampling,
    FullParticipation,
    PoissonSampling,
    Sampling,
)

#: ``configure_train`` implementations that draw with Flower's ``sample_nodes`` (uniform,
#: without replacement, ``max(int(N * fraction_train), min_train_nodes)`` nodes)
UNIFORM_SAMPLERS = frozenset(cls.configure_train for cls in (FedAvg, FedAvgM, FedOpt, FedProx))
KEY = "sampling"


def describe(sampling: Sampling) -> dict[str, Any]:
    """The sampling model as a privacy report shows it: its class and its fields (a
    :class:`~fedsim.privacy.participation.Participation` by the fields of its kind)."""
    if isinstance(sampling, Participation):
        fields = {
            "single": {},
            "min_sep": {
                "min_separation": sampling.min_sep,
                "max_participations": sampling.max_participations,
            },
            "fixed_epoch": {"epochs": sampling.epochs},
        }[sampling.kind]
        return {"model": "Participation", "kind": sampling.kind, **fields}
    return {"model": type(sampling).__name__, **dataclasses.asdict(sampling)}


@dataclass(frozen=True)
class SamplingPlan:
    """The accountant's model of every round, and what each round must send to fit it.

    Attributes:
        sampling: the model the ledger records.
        population: ``N``, the nodes the grid offered when the plan was made.
        fingerprint: ``(N, sum of their ids)``: the offered nodes of every round must match
            (a changing population cannot be accounted).
        engine_cohort: the grid offers the engine's cohort, and every offered node must be sent.
        sample_size: nodes each round sends (None: all that are offered).
        public_cohorts: the cohorts are recomputable from the public seed: ``sampling`` is
            then the unamplified model (FullParticipation) and the ledger composes the
            rounds of the client that trained most.
    """

    sampling: Sampling
    population: int
    fingerprint: tuple[int, int]
    engine_cohort: bool
    sample_size: int | None
    public_cohorts: bool = False

    def check_round(self, server_round: int, offered: Sequence[int], sent: Sequence[int]) -> None:
        """Refuse round ``server_round`` unless its instructions (to ``sent``, from the nodes
        ``offered``) are a draw of this plan."""
        where = f"{KEY} (round {server_round})"
        require(len(set(sent)) == len(sent), where, sorted(sent), "each node sent at most once")
        if not set(sent) <= set(offered):
            extra = sorted(set(sent) - set(offered))[:5]
            raise ConfigError(where, extra, "nodes the grid offered this round")
        if self.engine_cohort:
            require(
                len(sent) == len(offered),
                where,
                f"{len(sent)} of the engine's cohort of {len(offered)}",
                "every node of the engine's cohort (set fraction_train=1.0 and "
                "min_train_nodes=0: the engine draws the cohort the accountant assumes)",
            )
            return
        require(
            _fingerprint(offered) == self.fingerprint,
            where,
            f"{len(offered)} nodes offered",
            f"the {self.population} nodes of the first round (a population that changes "
            "between rounds cannot be accounted)",
        )
        require(
            len(sent) == self.sample_size,
            where,
            f"{len(sent)} nodes sent",
            f"{self.sample_size} nodes, the accounted {describe(self.sampling)}",
        )


def _fingerprint(nodes: Sequence[int]) -> tuple[int, int]:
    return len(nodes), sum(int(n) for n in nodes)


def planned_sampling(strategy: Strategy, grid: Grid) -> SamplingPlan:
    """The plan for ``strategy`` (the wrapped strategy, which samples) on ``grid`` (see the
    module docstring); a ConfigError when its sampling cannot be accounted."""
    offered = [int(n) for n in grid.get_node_ids()]
    participation = getattr(grid, "participation", None)
    if isinstance(participation, CohortModel) and not isinstance(participation, FullCohort):
        return _engine_plan(strategy, participation, offered)
    name = type(strategy).__name__
    if type(strategy).configure_train not in UNIFORM_SAMPLERS:
        raise ConfigError(
            KEY,
            None,
            f"a sampling the accountant can model: {name}'s configure_train is not Flower's "
            "uniform draw (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad); wrap one "
            "of those, or pass sampling= explicitly and draw exactly that",
        )
    n = len(offered)
    fraction = float(strategy.fraction_train)
    require(fraction > 0, f"{name}.fraction_train", fraction, "a fraction > 0 (a DP round trains)")
    size = max(int(n * fraction), int(strategy.min_train_nodes))
    wait = max(int(strategy.min_available_nodes), size)
    require(
        wait <= n,
        f"{name}.min_train_nodes / min_available_nodes",
        (strategy.min_train_nodes, strategy.min_available_nodes),
        f"at most the {n} nodes of the grid (Flower's sample_nodes would wait for {wait} "
        "forever)",
    )
    sampling = FullParticipation() if size == n else FixedSizeSampling(size, n)
    return SamplingPlan(sampling, n, _fingerprint(offered), False, size)


def _engine_plan(
    strategy: Strategy, participation: CohortModel, offered: list[int]
) -> SamplingPlan:
    """The engine's cohort model, for a strategy that takes every node it is offered."""
    if isinstance(participation, MinSeparationCohort):
        raise ConfigError(
            KEY,
            None,
            "an explicit sampling=Participation.separated(b, k) for a min-separation schedule (the "
            "ledger and its participation guard need it before the first round)",
        )
    settings = tuple(
        getattr(strategy, name, default)
        for name, default in (
            ("fraction_train", 1.0),
            ("min_train_nodes", 0),
            ("min_available_nodes", 0),
        )
    )
    require(
        settings == (1.0, 0, 0),
        f"{type(strategy).__name__}.fraction_train / min_train_nodes / min_available_nodes",
        settings,
        "1.0 / 0 / 0 under an engine cohort (the engine draws the cohort; Flower would "
        "subsample it, or wait forever when a cohort is smaller than its minimum)",
    )
    sampling = participation.accounting(1)
    require(
        isinstance(sampling, (FixedSizeSampling, PoissonSampling, FullParticipation)),
        KEY,
        sampling,
        "a fixed-size, Poisson or full cohort model",
    )
    public = not participation.secret_draws and not isinstance(sampling, FullParticipation)
    if public:  # every client recomputes the cohorts: no amplification holds
        sampling = FullParticipation()
    return SamplingPlan(
        sampling, participation.num_clients, _fingerprint(offered), True, None, public
    )
