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
* pfedhb: the fields of :class:`strategies.pfedhb.HBConfig` (``server_solver``,
  ``server_steps``, ``server_lr``, ``server_milestones``, ``server_gamma``, ``hyperprior``,
  ``lam_mu``, ``lam_sigma``, ``nig`` (a table: ``m0``, ``kappa0``, ``a0``, ``b0``),
  ``head_variance``, ``body_variance``, ``head_weighting``, ``iterations``,
  ``body_bayesian``); the head/body split comes from ``[model] head_layers``;
* pfedvem: ``beta`` (server momentum of the body, 0);
* fedavg-ft: ``finetune_epochs`` (epochs each client fine-tunes the global model before
  it evaluates, 1); only the reporting clients train;
* pfedbayes, local-only: nothing else.

Errors name the key as ``strategy.options.<key>``, with its value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fedsim.config import ConfigError, require
from strategies.personalised import Cohorts, FedAvgReference, LocalOnly, PersonalisedStrategy
from strategies.spec import StrategySpec

_WHERE = "strategy.options"
#: ``make(options, cohorts, head_layers)``: the method from its remaining options
Make = Callable[[dict[str, Any], Cohorts, int], PersonalisedStrategy]


def personalised_spec(
    name: str,
    allowed: tuple[str, ...],
    make: Make,
    *,
    schedule: Literal["all", "sampled"] = "all",
    option_key: Callable[[str], str] = lambda key: key,
) -> StrategySpec:
    """The spec of the personalised method ``name``: its ``strategy.options`` keys
    ``allowed`` (besides ``schedule``/``min_clients`` when listed), ``make`` building it,
    its default ``schedule``, and ``option_key`` naming the option behind a key its classes
    raise errors under (after their ``<name>.`` prefix is removed)."""

    def build(options: Mapping[str, Any], **cohort: Any) -> PersonalisedStrategy:
        return from_options(
            name, allowed, make, options, schedule=schedule, option_key=option_key, **cohort
        )

    return StrategySpec(name=name, build=build, personalised=True)


def from_options(
    name: str,
    allowed: tuple[str, ...],
    make: Make,
    options: Mapping[str, Any],
    *,
    schedule: Literal["all", "sampled"],
    option_key: Callable[[str], str],
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
    for key, value in options.items():
        if key.replace("-", "_") not in allowed:
            raise ConfigError(
                f"{_WHERE}.{key}",
                value,
                f"an option of {name}: {', '.join(allowed)}"
                if allowed
                else f"nothing: {name} has no options",
            )
    opts = {k.replace("-", "_"): v for k, v in options.items()}
    try:
        cohorts = Cohorts(
            schedule=opts.pop("schedule", schedule),
            fraction=clients_per_round / population,
            sampling="binomial" if sampling == "poisson" else "fixed",
            min_clients=integer(opts.pop("min_clients", 2), "min_clients"),
            evaluate_every=evaluate_every,
            num_rounds=rounds,
            seed=seed,
        )
        return make(opts, cohorts, head_layers)
    except ConfigError as err:
        if err.key.startswith("model."):
            raise
        key = err.key
        for prefix in (f"{name}.", "clients.", f"{_WHERE}."):
            if key.startswith(prefix):
                key = key[len(prefix) :]
        raise ConfigError(f"{_WHERE}.{option_key(key)}", err.value, err.allowed) from err


def integer(value: Any, key: str) -> int:
    """``value`` if it is an integer (not a bool), else a ConfigError for ``key``."""
    require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
    return value


def _fedavg_ft(opts: dict[str, Any], cohorts: Cohorts, head_layers: int) -> FedAvgReference:
    epochs = integer(opts.pop("finetune_epochs", 1), "finetune_epochs")
    return FedAvgReference(cohorts, finetune_epochs=epochs)


def _local_only(opts: dict[str, Any], cohorts: Cohorts, head_layers: int) -> LocalOnly:
    return LocalOnly(cohorts)


#: the reference baselines: FedAvg + fine-tuning (only the reporting clients train) and
#: local-only
SPECS: tuple[StrategySpec, ...] = (
    personalised_spec(
        "fedavg-ft", ("min_clients", "finetune_epochs"), _fedavg_ft, schedule="sampled"
    ),
    personalised_spec("local-only", (), _local_only),
)
