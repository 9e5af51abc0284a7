"""The parts of a ``fedsim run`` with a synthetic-text method (POPri, Private Evolution;
:data:`strategies.registry.TEXT`).

Such a run's ``[data]`` is ``source = "text"`` with a ``[data.text]`` table (the federation:
:meth:`fedsim.data.spec.text_source`); there is no ``[model]``: the global arrays are the
method's own (POPri's LoRA adapter, PE's population embeddings), the server measures the
quality itself (no central or federated evaluation), and the clients run the method's app
(:attr:`strategies.spec.StrategySpec.text_app`). The cohorts are the engine's, drawn from the
server's secret (:func:`fedsim.frontend.run_strategy.participation_for`), and accounted by the
method's ledger with the run's sampling model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from fedsim.data.spec import text_source
from fedsim.data.text import TextSourceSpec, cached_text_federation
from fedsim.data.text_federation import TextFederation
from fedsim.engine.participation import CohortModel
from strategies.plumbing.seeded_sampling import SeededSampling
from strategies.registry import build_text_strategy, spec_for

if TYPE_CHECKING:
    from fedsim.frontend.run_config import ExperimentConfig


class TextParts(NamedTuple):
    """What a text run needs besides its strategy."""

    source: TextSourceSpec
    federation: TextFederation
    app: ClientApp


def text_parts(config: ExperimentConfig) -> TextParts:
    """The federation of ``[data]`` and the clients' app of the method."""
    source = text_source(config.data)
    spec = spec_for(config.strategy.name)
    app = spec.text_app(spec.read_options(config.strategy.options), source)
    return TextParts(source, cached_text_federation(source), app)


def build_text_run_strategy(
    config: ExperimentConfig, participation: CohortModel, source: TextSourceSpec
) -> Strategy:
    """The configured text method over the engine's cohorts, with seeded sampling."""
    strategy = build_text_strategy(
        config.strategy.name,
        config.strategy.options,
        source,
        expected_clients=config.strategy.clients_per_round,
        evaluate_fraction=0.0,
        seed=config.seed,
        sampling=participation.accounting(config.rounds),
        population=participation.num_clients,
        rounds=config.rounds,
        metrics_in_clear=config.privacy.metrics_in_clear,
    )
    return SeededSampling(strategy, config.seed)


def initial_text_arrays(strategy: Strategy) -> ArrayRecord:
    """The method's round-1 arrays (POPri: the fresh adapter; PE: ``S_1``'s embeddings)."""
    inner = strategy.strategy if isinstance(strategy, SeededSampling) else strategy
    return inner.initial_arrays()
