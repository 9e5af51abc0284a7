"""A Flower ClientApp from any :class:`~fedsim.workloads.training.ClientTraining`.

:func:`training_app` returns a real :class:`flwr.clientapp.ClientApp` with ``@app.train()``
and ``@app.evaluate()`` handlers, usable on fedsim's engine and on Flower's own runtime alike.
Each handler reads its client's rows from the federated dataset
(``context.node_config["partition-id"]``), loads the instruction's arrays into the training's
model (one per worker process) and calls its ``train``; the shuffling stream is
:func:`~fedsim.workloads.training.client_generator` of ``(seed, server_round, partition)``,
so a client's update depends only on the global model, the round and the seed.

Train replies carry the arrays under the instruction's key and a ``metrics`` record:
``num-examples`` (training rows, FedAvg's weight), ``train_loss`` (mean over steps, unless the
training withholds it), ``steps`` and the training's own metrics, plus the records of arrays
a client method returns for its server half (the instruction's records the training
declares come to it as ``TrainTask.inputs``, :mod:`fedsim.workloads.client_method`). An
instruction whose config
has ``proximal-mu > 0`` (Flower's FedProx) is refused by trainings that add no proximal term.
Evaluate replies carry loss and accuracy on the client's test rows (its training rows when it
has none), and the conformal scores when the server asks for them
(:mod:`strategies.methods.conformal`).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedsim.data import DatasetSpec, cached_dataset
from fedsim.record_codec import records_of, to_numpy, to_record
from fedsim.workloads.conformal import SCORES_RECORD, SCORES_REQUEST, score_reply_record
from fedsim.workloads.training import (
    ClientTraining,
    TrainTask,
    as_tensors,
    client_generator,
    evaluate_model,
)


def instruction_config(message: Message) -> ConfigRecord:
    """The instruction's config (FedAvg's "config" record; empty if none)."""
    records = records_of(message.content, ConfigRecord)
    for key, record in records:
        if key == "config":
            return record
    return records[0][1] if records else ConfigRecord()


def arrays_key(message: Message, inputs: tuple[str, ...] = ()) -> str:
    """The key of the instruction's one ArrayRecord (the global arrays) besides the
    ``inputs`` a client method's server half added."""
    keys = [key for key, _ in records_of(message.content, ArrayRecord) if key not in inputs]
    if len(keys) != 1:
        raise ValueError(f"expected one ArrayRecord in the instruction, found {len(keys)}")
    return keys[0]


def method_inputs(message: Message, inputs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The records ``inputs`` of the instruction (a client method's server half sent them);
    ValueError naming the missing key when the server did not."""
    missing = [key for key in inputs if key not in message.content]
    if missing:
        raise ValueError(
            f"the train instruction carries no record {missing[0]!r}: this client training "
            "needs its method's server half on the server (run it with fedsim run)"
        )
    return {key: to_numpy(message.content[key]) for key in inputs}


def train_task(
    message: Message, context: Context, data: DatasetSpec, inputs: tuple[str, ...] = ()
) -> TrainTask:
    """Read a train message for the client of ``context`` (``inputs``: the records of
    :func:`method_inputs` it carries)."""
    partition = int(context.node_config["partition-id"])
    x, y = as_tensors(*cached_dataset(data).train.client(partition))
    config = instruction_config(message)
    lr: Any = config.get("lr")
    return TrainTask(
        partition=partition,
        x=x,
        y=y,
        server_round=int(config.get("server-round", 0)),
        lr=float(lr) if isinstance(lr, (int, float)) else None,
        proximal_mu=float(config.get("proximal-mu", 0.0)),
        node_config=context.node_config,
        inputs=method_inputs(message, inputs),
    )


def evaluation_rows(
    data: DatasetSpec, partition: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition``'s evaluation rows on ``device``: its test rows, else its training
    rows."""
    dataset = cached_dataset(data)
    split = dataset.test if dataset.test.sizes()[partition] > 0 else dataset.train
    x, y = as_tensors(*split.client(partition))
    return x.to(device), y.to(device)


def evaluation_reply(
    message: Message,
    net: nn.Module,
    data: DatasetSpec,
    partition: int,
    extra: dict[str, float],
    device: str = "cpu",
) -> Message:
    """The evaluate reply: loss, accuracy and ``extra`` metrics on the client's evaluation
    rows (moved to ``device``, the model's), plus the conformal scores when the server asks
    for them."""
    x, y = evaluation_rows(data, partition, device)
    metrics = MetricRecord({"num-examples": int(len(y)), **evaluate_model(net, x, y), **extra})
    content = RecordDict({"metrics": metrics})
    if instruction_config(message).get(SCORES_REQUEST):
        content[SCORES_RECORD] = score_reply_record(net, x, y, partition)
    return Message(content=content, reply_to=message)


def training_app(training: ClientTraining, data: DatasetSpec) -> ClientApp:
    """A ClientApp whose clients train with ``training`` on ``data``'s rows."""
    app = ClientApp(mods=training.mods())

    @app.train()
    def train(message: Message, context: Context) -> Message:
        task = train_task(message, context, data, training.inputs).to(training.device)
        if task.proximal_mu > 0 and not training.proximal:
            raise ValueError(
                f"proximal-mu = {task.proximal_mu} (FedProx) is not supported with "
                f"{training.name}: expected 0"
            )
        key = arrays_key(message, training.inputs)
        net = training.model()
        training.load(net, to_numpy(message.content[key]))
        generator = client_generator(training.steps.seed, task.server_round, task.partition)
        result = training.train(net, task, generator, context.state)
        metrics = MetricRecord({"num-examples": int(len(task.y))})
        if result.loss is not None:
            metrics["train_loss"] = result.loss
        metrics["steps"] = result.steps
        for name, value in result.metrics.items():
            metrics[name] = value
        upload = training.arrays(net) if result.upload is None else result.upload
        content = RecordDict({key: to_record(upload), "metrics": metrics})
        for name, record in result.replies.items():
            content[name] = to_record(record)
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        net = training.evaluation_model()
        training.load(net, to_numpy(message.content[arrays_key(message)]))
        extra = training.evaluation_metrics(net, data, partition)
        return evaluation_reply(message, net, data, partition, extra, training.device)

    return app
