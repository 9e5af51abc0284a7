"""``[strategy] name = "dmm"``: :func:`from_options` builds the :class:`~strategies.methods.dmm.DMM`
of a config's options (:class:`~strategies.methods.dmm.options.DMMOptions`) and the run's facts, and
:data:`SPEC` is the line the registry lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsim.config import ConfigError, from_mapping, to_mapping
from fedsim.privacy import dmm as dmm_privacy
from fedsim.privacy.participation import Participation
from protocols.dmm.common import DMMKeys
from strategies.methods.dmm.client import dmm_client_app
from strategies.methods.dmm.options import WHERE, DMMOptions
from strategies.methods.dmm.strategy import DMM
from strategies.spec import Accounting, RunFacts, StrategySpec


def _factorization(opts: DMMOptions, rounds: int, participation: Participation):
    """(A = B C for ``rounds`` rounds of ``opts.kind`` with its ``kind_options``, the schema
    it is built for): bands default to the min separation, at most rounds - 1."""
    from fedsim.privacy.matrix.build import Spec, build  # noqa: PLC0415

    sep = int(participation.min_sep)
    k = participation.participations(rounds)
    bands = opts.bands
    if bands is None and opts.kind in dmm_privacy.banded_kinds():
        bands = max(1, min(sep, rounds - 1))
    options = tuple((opts.kind_options or {}).items())
    try:
        spec = Spec(
            kind=opts.kind,
            rounds=rounds,
            bands=bands,
            participations=k,
            min_sep=sep,
            options=options,
        )
        factorization = build(spec)
    except ConfigError as err:  # the kind's own options are strategy.options.kind_options.*
        if not err.key.startswith("kind_options"):
            raise
        raise ConfigError(f"{WHERE}.{err.key}", err.value, err.allowed) from err
    return factorization, Participation.separated(sep, k)


def from_options(
    options: DMMOptions | Mapping[str, Any],
    *,
    rounds: int,
    expected_clients: float,
    population: int,
    seed: int,
    participation: Participation | None = None,
    evaluate_fraction: float = 0.0,
    metrics_in_clear: bool = False,
) -> DMM:
    """ "dmm" from a config's ``strategy.options`` (:class:`DMMOptions`, which lists them and
    their defaults). ``participation`` is the engine's schedule (a b-min-separation
    :class:`~fedsim.privacy.participation.Participation`; None: every client may be in every
    round). A bad option is a ConfigError naming ``strategy.options.<key>``."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    opts = options if isinstance(options, DMMOptions) else from_mapping(DMMOptions, options, WHERE)
    participation = Participation.separated(1) if participation is None else participation
    if participation.kind != "min_sep":
        raise ValueError(
            f"participation = {participation!r}; allowed: a b-min-separation Participation "
            "(Participation.separated(b, k)) or None (every client may be in every round)"
        )
    factorization, participation = _factorization(opts, rounds, participation)
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    return DMM(
        inner,
        factorization=factorization,
        population=int(population),
        committee_size=opts.committee_size,
        threshold=opts.threshold,
        packing=opts.packing,
        member_dropouts=opts.member_dropouts,
        fractional_bits=opts.fractional_bits,
        clipping_norm=opts.clipping_norm,
        noise_multiplier=opts.noise_multiplier,
        expected_clients=max(1, round(expected_clients)),
        seed=seed,
        mode=opts.mode,
        participation=participation,
        expected_client_dropout=opts.expected_client_dropout,
        min_clients=opts.min_clients,
        bits=opts.bits,
        delta=opts.delta,
        committee_actors=opts.committee_actors,
        committee_shards=opts.committee_shards,
        worker_fold=opts.worker_fold,
        metrics_in_clear=metrics_in_clear,
        reshare_checks=opts.reshare_checks,
    )


def _always(options: Mapping[str, Any]) -> bool:
    """DMM's clients reply only their sealed shares (or, ideal mode, their integers)."""
    return True


def _build(options: DMMOptions, facts: RunFacts) -> DMM:
    """:func:`from_options` with the run's facts; a bad option is a ConfigError naming it,
    one the strategy refuses (e.g. a committee below its bound) names the options."""
    rounds = facts.required("rounds", f"the run's rounds (required by {DMMKeys.NAME})")
    population = facts.required("population", "the registered clients")
    try:
        return from_options(
            options,
            rounds=rounds,
            expected_clients=facts.expected_clients,
            population=population,
            seed=facts.seed,
            participation=facts.participation,
            evaluate_fraction=facts.evaluate_fraction,
            metrics_in_clear=facts.metrics_in_clear,
        )
    except ValueError as err:
        if isinstance(err, ConfigError) and err.key.startswith(f"{WHERE}."):
            raise
        raise ConfigError(WHERE, to_mapping(options), str(err)) from err


SPEC = StrategySpec(
    name=DMMKeys.NAME,
    build=_build,
    options=DMMOptions,
    accounting=Accounting(
        ledger="per round whose release the server can determine (released, or aborted after "
        "more than t members' shares reached it), the increase of the discrete-Gaussian zCDP "
        "bound of the integer matrix's rows released so far, counting only the noise actually "
        "present (KLS21); zero-out neighbours; any per-client metric the server receives is "
        "unaccounted (epsilon infinite)",
    ),
    client_app=dmm_client_app,
    secure_replies=_always,
)
