"""ClientApp: each node holds 20 + 4 * partition_id values drawn from its partition id, and
answers ``query`` (count and sum) and ``query.histogram`` (counts in the server's bins)."""

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def values(context: Context) -> np.ndarray:
    partition = int(context.node_config["partition-id"])
    rng = np.random.default_rng(500 + partition)
    return rng.normal(loc=partition - 2.0, size=20 + 4 * partition)


@app.query()
def count_and_sum(msg: Message, context: Context) -> Message:
    x = values(context)
    record = MetricRecord({"count": int(x.size), "sum": float(x.sum())})
    return Message(RecordDict({"stats": record}), reply_to=msg)


@app.query("histogram")
def histogram(msg: Message, context: Context) -> Message:
    config = msg.content["bins"]
    edges = np.linspace(float(config["low"]), float(config["high"]), int(config["bins"]) + 1)
    counts, _ = np.histogram(values(context), bins=edges)
    record = MetricRecord({"counts": [int(c) for c in counts]})
    return Message(RecordDict({"histogram": record}), reply_to=msg)
