"""ClientApp: each node moves the model by a vector of its own (its "data"), every round."""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def own_update(partition_id: int, size: int) -> np.ndarray:
    """The node's update: a fixed vector of norm 0.5 (below the clipping norm)."""
    direction = np.random.default_rng(partition_id).normal(size=size)
    return 0.5 * direction / np.linalg.norm(direction)


@app.train()
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
