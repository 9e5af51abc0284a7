"""Flower's own strategies, configured for the engine's participation model.

The engine draws each phase's cohort and the strategy takes all of it (``fraction_train=1``),
so sampling is seeded and visible to the accountant. Options are the strategy class's
constructor arguments: a frozen dataclass made from its signature (types and Flower's
defaults), plus a secure sum's keys. The weighted-mean family (FedAvg and
its server optimisers) is summable; the robust aggregators are not.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
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

from fedsim.config import ConfigError, require
from strategies.plumbing import secure_aggregation
from strategies.plumbing.worker_reduced import WorkerReduced
from strategies.spec import RunFacts, StrategySpec

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
#: set by the engine's cohorts (strategy.clients_per_round, evaluation.clients), never options
_SET_BY_ENGINE = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)
#: the types a config value can take (callables such as Bulyan's selection_rule cannot)
_CONFIGURABLE = (bool, int, float, str)


def constructor_options(cls: type[FedAvg]) -> dict[str, tuple[type, Any]]:
    """``cls``'s configurable constructor arguments: name -> (type, Flower's default)."""
    hints = typing.get_type_hints(cls.__init__)
    return {
        p.name: (hints[p.name], p.default)
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name not in _SET_BY_ENGINE and hints.get(p.name) in _CONFIGURABLE
    }


def _options_type(cls: type[FedAvg]) -> type:
    """The frozen dataclass of ``cls``'s options: its constructor arguments (Flower's
    defaults) and a secure sum's
    (:class:`~strategies.plumbing.secure_aggregation.SecureSumOptions`)."""
    fields = [
        (name, tp, dataclasses.field(default=default))
        for name, (tp, default) in constructor_options(cls).items()
    ]
    options = dataclasses.make_dataclass(
        f"{cls.__name__}Options",
        fields,
        bases=(secure_aggregation.SecureSumOptions,),
        frozen=True,
    )
    options.__module__ = __name__
    options.__doc__ = f"``strategy.options`` of Flower's {cls.__name__} (its constructor's)."
    return options


def flower_strategy(
    cls: type[FedAvg], options: Mapping[str, Any], evaluate_fraction: float
) -> FedAvg:
    """``cls`` with ``options`` (checked constructor arguments), over the engine's cohorts."""
    try:
        return cls(
            fraction_train=1.0,
            fraction_evaluate=evaluate_fraction,
            min_train_nodes=0,
            min_evaluate_nodes=0,
            min_available_nodes=0,
            **options,
        )
    except ValueError as err:  # Flower's own range checks (e.g. FedTrimmedAvg's beta)
        key = next((k for k in options if f"`{k}`" in str(err)), None)
        raise ConfigError(
            f"strategy.options.{key}" if key else "strategy.options",
            options[key] if key else dict(options),
            f"valid {cls.__name__} arguments ({err})",
        ) from err


def _spec(name: str, cls: type[FedAvg], summable: bool) -> StrategySpec:
    options_type = _options_type(cls)
    own = tuple(constructor_options(cls))

    def build(options: Any, facts: RunFacts) -> Strategy:
        if options.secure_sum is not None and not summable:
            raise ConfigError(
                "strategy.options.secure_sum",
                options.secure_sum,
                f"unset for {name}, whose aggregation is not a sum (a secure sum works with "
                f"{', '.join(WEIGHTED_MEAN)})",
            )
        kwargs = {key: getattr(options, key) for key in own}
        strategy = flower_strategy(cls, kwargs, facts.evaluate_fraction)
        if options.secure_sum is not None:  # the weighted sum by a secure sum, never folded
            return secure_aggregation.from_options(strategy, options, facts)
        return WorkerReduced(strategy) if facts.worker_reduction else strategy

    proximal = issubclass(cls, FedProx)
    return StrategySpec(
        name=name,
        options=options_type,
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


def _optimizer_checks(self: Any) -> None:
    """``server_optimizer`` is a weighted-mean strategy that takes every option given."""
    cls = server_optimizer(self.server_optimizer)
    require(
        cls is not None,
        "strategy.options.server_optimizer",
        self.server_optimizer,
        f"one of {', '.join(WEIGHTED_MEAN)}",
    )
    accepted = constructor_options(cls)
    for key in _OPTIMIZER_KEYS:
        value = getattr(self, key)
        if value is not None and key not in accepted:
            raise ConfigError(
                f"strategy.options.{key}",
                value,
                f"an option of {cls.__name__}: {', '.join(accepted)}",
            )


def _optimizer_strategy(self: Any, evaluate_fraction: float) -> FedAvg:
    """The server optimiser with the options given (Flower's defaults for the others)."""
    kwargs = {k: getattr(self, k) for k in _OPTIMIZER_KEYS if getattr(self, k) is not None}
    return flower_strategy(WEIGHTED_MEAN[self.server_optimizer], kwargs, evaluate_fraction)


#: every weighted-mean strategy's constructor options (one type per name)
_OPTIMIZER_TYPES = {
    name: tp for cls in WEIGHTED_MEAN.values() for name, (tp, _) in constructor_options(cls).items()
}
_OPTIMIZER_KEYS = tuple(_OPTIMIZER_TYPES)
#: ``strategy.options`` of a private strategy's server optimiser: ``server_optimizer`` (a
#: weighted-mean strategy, "fedavg") and its constructor options (unset: Flower's default).
#: ``strategy(evaluate_fraction)`` builds it.
ServerOptimizerOptions = dataclasses.make_dataclass(
    "ServerOptimizerOptions",
    [
        ("server_optimizer", str, dataclasses.field(default="fedavg")),
        *((k, tp | None, dataclasses.field(default=None)) for k, tp in _OPTIMIZER_TYPES.items()),
    ],
    namespace={"__post_init__": _optimizer_checks, "strategy": _optimizer_strategy},
    frozen=True,
)
ServerOptimizerOptions.__module__ = __name__


def server_optimizer(name: Any) -> type[FedAvg] | None:
    """The weighted-mean strategy ``name`` (a private strategy's server optimiser), else None."""
    return WEIGHTED_MEAN.get(name) if isinstance(name, str) else None
