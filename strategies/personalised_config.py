"""The personalised strategies from a run config's ``[strategy]`` table.

``[strategy] name`` is one of :data:`NAMES`; ``clients_per_round`` is the number of
*reporting* clients (those whose posteriors update the server), drawn each round as
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

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from fedsim.config import ConfigError, from_mapping, require
from strategies.personalised import Cohorts, FedAvgReference, LocalOnly, PersonalisedStrategy
from strategies.pfedbayes import PFedBayes
from strategies.pfedhb import HBConfig, NormalInverseGamma, PFedHB
from strategies.pfedvem import PFedVEM

NAMES = ("pfedhb", "pfedvem", "pfedbayes", "fedavg-ft", "local-only")
_HB_KEYS = tuple(f.name for f in dataclasses.fields(HBConfig) if f.name != "head_layers")
_NIG_KEYS = tuple(f.name for f in dataclasses.fields(NormalInverseGamma))
OPTIONS: dict[str, tuple[str, ...]] = {
    "pfedhb": ("schedule", "min_clients", *_HB_KEYS),
    "pfedvem": ("schedule", "min_clients", "beta"),
    "pfedbayes": ("schedule", "min_clients"),
    "fedavg-ft": ("min_clients", "finetune_epochs"),
    "local-only": (),
}
_WHERE = "strategy.options"


def _option_key(key: str) -> str:
    """``strategy.options.<key>`` for an error raised under a class's own key name."""
    for prefix in ("pfedhb.", "pfedvem.", "clients.", f"{_WHERE}."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    if key in _NIG_KEYS:
        key = f"nig.{key}"
    return f"{_WHERE}.{key}"


def from_options(
    name: str,
    options: Mapping[str, Any],
    *,
    clients_per_round: int,
    sampling: Literal["poisson", "uniform"],
    population: int,
    seed: int,
    rounds: int,
    evaluate_every: int,
    head_layers: int,
) -> PersonalisedStrategy:
    """The personalised strategy ``name`` configured by ``options``.

    Args:
        clients_per_round, sampling: reporting clients per round and how they are drawn.
        population: registered clients (all of them are reachable every round).
        seed: the run seed (the reporting clients are a public stream of it).
        rounds, evaluate_every: every client evaluates every ``evaluate_every`` rounds and
            in the last round (0: only in the last).
        head_layers: the model's personal head (last linear layers).
    """
    require(name in NAMES, "strategy.name", name, f"one of {', '.join(NAMES)}")
    require(
        sampling in ("poisson", "uniform"),
        "strategy.sampling",
        sampling,
        "'poisson' (Binomial, the reference sampler) or 'uniform' with a personalised strategy",
    )
    allowed = OPTIONS[name]
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
            schedule=opts.pop("schedule", "sampled" if name == "fedavg-ft" else "all"),
            fraction=clients_per_round / population,
            sampling="binomial" if sampling == "poisson" else "fixed",
            min_clients=_integer(opts.pop("min_clients", 2), "min_clients"),
            evaluate_every=evaluate_every,
            num_rounds=rounds,
            seed=seed,
        )
        if name == "pfedhb":
            config = from_mapping(HBConfig, {**opts, "head_layers": head_layers}, _WHERE)
            return PFedHB(config, cohorts)
        if name == "pfedvem":
            beta = opts.pop("beta", 0.0)
            require(
                isinstance(beta, (int, float)) and not isinstance(beta, bool),
                "beta",
                beta,
                "a number in [0, 1)",
            )
            return PFedVEM(cohorts, beta=float(beta), head_layers=head_layers)
        if name == "pfedbayes":
            return PFedBayes(cohorts)
        if name == "fedavg-ft":
            epochs = _integer(opts.pop("finetune_epochs", 1), "finetune_epochs")
            return FedAvgReference(cohorts, finetune_epochs=epochs)
        return LocalOnly(cohorts)
    except ConfigError as err:
        if err.key.startswith("model."):
            raise
        raise ConfigError(_option_key(err.key), err.value, err.allowed) from err


def _integer(value: Any, key: str) -> int:
    require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
    return value
