"""The server against DDGauss's clients through federated evaluation.

With ``[evaluation] clients > 0`` every evaluating client used to answer the server with its
un-noised loss and accuracy on its own rows, each round, next to a secure sum that hides its
update: rounds.jsonl left them out, the strategy received them. Now the config refuses it
(naming ``evaluation.clients``) unless ``[privacy] metrics_in_clear``, the strategy refuses to
send evaluation, a DDGauss client refuses to answer it, and with ``metrics_in_clear`` any
per-client metric the server receives makes epsilon infinite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from attacks.test_ddgauss import CLIENTS, PHRASE, inner, node, one_round
from fedsim.config import ConfigError
from fedsim.engine.committee import Committee
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.record_codec import to_record
from strategies.methods.ddgauss.client import ddgauss_client_app
from strategies.methods.ddgauss.strategy import DDGauss

MODES = ("full", "committee", "plaintext")
CONFIG = {
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": 30},
    "strategy": {
        "name": "ddgauss",
        "clients_per_round": 10,
        "options": {"clipping_norm": 1.0, "noise_multiplier": 1.0},
    },
    "evaluation": {"clients": 4},
}
COMMITTEE = {"committee_size": 7, "threshold": 2, "packing": 2}


def secret_loss(partition: int) -> float:
    """Client ``partition``'s loss on its own rows: unknown to the server."""
    return 0.1 + 0.01 * partition


evaluating = ClientApp()


@evaluating.train()
def _train(message: Message, context: Context) -> Message:
    return inner(message, context)


@evaluating.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    loss = secret_loss(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"loss": loss, "accuracy": 1 - loss, "num-examples": 5})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


def _config(mode: str, **privacy) -> dict:
    options = {**CONFIG["strategy"]["options"], "mode": mode}
    if mode == "committee":
        options.update(COMMITTEE)
    return {**CONFIG, "strategy": {**CONFIG["strategy"], "options": options}, **privacy}


@pytest.mark.parametrize("mode", MODES)
def test_a_config_with_federated_evaluation_is_refused_naming_the_key(mode):
    with pytest.raises(ConfigError, match=r"evaluation\.clients = 4 .*metrics_in_clear") as caught:
        ExperimentConfig.from_dict(_config(mode))
    assert caught.value.key == "evaluation.clients"
    allowed = ExperimentConfig.from_dict(_config(mode, privacy={"metrics_in_clear": True}))
    assert allowed.evaluation.clients == 4  # metrics_in_clear: ε = ∞, as the report says


def _ddgauss(strategy, mode="full", **options):
    committee = Committee(7, 2, 2) if mode == "committee" else None
    return DDGauss(
        strategy,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
        seed=7,
        mode=mode,
        committee=committee,
        **options,
    )


class Evaluating(FedAvg):
    """An inner strategy that asks every node to evaluate, whatever its fraction says."""

    def configure_evaluate(self, server_round, arrays, config, grid):
        return [
            Message(RecordDict({"arrays": arrays}), dst_node_id=n, message_type="evaluate")
            for n in grid.get_node_ids()
        ]


def test_the_strategy_sends_no_evaluation(local_engine, client_secrets):
    """Flower's FedAvg evaluates on every node by default: DDGauss refuses it when built, and
    refuses the evaluate messages an inner strategy sends anyway."""
    for mode in MODES:
        with pytest.raises(ValueError, match=r"fraction_evaluate=1\.0 .*metrics_in_clear"):
            _ddgauss(FedAvg(min_available_nodes=0), mode)
    server = _ddgauss(Evaluating(min_available_nodes=0, fraction_evaluate=0.0))
    server.encoder_for(12)
    with pytest.raises(RuntimeError, match="8 evaluate messages with DDGauss"):
        one_round(local_engine, client_secrets, server)


def test_a_client_answers_no_evaluation(local_engine, client_secrets):
    """The server sends evaluate messages straight to DDGauss clients over the Grid: each
    answers with an error, never its loss."""
    app = client_secrets(ddgauss_client_app(evaluating), PHRASE)
    grid = local_engine.open_run(app, CLIENTS, run_config={"seed": 0})
    model = to_record({"w": np.zeros(12)})
    messages = [
        Message(RecordDict({"arrays": model}), dst_node_id=node(p), message_type="evaluate")
        for p in range(CLIENTS)
    ]
    replies = list(grid.send_and_receive(messages, timeout=60))
    grid.wait_idle()
    leaked = {
        r.metadata.src_node_id: r.content["metrics"]["loss"]
        for r in replies
        if not r.has_error()
    }
    assert leaked == {}, f"clients sent the server their un-noised losses: {leaked}"
    assert len(replies) == CLIENTS
    assert all("answers no federated evaluation" in r.error.reason for r in replies)


def test_metrics_in_clear_makes_epsilon_infinite(local_engine, client_secrets):
    """With metrics_in_clear on both sides the evaluation runs, and the strategy says what it
    received outside the secure sum: epsilon is infinite for the clients."""
    server = _ddgauss(
        FedAvg(min_available_nodes=0, fraction_evaluate=1.0), metrics_in_clear=True
    )
    server.encoder_for(12)
    app = client_secrets(ddgauss_client_app(evaluating, metrics_in_clear=True), PHRASE)
    _, _, metrics = one_round(local_engine, client_secrets, server, app)
    assert metrics["ddgauss-survivors"] == CLIENTS
    assert math.isinf(server.epsilon()), f"epsilon {server.epsilon()} with clients' metrics"
    report = server.privacy_report()
    assert math.isinf(report["epsilon"]) and report["unaccounted"]["releases"] == 2
    assert report["unaccounted"]["first"] == "round 1: train metrics of 8 clients in the clear"
