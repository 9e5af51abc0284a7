"""``[strategy] name = "ddgauss"``: :func:`from_options` builds
:class:`~strategies.methods.ddgauss.strategy.DDGauss` from a config's options and the run's facts;
:data:`SPEC` is the line the registry lists."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fedsim.config import from_mapping
from strategies.methods.ddgauss.client import ddgauss_client_app
from strategies.methods.ddgauss.options import NAME, WHERE, DDGaussOptions
from strategies.methods.ddgauss.strategy import DDGauss
from strategies.spec import Accounting, RunFacts, StrategySpec

log = logging.getLogger(__name__)


def from_options(
    options: DDGaussOptions | Mapping[str, Any],
    *,
    expected_clients: float,
    seed: int,
    evaluate_fraction: float = 0.0,
    metrics_in_clear: bool = False,
) -> DDGauss:
    """ "ddgauss" from a config's ``strategy.options`` (a mapping is read as
    :class:`DDGaussOptions`): ``clipping_norm`` and ``noise_multiplier`` (required),
    ``mode`` ("full", "plaintext" or "committee"), the other keyword arguments of
    :class:`DDGauss` and, in committee mode, the committee's ``committee_size`` (required),
    ``threshold`` (required), ``packing`` (1), ``detect`` (1), ``committee_shards`` (1) and
    ``committee_actors`` (false; true hosts the members on Ray actors): a
    :class:`~fedsim.engine.committee.CommitteeSpec` the front end builds.
    ``evaluate_fraction`` > 0 (federated evaluation) needs ``metrics_in_clear``."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    if not isinstance(options, DDGaussOptions):
        options = from_mapping(DDGaussOptions, options, WHERE)
    inner = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=evaluate_fraction,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )
    return DDGauss(
        inner,
        clipping_norm=options.clipping_norm,
        noise_multiplier=options.noise_multiplier,
        expected_clients=max(2, round(expected_clients)),
        seed=seed,
        mode=options.mode,
        bits=options.bits,
        beta=options.beta,
        max_tries=options.max_tries,
        delta=options.delta,
        secagg_degree=options.secagg_degree,
        ring_bits=options.ring_bits,
        protocol_dropout=options.protocol_dropout,
        committee=options.committee(),
        stage_timeout=options.stage_timeout,
        prg=options.prg,
        member_dropout=options.dropout,
        metrics_in_clear=metrics_in_clear,
    )




def _always(options: Mapping[str, Any]) -> bool:
    """DDGauss's clients reply only their encoding, in every mode."""
    return True


def _build(options: DDGaussOptions, facts: RunFacts) -> DDGauss:
    """:func:`from_options` with the run's facts."""
    return from_options(
        options,
        expected_clients=facts.expected_clients,
        seed=facts.seed,
        evaluate_fraction=facts.evaluate_fraction,
        metrics_in_clear=facts.metrics_in_clear,
    )


SPEC = StrategySpec(
    name=NAME,
    options=DDGaussOptions,
    build=_build,
    accounting=Accounting(
        ledger="per round whose sum the server can determine (released, or aborted after it "
        "was opened), the distributed discrete Gaussian's zCDP bound (KLS21 Thm. 1) for the "
        "noise of the clients in that sum; zero-out neighbours; any per-client metric the "
        "server receives is unaccounted (epsilon infinite)",
    ),
    client_app=ddgauss_client_app,
    secure_replies=_always,
)
