"""The strategy of a ``fedsim run``: its cohort model and the configured strategy with the
server halves of the configured client methods (issue 28, point 5: registered, not an
if-ladder).

:func:`participation_for` gives the engine's cohort model for a config;
:func:`build_experiment_strategy` builds the strategy of ``[strategy]`` and wraps it, in the
order of :data:`SERVER_HALVES`, in the server half of each configured method (quantised
uploads, the registered client methods' own halves, online conformal evaluation, a
server-side average of the global models), then in the seeded sampling every ``fedsim run``
uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.serverapp.strategy import Strategy

from fedsim.config import require
from fedsim.data.spec import text_source
from fedsim.engine import FullCohort, MinSeparationCohort, PoissonCohort, UniformCohort
from fedsim.engine.participation import CohortModel, secret_cohorts
from fedsim.frontend.run_config import ExperimentConfig, is_personalised, is_text
from fedsim.frontend.text_run import build_text_run_strategy
from fedsim.randomness import PartySecret
from fedsim.workloads.supervised import server_methods
from strategies.methods.averaging import AveragedGlobalModel
from strategies.methods.conformal import ConformalEvaluation
from strategies.methods.quantized import DequantizedUploads
from strategies.plumbing.client_method_halves import ServerHalfStrategy
from strategies.plumbing.seeded_sampling import SeededSampling
from strategies.registry import build_personalised_strategy, build_strategy, spec_for


@dataclass(frozen=True)
class ServerHalf:
    """The server half of a client method: whether ``config`` uses the method, and the
    wrapper that adds it to a strategy."""

    used: Callable[[ExperimentConfig], bool]
    wrap: Callable[[Strategy, ExperimentConfig], Strategy]


#: method -> its server half, innermost wrapper first
SERVER_HALVES: dict[str, ServerHalf] = {
    "client.compression": ServerHalf(
        lambda config: config.client.compression is not None,
        lambda strategy, config: DequantizedUploads(strategy),
    ),
    "client methods": ServerHalf(
        lambda config: bool(server_methods(config.client)),
        lambda strategy, config: _with_method_halves(strategy, config),
    ),
    "evaluation.conformal": ServerHalf(
        lambda config: config.evaluation.conformal is not None,
        lambda strategy, config: ConformalEvaluation(strategy, config.evaluation.conformal),
    ),
    "strategy.averaging": ServerHalf(
        lambda config: config.strategy.averaging is not None,
        lambda strategy, config: AveragedGlobalModel(
            strategy, config.strategy.averaging, config.rounds
        ),
    ),
}


def _with_method_halves(strategy: Strategy, config: ExperimentConfig) -> Strategy:
    """``strategy`` wrapped in the server half of each configured client method that has one
    (:data:`fedsim.workloads.supervised.CLIENT_METHODS`, in their order)."""
    for method, table in server_methods(config.client):
        half = method.server(table, config.data.num_clients)
        strategy = ServerHalfStrategy(strategy, half)
    return strategy


def participation_for(
    config: ExperimentConfig, population: int, server: PartySecret | None = None
) -> CohortModel:
    """The engine's cohort model for this config (personalised strategies: the reporting
    clients' draw; every client stays reachable, see :func:`engine_participation`). A strategy
    whose epsilon credits amplification by sampling draws its uniform or Poisson cohorts from
    the server's own secret (``server``): cohorts recomputable from the public seed would let
    a client know the rounds it was in, against which no amplification holds."""
    k = config.strategy.clients_per_round
    if config.strategy.sampling == "poisson":
        model: CohortModel = PoissonCohort(population, k / population, config.seed)
    elif config.strategy.sampling == "min-separation":
        return MinSeparationCohort(population, max(1, round(population / k)), config.seed)
    else:
        model = UniformCohort(population, k, config.seed)
    if not spec_for(config.strategy.name).amplified_by_sampling:
        return model
    require(
        server is not None,
        "strategy.sampling",
        config.strategy.sampling,
        f"cohorts drawn from the server's secret for {config.strategy.name}, whose epsilon "
        "credits amplification by sampling (no server secret was given)",
    )
    return secret_cohorts(model, server)


def engine_participation(config: ExperimentConfig, participation: CohortModel) -> CohortModel:
    """Whom the grid offers each phase: everyone for a personalised strategy (it draws its
    reporting clients itself and, by default, every client personalises each round)."""
    if is_personalised(config):
        return FullCohort(participation.num_clients)
    return participation


def build_experiment_strategy(config: ExperimentConfig, participation: CohortModel) -> Strategy:
    """The configured strategy, with the server half of each configured client method
    (:data:`SERVER_HALVES`) and seeded sampling, for this participation model (a text
    method: :func:`fedsim.frontend.text_run.build_text_run_strategy`)."""
    k = config.strategy.clients_per_round
    if is_text(config):  # POPri, PE: over the text federation of [data]
        return build_text_run_strategy(config, participation, text_source(config.data))
    if is_personalised(config):
        personalised = build_personalised_strategy(
            config.strategy.name,
            config.strategy.options,
            clients_per_round=k,
            sampling=config.strategy.sampling,
            population=participation.num_clients,
            seed=config.seed,
            rounds=config.rounds,
            evaluate_every=config.evaluation.every,
            head_layers=config.model.head_layers,
        )
        return SeededSampling(personalised, config.seed)
    expected = participation.group_size(0) if isinstance(participation, MinSeparationCohort) else k
    # quantised uploads and client methods' reply records cannot be summed on workers
    unfolded = config.client.compression is not None or bool(server_methods(config.client))
    strategy = build_strategy(
        config.strategy.name,
        config.strategy.options,
        expected_clients=expected,
        evaluate_fraction=config.evaluation.clients / k + 1e-9
        if config.evaluation.clients
        else 0.0,
        seed=config.seed,
        partial_aggregation="off" if unfolded else config.strategy.partial_aggregation,
        sampling=participation.accounting(config.rounds),
        population=participation.num_clients,
        rounds=config.rounds,
        metrics_in_clear=config.privacy.metrics_in_clear,
    )
    for half in SERVER_HALVES.values():
        if half.used(config):
            strategy = half.wrap(strategy, config)
    return SeededSampling(strategy, config.seed)
