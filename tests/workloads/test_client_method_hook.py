"""The server -> client input hook of client methods (fedsim.workloads.client_method): a
training's declared instruction records reach it, its reply records reach the server half,
and the half changes the round's global arrays; nothing else passes."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.data import DatasetSpec
from fedsim.models import ModelSpec, initial_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.client_app import training_app
from fedsim.workloads.client_method import ServerHalf
from fedsim.workloads.training import ClientTraining, LocalSteps, TrainResult
from strategies.plumbing.client_method_halves import ServerHalfStrategy

LOGREG = ModelSpec(kind="logreg", input_shape=(64,), num_classes=10)
DATA = DatasetSpec(source="digits", partition="iid", num_clients=4, seed=1)
SHIFT, ECHO = "demo.shift", "demo.echo"


class Shifted(ClientTraining):
    """Uploads the global arrays plus the server's shift, and echoes twice the shift."""

    inputs = (SHIFT,)

    def train(self, model, task, generator, state):
        shift = task.inputs[SHIFT]
        upload = {k: v + shift["s"] for k, v in self.arrays(model).items()}
        return TrainResult(0.0, 0, upload=upload, replies={ECHO: {"s": 2 * shift["s"]}})


def _instruction(arrays, **records):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    content = RecordDict({"arrays": to_record(arrays), "config": ConfigRecord({"lr": 0.1})})
    for key, value in records.items():
        content[key] = to_record(value)
    message = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = "m1"
    return message


def _context():
    return Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )


def test_the_training_reads_its_declared_record_and_replies_its_own():
    app = training_app(Shifted(LOGREG, LocalSteps()), DATA)
    arrays = initial_arrays(LOGREG, 1)
    shift = {"s": np.array(0.5, np.float32)}
    reply = app(_instruction(arrays, **{SHIFT: shift}), _context())
    uploaded = to_numpy(reply.content["arrays"])  # the global arrays' key, not the input's
    for k, v in arrays.items():
        np.testing.assert_allclose(uploaded[k], v + 0.5)
    np.testing.assert_allclose(to_numpy(reply.content[ECHO])["s"], 1.0)


def test_an_instruction_without_the_declared_record_is_refused_by_name():
    app = training_app(Shifted(LOGREG, LocalSteps()), DATA)
    with pytest.raises(ValueError, match="demo.shift"):
        app(_instruction(initial_arrays(LOGREG, 1)), _context())


class Offset(ServerHalf):
    """Sends the round number; adds the mean of the echoes to the new global arrays."""

    key = ECHO

    def __init__(self):
        self.seen = []

    def instruction(self, server_round, arrays):
        self.seen.append(sorted(arrays))
        return {"s": np.array(float(server_round), np.float32)}

    def aggregate(self, server_round, replies, new):
        mean = float(np.mean([r["s"] for r in replies]))
        return {k: v + mean for k, v in new.items()}


class Nodes:
    def get_node_ids(self):
        return [3, 4]


def _reply(value, echo=None):
    content = RecordDict(
        {
            "arrays": to_record({"w": np.full(2, value, np.float32)}),
            "metrics": MetricRecord({"num-examples": 1}),
        }
    )
    if echo is not None:
        content[ECHO] = to_record({"s": np.array(echo, np.float32)})
    return Message(content, reply_to=Message(RecordDict(), 9, "train"))


def _strategy():
    inner = FedAvg(fraction_train=1.0, min_available_nodes=0, min_train_nodes=0)
    return ServerHalfStrategy(inner, Offset())


def test_the_server_half_instructs_every_client_and_changes_the_aggregate():
    strategy = _strategy()
    arrays = to_record({"w": np.zeros(2, np.float32)})
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), Nodes()))
    assert len(messages) == 2
    for message in messages:
        np.testing.assert_allclose(to_numpy(message.content[ECHO])["s"], 2.0)
    assert strategy.half.seen == [["w"]]
    new, _ = strategy.aggregate_train(2, [_reply(1.0, echo=1.0), _reply(3.0, echo=3.0)])
    np.testing.assert_allclose(to_numpy(new)["w"], 2.0 + 2.0)  # FedAvg's mean + the echoes'


def test_a_reply_without_the_method_record_is_an_error():
    with pytest.raises(RuntimeError, match="demo.echo"):
        _strategy().aggregate_train(1, [_reply(1.0, echo=1.0), _reply(3.0)])
