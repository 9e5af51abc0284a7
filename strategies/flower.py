"""Flower's own strategies, configured for the engine's participation model.

The engine draws each phase's cohort and the strategy takes all of it (``fraction_train=1``),
so sampling is seeded and visible to the accountant. Options are the strategy class's
constructor arguments, checked against its signature. The weighted-mean family (FedAvg and
its server optimisers) is summable; the robust aggregators are not.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import (
    Bulyan,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    Strategy,
)

from fedsim.config import ConfigError
from strategies import secure_aggregation
from strategies.spec import RunFacts, StrategySpec
from strategies.worker_reduced import WorkerReduced

#: strategies whose aggregation is FedAvg's weighted mean (followed by a server update)
WEIGHTED_MEAN: dict[str, type[FedAvg]] = {
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
}
#: strategies with a non-linear aggregation (no worker-side sums)
ROBUST: dict[str, type[FedAvg]] = {
    "fedmedian": FedMedian,
    "fedtrimmedavg": FedTrimmedAvg,
    "krum": Krum,
    "multikrum": MultiKrum,
    "bulyan": Bulyan,
}
_SET_BY_ENGINE = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)
_NOT_CONFIGURABLE = ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn")


def flower_strategy(
    cls: type[FedAvg], options: Mapping[str, Any], evaluate_fraction: float
) -> FedAvg:
    """``cls`` with ``options`` (its constructor's arguments), over the engine's cohorts."""
    accepted = [
        p
        for p in inspect.signature(cls.__init__).parameters
        if p != "self" and p not in _NOT_CONFIGURABLE
    ]
    for key in options:
        if key in _SET_BY_ENGINE:
            raise ConfigError(
                f"strategy.options.{key}",
                options[key],
                "nothing: cohorts are set by strategy.clients_per_round and evaluation.clients",
            )
        if key not in accepted:
            allowed = ", ".join(p for p in accepted if p not in _SET_BY_ENGINE)
            raise ConfigError(
                f"strategy.options.{key}", options[key], f"an option of {cls.__name__}: {allowed}"
            )
    try:
        return cls(
            fraction_train=1.0,
            fraction_evaluate=evaluate_fraction,
            min_train_nodes=0,
            min_evaluate_nodes=0,
            min_available_nodes=0,
            **options,
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(
            "strategy.options", dict(options), f"valid {cls.__name__} arguments ({err})"
        ) from err


def _spec(name: str, cls: type[FedAvg], summable: bool) -> StrategySpec:
    def build(options: Mapping[str, Any], facts: RunFacts) -> Strategy:
        plain, secured = secure_aggregation.split_options(options)
        if secured and not summable:
            raise ConfigError(
                "strategy.options.secure_sum",
                secured.get("secure_sum"),
                f"unset for {name}, whose aggregation is not a sum (a secure sum works with "
                f"{', '.join(WEIGHTED_MEAN)})",
            )
        strategy = flower_strategy(cls, plain, facts.evaluate_fraction)
        if secured:  # the clients' weighted sum by a secure sum, never folded on workers
            return secure_aggregation.from_options(strategy, secured, facts)
        return WorkerReduced(strategy) if facts.worker_reduction else strategy

    proximal = issubclass(cls, FedProx)
    return StrategySpec(
        name=name,
        build=build,
        summable=summable,
        proximal=lambda options: proximal,
        secure_replies=secure_aggregation.asks_secure_sum,
        client_app_for=secure_aggregation.client_app_for,
    )


#: one spec per Flower strategy
SPECS: tuple[StrategySpec, ...] = (
    *(_spec(name, cls, True) for name, cls in WEIGHTED_MEAN.items()),
    *(_spec(name, cls, False) for name, cls in ROBUST.items()),
)


def server_optimizer(name: Any) -> type[FedAvg] | None:
    """The weighted-mean strategy ``name`` (a private strategy's server optimiser), else None."""
    return WEIGHTED_MEAN.get(name) if isinstance(name, str) else None
