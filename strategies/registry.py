"""Strategies by name, for configuration files: the list of every method's spec.

``build_strategy("fedadam", {"eta": 0.01}, ...)`` returns Flower's own ``FedAdam``
configured for the engine's participation model (see :mod:`strategies.plumbing.flower`); every other
name is built by its module's :class:`~strategies.spec.StrategySpec`. A new method is one
module exposing its spec and one line in :data:`SPECS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from flwr.serverapp.strategy import Strategy

from fedsim.config import ConfigError, require
from fedsim.privacy.sampling import Sampling
from strategies.methods import dmm, matrix_mechanism, pfedbayes, pfedhb, pfedvem
from strategies.methods.ddgauss import spec as ddgauss_spec
from strategies.methods.dp_fedavg import config as dp_fedavg_config
from strategies.methods.popri import spec as popri_spec
from strategies.methods.private_evolution import spec as private_evolution_spec
from strategies.plumbing import flower, personalised_config, secure_aggregation
from strategies.spec import RunFacts, StrategySpec

#: every method a run config can name
SPECS: tuple[StrategySpec, ...] = (
    *flower.SPECS,
    dp_fedavg_config.SPEC,
    matrix_mechanism.SPEC,
    dmm.SPEC,
    ddgauss_spec.SPEC,
    pfedhb.SPEC,
    pfedvem.SPEC,
    pfedbayes.SPEC,
    *personalised_config.SPECS,
    popri_spec.SPEC,
    private_evolution_spec.SPEC,
)
BY_NAME: dict[str, StrategySpec] = {spec.name: spec for spec in SPECS}
NAMES = tuple(BY_NAME)
#: the personalised methods (clients run make_personal_app; built by
#: :func:`build_personalised_strategy`)
PERSONALISED = tuple(spec.name for spec in SPECS if spec.personalised)
#: private strategies: their clients' metrics are not released in the clear by default
PRIVATE = tuple(spec.name for spec in SPECS if spec.private)
#: the synthetic-text methods (``[data] source = "text"``; built by :func:`build_text_strategy`)
TEXT = tuple(spec.name for spec in SPECS if spec.text)


def spec_for(name: str) -> StrategySpec:
    """The spec of ``strategy.name`` (a ConfigError naming the methods when unknown)."""
    known = isinstance(name, str) and name in BY_NAME
    require(known, "strategy.name", name, f"one of {', '.join(NAMES)}")
    return BY_NAME[name]


def build_strategy(
    name: str,
    options: Mapping[str, Any],
    *,
    expected_clients: float,
    evaluate_fraction: float,
    seed: int,
    partial_aggregation: Literal["auto", "on", "off"] = "auto",
    sampling: Sampling | None = None,
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
        rounds: the run's rounds (the matrix mechanisms' factorizations cover them).
        metrics_in_clear: central-DP strategies also return their clients' metrics and the
            exact clipped fraction, un-noised.
    """
    spec = spec_for(name)
    require(
        not spec.personalised,
        "strategy.name",
        name,
        "a strategy for build_strategy; personalised strategies are built by "
        "build_personalised_strategy (their clients run make_personal_app)",
    )
    require(
        not spec.text,
        "strategy.name",
        name,
        "a strategy for build_strategy; text methods are built by build_text_strategy "
        "(their data is a text federation)",
    )
    if partial_aggregation == "on":
        _check_worker_sums(spec, options)
    facts = run_facts(
        spec,
        expected_clients=expected_clients,
        evaluate_fraction=evaluate_fraction,
        seed=seed,
        partial_aggregation=partial_aggregation,
        sampling=sampling,
        population=population,
        rounds=rounds,
        metrics_in_clear=metrics_in_clear,
    )
    return spec.build(spec.read_options(options), facts)


def run_facts(
    spec: StrategySpec,
    *,
    expected_clients: float,
    evaluate_fraction: float,
    seed: int,
    partial_aggregation: str = "auto",
    sampling: Sampling | None = None,
    population: int | None = None,
    rounds: int | None = None,
    metrics_in_clear: bool = False,
) -> RunFacts:
    """The :class:`RunFacts` ``spec``'s builder is told (arguments as :func:`build_strategy`)."""
    return RunFacts(
        expected_clients=expected_clients,
        evaluate_fraction=min(1.0, evaluate_fraction),
        seed=seed,
        worker_reduction=spec.summable and partial_aggregation != "off",
        sampling=sampling,
        population=population,
        rounds=rounds,
        metrics_in_clear=metrics_in_clear,
    )


def build_text_strategy(
    name: str, options: Mapping[str, Any], text_source: Any, **facts: Any
) -> Strategy:
    """The text method ``name`` (one of :data:`TEXT`) with ``options`` over the federation
    ``text_source`` (a :class:`~fedsim.data.text.TextSourceSpec`); ``facts`` as
    :func:`build_strategy` takes them (its keyword arguments)."""
    from strategies.plumbing.text_method import TextRun  # noqa: PLC0415  (torch, transformers)

    require(name in TEXT, "strategy.name", name, f"one of {', '.join(TEXT)}")
    spec = BY_NAME[name]
    run = TextRun(run_facts(spec, **facts), text_source)
    return spec.build(spec.read_options(options), run)


def _check_worker_sums(spec: StrategySpec, options: Mapping[str, Any]) -> None:
    """``partial_aggregation = "on"`` needs a sum the workers may fold."""
    if not spec.summable:
        summable = ", ".join(s.name for s in SPECS if s.summable)
        raise ConfigError(
            "strategy.partial_aggregation",
            "on",
            f"'auto' or 'off' for {spec.name}, whose aggregation is not a sum "
            f"(worker-side sums work with {summable})",
        )
    if secure_aggregation.asks_secure_sum(options):
        raise ConfigError(
            "strategy.partial_aggregation",
            "on",
            "'auto' or 'off' with strategy.options.secure_sum (masked or sealed inputs are "
            "summed by the secure sum, never folded on workers)",
        )


def build_personalised_strategy(name: str, options: Mapping[str, Any], **cohort: Any) -> Strategy:
    """The personalised strategy ``name`` (one of :data:`PERSONALISED`) with ``options``;
    ``cohort`` as :func:`strategies.plumbing.personalised_config.from_options` takes it."""
    require(name in PERSONALISED, "strategy.name", name, f"one of {', '.join(PERSONALISED)}")
    spec = BY_NAME[name]
    return spec.build(spec.read_options(options), **cohort)
