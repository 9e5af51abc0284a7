"""The parts of a ``fedsim run`` with a personalised strategy (pFedHB, pFedVEM, pFedBayes,
FedAvg + fine-tuning, local-only; :data:`strategies.registry.PERSONALISED`).

Such a run's model is ``[model] kind = "bayes-mlp"``: the mean-field Gaussian MLP of
:mod:`fedsim.workloads.bayesian` with ``hidden``, ``head_layers`` (the personal head) and
``rho_init``; its clients run :func:`fedsim.workloads.personalised.make_personal_app` with
the ``[personal]`` table (:class:`~fedsim.workloads.personalised.PersonalTraining`). Every
client is reachable every round (the strategy draws the reporting clients itself), so the
engine's participation is full. Each evaluation round writes to rounds.jsonl

* ``aggregated_evaluate``: every client's personal model on its own test rows, the
  unweighted mean over clients of accuracy and NLL (posterior mean: ``personal_acc_mean``;
  MC predictive: ``personal_acc_mc``) and the ECE pooled over clients;
* ``central``: the global model (posterior mean) on the pooled test rows: ``global_acc``,
  ``global_nll``, ``global_ece``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp

from fedsim.config import ConfigError
from fedsim.data import FederatedDataset
from fedsim.randomness import Stream, public_generator
from fedsim.record_codec import to_numpy
from fedsim.workloads.bayesian import BayesSpec, build_bayes_model, model_arrays
from fedsim.workloads.personalised import PersonalTraining, global_metrics, make_personal_app

if TYPE_CHECKING:
    from fedsim.frontend.run_config import ExperimentConfig


def personal_training(config: ExperimentConfig) -> PersonalTraining:
    return config.personal or PersonalTraining(seed=config.seed)


def bayes_spec(config: ExperimentConfig, dataset: FederatedDataset) -> BayesSpec:
    return BayesSpec(
        in_features=int(np.prod(dataset.feature_shape)),
        hidden=config.model.hidden,
        num_classes=dataset.num_classes,
        head_layers=config.model.head_layers,
        rho_init=config.model.rho_init,
    )


class PersonalisedParts(NamedTuple):
    """What a personalised run needs besides its strategy."""

    app: ClientApp
    initial: dict[str, np.ndarray]
    evaluate: Callable[[int, ArrayRecord], MetricRecord | None]


def personalised_parts(config: ExperimentConfig, dataset: FederatedDataset) -> PersonalisedParts:
    """The client app, the initial global posterior (drawn from the run seed, as every
    initial model) and the global model's evaluation."""
    spec = bayes_spec(config, dataset)
    training = personal_training(config)
    return PersonalisedParts(
        make_personal_app(spec, config.data, training, config.engine.device),
        model_arrays(build_bayes_model(spec, config.seed)),
        _global_evaluator(config, spec, dataset, training.ece_bins),
    )


def _global_evaluator(
    config: ExperimentConfig, spec: BayesSpec, dataset: FederatedDataset, ece_bins: int
) -> Callable[[int, ArrayRecord], MetricRecord | None]:
    """The global model on a public subset of the pooled test rows, in the rounds the
    clients evaluate (every ``evaluation.every`` rounds and the last)."""
    x_all, y_all = dataset.central_test
    if len(y_all) == 0:
        raise ConfigError("data.test_fraction", config.data.test_fraction, "> 0 (no test rows)")
    rows = min(config.evaluation.central_rows, len(y_all))
    rng = public_generator(config.seed, 0, Stream.EVALUATION_SUBSET)
    pick = np.sort(rng.choice(len(y_all), rows, replace=False))
    x, y = x_all[pick], y_all[pick]
    model = build_bayes_model(spec, config.seed)
    every = config.evaluation.every

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        due = server_round == config.rounds or (every > 0 and server_round % every == 0)
        if server_round < 1 or not due:
            return None
        return MetricRecord(global_metrics(model, to_numpy(arrays), x, y, ece_bins))

    return evaluate
