"""ClientApp: each node holds 20 + 4 * partition_id values drawn from its partition id, and
answers ``query`` (count and sum) and ``query.histogram`` (counts in the server's bins); for
the ``fedavg`` surface it fits y = w * x + b to its values (``train``: gradient steps on the
squared error) and reports its squared error (``evaluate``); ``train.clipped`` is the same
training behind Flower's ``fixedclipping_mod``. A mod of the app's own stamps every train and
evaluate reply's metrics (``mod-calls``), so a runtime that skips the mods is seen."""

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod


def stamp_mod(msg: Message, context: Context, call_next) -> Message:
    """Adds ``mod-calls = 1`` to a train or evaluate reply's metrics."""
    reply = call_next(msg, context)
    if reply.has_content() and "metrics" in reply.content:
        reply.content["metrics"]["mod-calls"] = 1
    return reply


app = ClientApp(mods=[stamp_mod])


def values(context: Context) -> np.ndarray:
    partition = int(context.node_config["partition-id"])
    rng = np.random.default_rng(500 + partition)
    return rng.normal(loc=partition - 2.0, size=20 + 4 * partition)


def targets(x: np.ndarray) -> np.ndarray:
    """The values' targets: a line the federation fits (no noise: a deterministic app)."""
    return 2.0 * x + 1.0


def mse(w: float, b: float, x: np.ndarray) -> float:
    return float(np.mean((w * x + b - targets(x)) ** 2))


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


@app.train()
def train(msg: Message, context: Context) -> Message:
    return fit(msg, context)


@app.train("clipped", mods=[fixedclipping_mod])
def train_clipped(msg: Message, context: Context) -> Message:
    return fit(msg, context)


def fit(msg: Message, context: Context) -> Message:
    (params,) = msg.content["arrays"].to_numpy_ndarrays()
    w, b = (float(v) for v in params)
    x = values(context)
    lr, steps = float(context.run_config["lr"]), int(context.run_config["local-steps"])
    for _ in range(steps):
        error = w * x + b - targets(x)
        w, b = w - lr * 2.0 * float(np.mean(error * x)), b - lr * 2.0 * float(np.mean(error))
    arrays = ArrayRecord([np.array([w, b], dtype=np.float64)])
    metrics = MetricRecord({"train-mse": mse(w, b, x), "num-examples": int(x.size)})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    (params,) = msg.content["arrays"].to_numpy_ndarrays()
    x = values(context)
    metrics = MetricRecord({"eval-mse": mse(*(float(v) for v in params), x),
                            "num-examples": int(x.size)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
