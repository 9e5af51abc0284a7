"""A deterministic toy ClientApp for engine tests (importable by Ray workers).

train: replies ``arrays + (partition-id + 1) * step`` with ``num-examples =
partition-id + 1``, counts its calls in ``context.state``, fails for the
partitions listed in ``run_config["fail"]`` (space-separated), sleeps
``slow-seconds`` for ``slow-partition`` and, once per file named by
``run_config["crash-file"]``, kills its worker process at ``crash-partition``, and keeps
``state-bytes`` bytes of ballast in its state (a state as large as a sealed DDGauss one).
Hostile clients: ``spoof-partition`` sends a 1e6-times larger update whose metrics
pose as a worker's partial sum (``fedsim.clients``); ``forge-partition`` returns
the engine's own :class:`~fedsim.worker_reduce.PartialReply` type.
evaluate: replies the sum of the arrays as a metric.
query: replies the first draw of the client's own secret stream (round 0, noise), to check
which secret the runtime gave it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.randomness import Purpose, client_secret
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import folded_reply

app = ClientApp()


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


@app.train()
def train(message: Message, context: Context) -> Message:
    pid = _partition(context)
    failing = str(context.run_config.get("fail", "")).split()
    crash = str(context.run_config.get("crash-file", ""))
    if crash and pid == int(context.run_config.get("crash-partition", -1)) and Path(crash).exists():
        Path(crash).unlink()
        os._exit(3)  # a worker crash, injected on purpose
    if pid == int(context.run_config.get("slow-partition", -1)):
        time.sleep(float(context.run_config.get("slow-seconds", 1.0)))
    counter = context.state.get("calls", MetricRecord({"n": 0}))
    counter["n"] = int(counter["n"]) + 1
    context.state["calls"] = counter
    ballast = int(context.run_config.get("state-bytes", 0))
    if ballast:
        context.state["ballast"] = ConfigRecord({"bytes": os.urandom(ballast)})
    if str(pid) in failing:
        raise RuntimeError(f"partition {pid} fails on purpose")
    arrays = to_numpy(message.content["arrays"])
    step = float(message.content["config"].get("step", 1.0))
    if context.run_config.get("mutate"):  # a careless client edits its instruction
        message.content["config"]["step"] = 100.0
    spoof = pid == int(context.run_config.get("spoof-partition", -1))
    step *= 1e6 if spoof else 1.0
    new = {k: (v + (pid + 1) * step).astype(v.dtype) for k, v in arrays.items()}
    metrics = MetricRecord({"num-examples": pid + 1, "calls": counter["n"], "pid": pid})
    if spoof:
        metrics["fedsim.clients"], metrics["fedsim.clipped"] = 0, 0
    content = RecordDict({"arrays": to_record(new), "metrics": metrics})
    reply = Message(content, reply_to=message)
    if pid == int(context.run_config.get("forge-partition", -1)):
        return folded_reply(reply, content)
    return reply


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    arrays = to_numpy(message.content["arrays"])
    total = float(sum(np.sum(v) for v in arrays.values()))
    metrics = MetricRecord({"num-examples": 1, "total": total, "pid": _partition(context)})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    draw = float(client_secret(context.node_config).generator(0, Purpose.NOISE).random())
    metrics = MetricRecord({"pid": _partition(context), "secret-draw": draw})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)
