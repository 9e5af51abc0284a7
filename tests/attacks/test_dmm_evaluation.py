"""The server against DMM's clients through federated evaluation and per-client metrics.

With ``[evaluation] clients > 0`` every evaluating DMM client used to answer the server with its
un-noised loss and accuracy on its own rows, next to a release that hides its update; the
strategy received them and epsilon stayed finite. Now the config refuses it (naming
``evaluation.clients``) unless ``[privacy] metrics_in_clear``, the strategy refuses to send
evaluation, a DMM client refuses to answer it, and with ``metrics_in_clear`` any per-client
metric the server receives makes epsilon infinite (``unaccounted`` in the report).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup, make_dmm, with_secrets
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.record_codec import to_record
from strategies.methods.dmm import DMM, dmm_client_app

CLIENTS = 12
CONFIG = {
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": 24},
    "strategy": {
        "name": "dmm",
        "clients_per_round": 12,
        "sampling": "min-separation",
        "options": {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "committee_size": 11,
            "threshold": 2,
            "packing": 1,
            "member_dropouts": 2,
        },
    },
    "evaluation": {"clients": 4},
}


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def secret_loss(partition: int) -> float:
    """Client ``partition``'s loss on its own rows: unknown to the server."""
    return 0.1 + 0.01 * partition


evaluating = ClientApp()


@evaluating.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    loss = secret_loss(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"loss": loss, "accuracy": 1 - loss, "num-examples": 5})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


@pytest.mark.parametrize("mode", ["full", "ideal"])
def test_a_config_with_federated_evaluation_is_refused_naming_the_key(mode):
    config = {**CONFIG, "strategy": {**CONFIG["strategy"]}}
    config["strategy"]["options"] = {**CONFIG["strategy"]["options"], "mode": mode}
    with pytest.raises(ConfigError, match=r"evaluation\.clients = 4 .*metrics_in_clear") as caught:
        ExperimentConfig.from_dict(config)
    assert caught.value.key == "evaluation.clients"
    allowed = ExperimentConfig.from_dict({**config, "privacy": {"metrics_in_clear": True}})
    assert allowed.evaluation.clients == 4  # metrics_in_clear: epsilon infinite, as reported


class Evaluating(FedAvg):
    """An inner strategy that asks every node to evaluate, whatever its fraction says."""

    def configure_evaluate(self, server_round, arrays, config, grid):
        return [
            Message(RecordDict({"arrays": arrays}), dst_node_id=n, message_type="evaluate")
            for n in grid.get_node_ids()
        ]


def test_the_strategy_sends_no_evaluation(local_engine):
    """Flower's FedAvg evaluates on every node by default: DMM refuses it when built, and
    refuses the evaluate messages an inner strategy sends anyway."""
    base = make_dmm("ideal", CLIENTS, 2)
    with pytest.raises(ValueError, match=r"fraction_evaluate=1\.0 .*metrics_in_clear"):
        DMM(
            FedAvg(min_available_nodes=0),
            factorization=base.mechanism.factorization,
            participation=base.mechanism.participation,
            population=CLIENTS, committee_size=11, threshold=2, packing=1, member_dropouts=2,
            clipping_norm=1.0, noise_multiplier=1.0, expected_clients=CLIENTS, seed=7,
        )  # fmt: skip
    strategy = make_dmm("ideal", CLIENTS, 2)
    strategy.strategy = Evaluating(min_available_nodes=0, fraction_evaluate=0.0)
    data, dataset, _, inner = digits_setup(CLIENTS)
    grid = local_engine.open_run(
        with_secrets(dmm_client_app(inner)), CLIENTS, datasets=((data, dataset),)
    )
    model = to_record({"w": np.zeros(3)})
    with pytest.raises(RuntimeError, match=f"{CLIENTS} evaluate messages with DMM"):
        strategy.configure_evaluate(1, model, ConfigRecord(), grid)


def test_a_client_answers_no_evaluation(local_engine):
    """The server sends evaluate messages straight to DMM clients over the Grid: each answers
    with an error, never its loss."""
    grid = local_engine.open_run(with_secrets(dmm_client_app(evaluating)), CLIENTS)
    model = to_record({"w": np.zeros(12)})
    messages = [
        Message(RecordDict({"arrays": model}), dst_node_id=NODE_ID_OFFSET + p,
                message_type="evaluate")
        for p in range(CLIENTS)
    ]  # fmt: skip
    replies = list(grid.send_and_receive(messages, timeout=60))
    grid.wait_idle()
    leaked = {
        r.metadata.src_node_id: r.content["metrics"]["loss"] for r in replies if not r.has_error()
    }
    assert leaked == {}, f"DMM clients sent the server their un-noised losses: {leaked}"
    assert len(replies) == CLIENTS
    assert all("answers no federated evaluation" in r.error.reason for r in replies)


def test_metrics_in_clear_makes_epsilon_infinite():
    """With metrics_in_clear the evaluation is allowed, and what reaches the strategy outside
    the release makes epsilon infinite for the clients, named in the report."""
    strategy = make_dmm("ideal", CLIENTS, 2, metrics_in_clear=True)
    assert strategy.epsilon() == 0.0
    sent = Message(RecordDict(), dst_node_id=NODE_ID_OFFSET, message_type="evaluate")
    metrics = MetricRecord({"loss": secret_loss(0), "num-examples": 5})
    strategy.aggregate_evaluate(1, [Message(RecordDict({"metrics": metrics}), reply_to=sent)])
    assert math.isinf(strategy.epsilon()), f"epsilon {strategy.epsilon()} with clients' losses"
    report = strategy.privacy_report()
    assert math.isinf(report["epsilon"])
    assert report["unaccounted"] == {
        "releases": 1,
        "first": "round 1: evaluation metrics of 1 clients",
    }


def test_train_metrics_in_clear_make_epsilon_infinite(local_engine):
    """A client built with metrics_in_clear sends its train loss next to its shares: the round
    is released and accounted, and epsilon is infinite."""
    from dmm_support import Recorded  # noqa: PLC0415

    from fedsim.engine.dmm_committee import CommitteeHost  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.models import initial_arrays  # noqa: PLC0415

    data, dataset, model, inner = digits_setup(CLIENTS)
    strategy = make_dmm("ideal", CLIENTS, 2, metrics_in_clear=True)
    strategy.bind_committee_host(CommitteeHost(SECRETS))
    app = with_secrets(dmm_client_app(inner, metrics_in_clear=True))
    grid = local_engine.open_run(app, CLIENTS, datasets=((data, dataset),))
    recorded = Recorded(strategy)
    run_rounds(recorded, grid, to_record(initial_arrays(model, 0)), 1)
    assert recorded.metrics[0]["dmm-clients"] == CLIENTS
    assert math.isinf(strategy.epsilon())
    assert strategy.privacy_report()["unaccounted"]["first"] == (
        f"round 1: train metrics of {CLIENTS} clients in the clear"
    )
