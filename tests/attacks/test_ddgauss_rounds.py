"""The server re-sends a round to DDGauss clients with another model.

A client's rounding, noise and share randomness for round r come from its own secret and r. A
server that sends round r again with another global model would get the same noise on a
different update: in plaintext mode the difference of the two encodings is the difference of
the two rounded updates, noise-free; in committee mode each member's two share rows differ by a
share of that noise-free difference under the same randomness. Every client now answers a round
once (its record in its own state, which the engine's state store keeps across restarts): a
re-sent round, or an earlier one, is refused before anything is drawn. Full mode (SecAgg+)
refused a round it had begun already; it keeps refusing.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from attacks.test_ddgauss import (  # noqa: F401 - task_identity is a fixture
    CLIENTS,
    PHRASE,
    SEED,
    _Nodes,
    node,
    secret_update,
    strategy,
    task_identity,
)
from fedsim.engine.rounds import run_rounds
from fedsim.engine.state import ClientStateStore
from fedsim.randomness import NODE_SECRET_KEY, RunSecret
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from strategies.methods.ddgauss.client import ENCODED_KEY, ddgauss_client_app

PARTITION, OTHER = 4, 0.2  # the client re-asked, the weights of the second model
inner = ClientApp()


@inner.train()
def _train(message: Message, context: Context) -> Message:
    """A step that depends on the model: update = secret_update - w / 2."""
    w = to_numpy(message.content["arrays"])["w"]
    trained = w / 2 + secret_update(int(context.node_config["partition-id"]))
    content = RecordDict(
        {"arrays": to_record({"w": trained}), "metrics": MetricRecord({"num-examples": 5})}
    )
    return Message(content, reply_to=message)


def _context() -> Context:
    secret = RunSecret.from_passphrase(PHRASE).client(PARTITION)
    config = {"partition-id": PARTITION, "num-partitions": CLIENTS, NODE_SECRET_KEY: secret.token()}
    return Context(run_id=1, node_id=node(PARTITION), node_config=config, state=RecordDict(),
                   run_config={})


def _instruction(server, server_round: int, weight: float) -> Message:
    model = to_record({"w": np.full(12, weight)})
    messages = list(server.configure_train(server_round, model, ConfigRecord(), _Nodes()))
    return Message(messages[PARTITION].content, node(PARTITION), "train")


def _noise_free(server, first: Message, again: Message, server_round: int) -> str:
    """What the server makes of two plaintext encodings of one round: their difference,
    decoded, against the two updates' difference (it knows both models)."""
    encoder = server.encoder
    signed = [
        DEFAULT_FIELD.decode_signed(to_numpy(r.content[ENCODED_KEY])[ENCODED_KEY])
        for r in (first, again)
    ]
    difference = DEFAULT_FIELD.encode_signed(signed[0] - signed[1])
    estimate = encoder.decode(difference, server.rotation_seed(server_round))[:12]
    error = float(np.sqrt(np.mean((estimate - OTHER / 2) ** 2)))  # u_0 - u_1 = (w_1 - w_0) / 2
    return (
        f"the difference of its two encodings gives the two updates' difference to {error:.2g} "
        f"(its noise std is {encoder.noise_std:.2g}: the noise is gone)"
    )


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("mode", ["plaintext", "committee", "full"])
def test_a_round_sent_again_with_another_model_is_refused(mode):
    """Round 3 with a model of zeros, then round 3 with weights 0.2: the client answers the
    first and refuses the second (and round 2 after it)."""
    server, app, context = strategy(mode), ddgauss_client_app(inner), _context()
    first = app(_instruction(server, 3, 0.0), context)
    assert not first.has_error()
    for server_round in (3, 2):
        try:
            again = app(_instruction(strategy(mode), server_round, OTHER), context)
        except RuntimeError as refusal:
            assert "already" in str(refusal)
            continue
        leak = "with the streams of a round it had answered"
        if server_round == 3 and mode == "plaintext":
            leak = _noise_free(server, first, again, 3)
        pytest.fail(f"{mode}: the client answered round {server_round} again: {leak}")


def test_the_record_survives_the_engine_and_its_state_store_restarting(
    local_engine, client_secrets, tmp_path
):
    """Round 1 over the engine with a state file; the file is closed, opened again by a fresh
    run of the engine, and the server sends round 1 again with another model: every client
    refuses it."""
    root, path = RunSecret.from_passphrase(PHRASE), tmp_path / "states.sqlite"
    app = client_secrets(ddgauss_client_app(inner), PHRASE)
    store = ClientStateStore(path, secrets=root, run_tag="resend")
    server = strategy("plaintext")
    grid = local_engine.open_run(app, CLIENTS, run_config={"seed": SEED}, state_store=store)
    run_rounds(server, grid, to_record({"w": np.zeros(12)}), 1)
    grid.wait_idle()
    store.mark(1)
    store.close()
    reopened = ClientStateStore(path, secrets=root, run_tag="resend", must_exist=True)
    grid = local_engine.open_run(app, CLIENTS, run_config={"seed": SEED}, state_store=reopened)
    again = strategy("plaintext")
    model = to_record({"w": np.ones(12)})
    replies = list(grid.send_and_receive(again.configure_train(1, model, ConfigRecord(), grid)))
    grid.wait_idle()
    reopened.close()
    answered = [int(r.metadata.src_node_id) for r in replies if not r.has_error()]
    assert answered == [], f"clients {answered} answered round 1 a second time"
    assert len(replies) == CLIENTS
    assert all("already answered ddgauss round 1" in r.error.reason for r in replies)
