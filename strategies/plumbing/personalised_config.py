"""The personalised strategies from a run config's ``[strategy]`` table.

``[strategy] name`` is a personalised method (each method's module builds its
:class:`~strategies.spec.StrategySpec` with :func:`personalised_spec`; FedAvg + fine-tuning
and local-only, the reference baselines, are :data:`SPECS` here); ``clients_per_round`` is
the number of *reporting* clients (those whose posteriors update the server), drawn each round as
``sampling = "poisson"`` (Binomial(N, k / N), at least ``min_clients``: the reference
sampler) or ``"uniform"`` (exactly k). ``[strategy.options]`` holds the method's own keys:

* every method but local-only: ``min_clients`` (2); pfedhb, pfedvem and pfedbayes also
  ``schedule`` ("all": every client personalises each round, the reference schedule; or
  "sampled": only the reporting clients train);
* pfedhb: the fields of :class:`strategies.methods.pfedhb.HBConfig` (``server_solver``,
  ``server_steps``, ``server_lr``, ``server_milestones``, ``server_gamma``, ``hyperprior``,
  ``lam_mu``, ``lam_sigma``, ``nig`` (a table: ``m0``, ``kappa0``, ``a0``, ``b0``),
  ``head_variance``, ``body_variance``, ``head_weighting``, ``iterations``,
  ``body_bayesian``); the head/body split comes from ``[model] head_layers``;
* pfedvem: ``beta`` (server momentum of the body, 0);
* fedavg-ft: ``finetune_epochs`` (epochs each client fine-tunes the global model before
  it evaluates, 1); only the reporting clients train;
* pfedbayes, local-only: nothing else.

Each method's options are a frozen dataclass (:class:`NoOptions` and its subclasses, the
method's spec's ``options``) read by :func:`fedsim.config.from_mapping`. Errors name the key
as ``strategy.options.<key>``, with its value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fedsim.config import ConfigError, require
from strategies.plumbing.personalised import (
    Cohorts,
    FedAvgReference,
    LocalOnly,
    PersonalisedStrategy,
)
from strategies.spec import StrategySpec

_WHERE = "strategy.options"


@dataclass(frozen=True)
class NoOptions:
    """``strategy.options`` of a method with none (local-only): the cohorts' defaults."""

    def cohort(self) -> dict[str, Any]:
        """The :class:`~strategies.plumbing.personalised.Cohorts` settings these options give."""
        return {}


@dataclass(frozen=True)
class MinClients(NoOptions):
    """``min_clients``: at least this many clients report each round."""

    min_clients: int = Cohorts.min_clients

    def cohort(self) -> dict[str, Any]:
        return {"min_clients": self.min_clients}


@dataclass(frozen=True)
class ScheduledOptions(MinClients):
    """``min_clients`` and ``schedule`` ("all" or "sampled", checked by
    :class:`~strategies.plumbing.personalised.Cohorts`)."""

    schedule: str = Cohorts.schedule

    def cohort(self) -> dict[str, Any]:
        return {**super().cohort(), "schedule": self.schedule}


@dataclass(frozen=True)
class FedAvgFTOptions(MinClients):
    """fedavg-ft: ``min_clients`` and ``finetune_epochs`` (1)."""

    finetune_epochs: int = 1


#: ``make(options, cohorts, head_layers)``: the method from its options
Make = Callable[[Any, Cohorts, int], PersonalisedStrategy]


def personalised_spec(
    name: str,
    options: type[NoOptions],
    make: Make,
    *,
    schedule: Literal["all", "sampled"] = "all",
) -> StrategySpec:
    """The spec of the personalised method ``name``: its ``strategy.options`` type
    ``options`` (a :class:`NoOptions`), ``make`` building it and its default ``schedule``."""

    def build(opts: NoOptions, **cohort: Any) -> PersonalisedStrategy:
        return from_options(name, make, opts, schedule=schedule, **cohort)

    return StrategySpec(name=name, options=options, build=build, personalised=True)


def from_options(
    name: str,
    make: Make,
    options: NoOptions,
    *,
    schedule: Literal["all", "sampled"],
    clients_per_round: int,
    sampling: Literal["poisson", "uniform"],
    population: int,
    seed: int,
    rounds: int,
    evaluate_every: int,
    head_layers: int,
) -> PersonalisedStrategy:
    """The personalised method ``name`` configured by ``options``.

    Args:
        clients_per_round, sampling: reporting clients per round and how they are drawn.
        population: registered clients (all of them are reachable every round).
        seed: the run seed (the reporting clients are a public stream of it).
        rounds, evaluate_every: every client evaluates every ``evaluate_every`` rounds and
            in the last round (0: only in the last).
        head_layers: the model's personal head (last linear layers).
    """
    require(
        sampling in ("poisson", "uniform"),
        "strategy.sampling",
        sampling,
        "'poisson' (Binomial, the reference sampler) or 'uniform' with a personalised strategy",
    )
    try:
        cohorts = Cohorts(
            **{"schedule": schedule, **options.cohort()},
            fraction=clients_per_round / population,
            sampling="binomial" if sampling == "poisson" else "fixed",
            evaluate_every=evaluate_every,
            num_rounds=rounds,
            seed=seed,
        )
        return make(options, cohorts, head_layers)
    except ConfigError as err:  # the classes' own checks name their arguments
        if err.key.startswith("model."):
            raise
        key = err.key
        for prefix in (f"{name}.", "clients.", f"{_WHERE}."):
            if key.startswith(prefix):
                key = key[len(prefix) :]
        raise ConfigError(f"{_WHERE}.{key}", err.value, err.allowed) from err


def _fedavg_ft(opts: FedAvgFTOptions, cohorts: Cohorts, head_layers: int) -> FedAvgReference:
    return FedAvgReference(cohorts, finetune_epochs=opts.finetune_epochs)


def _local_only(opts: NoOptions, cohorts: Cohorts, head_layers: int) -> LocalOnly:
    return LocalOnly(cohorts)


#: the reference baselines: FedAvg + fine-tuning (only the reporting clients train) and
#: local-only
SPECS: tuple[StrategySpec, ...] = (
    personalised_spec("fedavg-ft", FedAvgFTOptions, _fedavg_ft, schedule="sampled"),
    personalised_spec("local-only", NoOptions, _local_only),
)
