"""Strategies by name, for configuration files.

``build_strategy("fedadam", {"eta": 0.01}, ...)`` returns Flower's own
``FedAdam`` configured for the engine's participation model: the engine draws
each phase's cohort and the strategy takes all of it (``fraction_train=1``), so
sampling is seeded and visible to the accountant. Options are the strategy
class's constructor arguments, checked against its signature.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

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
from fedsim.privacy import accounting
from fedsim.privacy.accounting import FullParticipation, MinSeparation, Sampling
from strategies import ddgauss, dmm, matrix_mechanism, personalised_config
from strategies.dp_fedavg import AdaptiveClipping, DPFedAvg, relation_for
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
#: wrappers adding client-level DP around FedAvg
DP: dict[str, Callable[..., Strategy]] = {"dp-fedavg": DPFedAvg}
#: central matrix-mechanism DP (DP-FTRL / BandMF), see strategies/matrix_mechanism.py
MATRIX = ("matrix-mechanism",)
#: distributed DP over secure aggregation: the distributed matrix mechanism over
#: committees (strategies/dmm.py) and the distributed discrete Gaussian over SecAgg+
#: (strategies/ddgauss.py); clients need their ``*_client_app`` wrappers
DISTRIBUTED = ("dmm", "ddgauss")
#: personalised Bayesian methods and their references ("module:Class"); their clients run
#: fedsim.workloads.personalised.make_personal_app and their options are read by
#: strategies.personalised_config.from_options (build them with
#: :func:`build_personalised_strategy`)
PERSONALISED = {
    "pfedhb": "strategies.pfedhb:PFedHB",
    "pfedvem": "strategies.pfedvem:PFedVEM",
    "pfedbayes": "strategies.pfedbayes:PFedBayes",
    "fedavg-ft": "strategies.personalised:FedAvgReference",
    "local-only": "strategies.personalised:LocalOnly",
}
NAMES = (*WEIGHTED_MEAN, *ROBUST, *DP, *MATRIX, *DISTRIBUTED, *PERSONALISED)
#: private strategies: their clients' metrics are not released in the clear by default
PRIVATE = (*DP, *MATRIX, *DISTRIBUTED)
_SET_BY_ENGINE = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)
_NOT_CONFIGURABLE = ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn")
_DP_REQUIRED = ("clipping_norm", "noise_multiplier")
_DP_ADAPTIVE = ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")
_DP_OPTIONS = (
    *_DP_REQUIRED,
    "adaptive_clipping",
    *_DP_ADAPTIVE,
    "delta",
    "accountant",
    "max_epsilon",
    "server_optimizer",
)


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
    sampling: Sampling | MinSeparation | None = None,
    population: int | None = None,
    rounds: int | None = None,
    metrics_in_clear: bool = False,
) -> Strategy:
    """The strategy ``name`` with ``options``, ready for the engine.

    Args:
        expected_clients: expected cohort size per round (DP noise divides by it).
        evaluate_fraction: share of each evaluation phase's available clients
            that evaluate (0: no federated evaluation).
        seed: the run seed (public streams only; a strategy's own noise comes from the
            server's secret, bound by the front end).
        partial_aggregation: "auto" uses worker-side sums when the strategy's
            aggregation is a sum; "on" requires it; "off" never.
        sampling: how the engine draws each round's clients, for DP accounting
            (None: full participation, which claims no amplification).
        population: registered clients (sets dp-fedavg's default delta).
        rounds: the run's rounds (the matrix mechanism's factorization covers them).
        metrics_in_clear: central-DP strategies also return their clients' metrics and the
            exact clipped fraction, un-noised.
    """
    require(name in NAMES, "strategy.name", name, f"one of {', '.join(NAMES)}")
    require(
        name not in PERSONALISED,
        "strategy.name",
        name,
        "a strategy for build_strategy; personalised strategies are built by "
        "build_personalised_strategy (their clients run make_personal_app)",
    )
    summable = name in WEIGHTED_MEAN or name in DP or name in MATRIX
    if partial_aggregation == "on" and not summable:
        raise ConfigError(
            "strategy.partial_aggregation",
            "on",
            f"'auto' or 'off' for {name}, whose aggregation is not a sum "
            f"(worker-side sums work with {', '.join((*WEIGHTED_MEAN, *DP, *MATRIX))})",
        )
    use_partial = summable and partial_aggregation != "off"
    evaluate_fraction = min(1.0, evaluate_fraction)
    if name in MATRIX:
        require(rounds is not None, "rounds", rounds, f"the run's rounds (required by {name})")
        separated = isinstance(sampling, MinSeparation)
        return matrix_mechanism.from_options(
            options,
            rounds=rounds,
            expected_clients=expected_clients,
            evaluate_fraction=evaluate_fraction,
            worker_reduction=use_partial,
            min_separation=sampling.min_separation if separated else None,
            max_participations=sampling.max_participations if separated else None,
            population=population,
            metrics_in_clear=metrics_in_clear,
        )
    if name == "ddgauss":
        try:
            return ddgauss.from_options(
                dict(options),
                expected_clients=expected_clients,
                seed=seed,
                evaluate_fraction=evaluate_fraction,
            )
        except ValueError as err:
            raise ConfigError("strategy.options", dict(options), str(err)) from err
    if name in DISTRIBUTED:
        require(rounds is not None, "rounds", rounds, f"the run's rounds (required by {name})")
        require(population is not None, "population", population, "the registered clients")
        separated = isinstance(sampling, MinSeparation)
        try:
            return dmm.from_options(
                dict(options),
                rounds=rounds,
                expected_clients=expected_clients,
                population=population,
                seed=seed,
                min_separation=sampling.min_separation if separated else None,
                max_participations=sampling.max_participations if separated else None,
                evaluate_fraction=evaluate_fraction,
            )
        except ValueError as err:
            raise ConfigError("strategy.options", dict(options), str(err)) from err
    if name in DP:
        return _dp_strategy(
            name,
            options,
            expected_clients=expected_clients,
            evaluate_fraction=evaluate_fraction,
            worker_reduction=use_partial,
            sampling=sampling,
            population=population,
            metrics_in_clear=metrics_in_clear,
        )
    strategy: Strategy = _flower_strategy(name, options, evaluate_fraction)
    return WorkerReduced(strategy) if use_partial else strategy


def build_personalised_strategy(name: str, options: Mapping[str, Any], **cohort: Any) -> Strategy:
    """The personalised strategy ``name`` (one of :data:`PERSONALISED`) with ``options``;
    ``cohort`` as :func:`strategies.personalised_config.from_options` takes it."""
    require(name in PERSONALISED, "strategy.name", name, f"one of {', '.join(PERSONALISED)}")
    return personalised_config.from_options(name, options, **cohort)


def _value(options: dict[str, Any], key: str, default: float | None) -> float | None:
    """Pop ``strategy.options.key`` as a finite number (``default`` when absent)."""
    value = options.pop(key, default)
    if value is None:
        return None
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"strategy.options.{key}",
        value,
        "a finite number",
    )
    return float(value)


def _number(
    options: dict[str, Any],
    key: str,
    default: float | None,
    ok: Callable[[float], bool],
    allowed: str,
) -> float:
    """Pop a required (or defaulted) number and check it with ``ok``."""
    value = _value(options, key, default)
    if value is None:
        raise ConfigError(f"strategy.options.{key}", None, f"{allowed} (required)")
    require(ok(value), f"strategy.options.{key}", value, allowed)
    return value


def _dp_strategy(
    name: str,
    options: Mapping[str, Any],
    *,
    expected_clients: float,
    evaluate_fraction: float,
    worker_reduction: bool,
    sampling: Sampling | MinSeparation | None,
    population: int | None,
    metrics_in_clear: bool,
) -> Strategy:
    """DP-FedAvg from ``strategy.options``.

    Options: ``clipping_norm`` and ``noise_multiplier`` (required);
    ``adaptive_clipping`` (false) with ``target_unclipped_quantile`` (0.5),
    ``clip_learning_rate`` (0.2) and ``clipped_count_stddev`` (clients per
    round / 20, Andrew et al. 2021's choice); ``delta`` (min(1e-5, 1 / population));
    ``accountant`` ("rdp" or "pld"); ``max_epsilon`` (none); ``server_optimizer``
    (a strategy of :data:`WEIGHTED_MEAN`, default "fedavg"). Every other option
    goes to the server optimiser (e.g. ``server_momentum``, ``eta``).
    """
    options = dict(options)
    for key in _DP_REQUIRED:
        if key not in options:
            raise ConfigError(f"strategy.options.{key}", None, f"a number (required by {name})")
    clipping_norm = _number(options, "clipping_norm", None, lambda v: v > 0, "a number > 0")
    z = _number(
        options,
        "noise_multiplier",
        None,
        lambda v: v == 0 or accounting.Z_MIN <= v <= accounting.Z_MAX,
        f"0 (no noise) or a number in [{accounting.Z_MIN:g}, {accounting.Z_MAX:g}] (noise std / "
        "clipping norm; below, dp_accounting's epsilon loses its precision)",
    )
    adaptive_on = options.pop("adaptive_clipping", False)
    require(
        isinstance(adaptive_on, bool),
        "strategy.options.adaptive_clipping",
        adaptive_on,
        "true or false",
    )
    adaptive = None
    if adaptive_on:
        require(
            z > 0,
            "strategy.options.noise_multiplier",
            z,
            "a number > 0 with adaptive_clipping = true (the clipped count is noised too)",
        )
        gamma = _number(
            options, "target_unclipped_quantile", 0.5, lambda v: 0 <= v <= 1, "a number in [0, 1]"
        )
        eta = _number(options, "clip_learning_rate", 0.2, lambda v: v > 0, "a number > 0")
        sigma_b = _number(
            options,
            "clipped_count_stddev",
            expected_clients / 20,
            lambda v: 2 * v > z,
            f"a number > noise_multiplier / 2 = {z / 2:g} (the default is "
            f"clients_per_round / 20 = {expected_clients / 20:g}; at or below z / 2 the "
            "clipped count alone would use the whole privacy budget)",
        )
        adaptive = AdaptiveClipping(
            target_unclipped_quantile=gamma, learning_rate=eta, count_stddev=sigma_b
        )
    else:
        for key in _DP_ADAPTIVE:
            if key in options:
                raise ConfigError(
                    f"strategy.options.{key}",
                    options[key],
                    "nothing unless strategy.options.adaptive_clipping = true",
                )
    default_delta = 1e-5 if population is None else min(1e-5, 1.0 / population)
    delta = _number(options, "delta", default_delta, lambda v: 0 < v < 1, "a number in (0, 1)")
    accountant = options.pop("accountant", "rdp")
    require(
        accountant in accounting.ACCOUNTANTS,
        "strategy.options.accountant",
        accountant,
        "one of 'rdp', 'pld'",
    )
    max_epsilon = _value(options, "max_epsilon", None)
    require(
        max_epsilon is None or max_epsilon > 0,
        "strategy.options.max_epsilon",
        max_epsilon,
        "a number > 0 (epsilon at which the run stops)",
    )
    optimizer = options.pop("server_optimizer", "fedavg")
    require(
        optimizer in WEIGHTED_MEAN,
        "strategy.options.server_optimizer",
        optimizer,
        f"one of {', '.join(WEIGHTED_MEAN)}",
    )
    sampling = FullParticipation() if sampling is None else sampling
    event_sampling = FullParticipation() if isinstance(sampling, MinSeparation) else sampling
    try:  # the accountant must support this participation model
        accounting.epsilon(1.0, event_sampling, 1, delta, accountant, relation_for(event_sampling))
    except ConfigError as err:
        raise ConfigError(
            "strategy.options.accountant",
            accountant,
            f"an accountant for {type(event_sampling).__name__} ({err.allowed})",
        ) from err
    inner = _flower_strategy(optimizer, options, evaluate_fraction)
    return DP[name](
        inner,
        clipping_norm=clipping_norm,
        noise_multiplier=z,
        expected_clients=expected_clients,
        worker_reduction=worker_reduction,
        adaptive=adaptive,
        sampling=sampling,
        delta=delta,
        accountant=accountant,
        max_epsilon=max_epsilon,
        metrics_in_clear=metrics_in_clear,
    )
