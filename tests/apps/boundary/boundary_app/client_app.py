"""ClientApp: each node moves the model by a vector of its own (its "data"), every round.

Message-API train messages (an ``arrays`` record) are answered by a client mod; every other
message reaches a NumPyClient made by ``client_fn``, which answers Flower's legacy
``get_parameters`` (the node's own vector) and ``get_properties`` (its norm and first entry),
so a ServerApp can ask for client content the legacy way too.
"""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

SIZE = 8


def own_update(partition_id: int, size: int) -> np.ndarray:
    """The node's update: a fixed vector of norm 0.5 (below the clipping norm)."""
    direction = np.random.default_rng(partition_id).normal(size=size)
    return 0.5 * direction / np.linalg.norm(direction)


def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    model = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    moved = {k: (v + own_update(pid, v.size).reshape(v.shape)).astype(v.dtype)
             for k, v in model.items()}
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in moved.items()}),
            "metrics": MetricRecord({"num-examples": 1}),
        }
    )
    return Message(content=content, reply_to=msg)


def message_api_train(msg: Message, context: Context, call_next) -> Message:
    """Answers Message-API train messages; passes every other message on."""
    if msg.metadata.message_type == MessageType.TRAIN and "arrays" in msg.content:
        return train(msg, context)
    return call_next(msg, context)


class OwnVector(NumPyClient):
    def __init__(self, partition_id: int) -> None:
        self.vector = own_update(partition_id, SIZE)

    def get_parameters(self, config):
        return [self.vector.astype(np.float32)]

    def get_properties(self, config):
        return {"norm": float(np.linalg.norm(self.vector)), "first": float(self.vector[0])}


def client_fn(context: Context):
    return OwnVector(int(context.node_config["partition-id"])).to_client()


app = ClientApp(client_fn=client_fn, mods=[message_api_train])
