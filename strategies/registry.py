"""Strategies by name, for configuration files.

``build_strategy("fedadam", {"eta": 0.01}, ...)`` returns Flower's own
``FedAdam`` configured for the engine's participation model: the engine draws
each phase's cohort and the strategy takes all of it (``fraction_train=1``), so
sampling is seeded and visible to the accountant. Options are the strategy
class's constructor arguments, checked against its signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
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

from fedsim.config import ConfigError, require
from fedsim.engine.reduce import WorkerReduced
from strategies.dp_fedavg import DPFedAvg

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
#: wrappers adding client-level DP around FedAvg
DP: dict[str, Callable[..., Strategy]] = {"dp-fedavg": DPFedAvg}
NAMES = (*WEIGHTED_MEAN, *ROBUST, *DP)
_SET_BY_ENGINE = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)
_NOT_CONFIGURABLE = ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn")
_DP_OPTIONS = ("clipping_norm", "noise_multiplier")


def _flower_strategy(name: str, options: Mapping[str, Any], evaluate_fraction: float) -> FedAvg:
    cls = WEIGHTED_MEAN.get(name) or ROBUST[name]
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


def build_strategy(
    name: str,
    options: Mapping[str, Any],
    *,
    expected_clients: float,
    evaluate_fraction: float,
    seed: int,
    partial_aggregation: Literal["auto", "on", "off"] = "auto",
) -> Strategy:
    """The strategy ``name`` with ``options``, ready for the engine.

    Args:
        expected_clients: expected cohort size per round (DP noise divides by it).
        evaluate_fraction: share of each evaluation phase's available clients
            that evaluate (0: no federated evaluation).
        seed: root seed (the DP noise generator is ``default_rng([seed, 1])``).
        partial_aggregation: "auto" uses worker-side sums when the strategy's
            aggregation is a sum; "on" requires it; "off" never.
    """
    require(name in NAMES, "strategy.name", name, f"one of {', '.join(NAMES)}")
    summable = name in WEIGHTED_MEAN or name in DP
    if partial_aggregation == "on" and not summable:
        raise ConfigError(
            "strategy.partial_aggregation",
            "on",
            f"'auto' or 'off' for {name}, whose aggregation is not a sum "
            f"(worker-side sums work with {', '.join((*WEIGHTED_MEAN, *DP))})",
        )
    use_partial = summable and partial_aggregation != "off"
    evaluate_fraction = min(1.0, evaluate_fraction)
    if name in DP:
        options = dict(options)
        missing = [k for k in _DP_OPTIONS if k not in options]
        if missing:
            raise ConfigError(
                f"strategy.options.{missing[0]}", None, f"a number (required by {name})"
            )
        dp_args = {k: float(options.pop(k)) for k in _DP_OPTIONS}
        require(
            dp_args["clipping_norm"] > 0,
            "strategy.options.clipping_norm",
            dp_args["clipping_norm"],
            "a number > 0",
        )
        require(
            dp_args["noise_multiplier"] >= 0,
            "strategy.options.noise_multiplier",
            dp_args["noise_multiplier"],
            "a number >= 0",
        )
        inner = _flower_strategy("fedavg", options, evaluate_fraction)
        return DP[name](
            inner,
            expected_clients=expected_clients,
            rng=np.random.default_rng([seed, 1]),
            worker_reduction=use_partial,
            **dp_args,
        )
    strategy: Strategy = _flower_strategy(name, options, evaluate_fraction)
    return WorkerReduced(strategy) if use_partial else strategy
