"""Local training with a method plugged in: optimiser, iterate averaging, upload quantisation.

:class:`ClientMethods` names the methods (each optional):

* ``optimizer`` — :class:`~fedsim.workloads.optim.ClientOptimizer` (MARS-AdamW,
  MARS-Lion, R-AdaZO, ZO-AdaMM, or SGD); a fresh optimiser per round, so its
  state resets with every new global model (see :mod:`fedsim.workloads.optim.mars`);
* ``averaging`` — :class:`~fedsim.workloads.averaging.Averaging` of the local
  iterates (LAWA / EMA over the round's step budget); the client trains the raw
  weights and uploads the average;
* ``compression`` — :class:`~fedsim.workloads.compression.Quantization` of the
  upload (:mod:`fedsim.workloads.upload`; the server side is
  ``strategies.quantized.DequantizedUploads``).

:func:`train_with_methods` is the training loop and :func:`make_methods_client_app`
the ClientApp (same data, seeding and replies as
:func:`fedsim.workloads.supervised.make_client_app`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedsim.config import from_mapping
from fedsim.data import DatasetSpec, cached_dataset
from fedsim.models import ModelSpec, load_arrays, model_arrays
from fedsim.records import to_numpy, to_record
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.compression import Quantization
from fedsim.workloads.optim.choice import ClientOptimizer, build_optimizer
from fedsim.workloads.supervised import (
    LocalTraining,
    _arrays_key,
    _config,
    as_tensors,
    cached_model,
    client_generator,
    evaluate_model,
)
from fedsim.workloads.upload import quantized_upload


@dataclass(frozen=True, kw_only=True)
class ClientMethods:
    """Methods applied on top of :class:`~fedsim.workloads.supervised.LocalTraining`."""

    optimizer: ClientOptimizer | dict[str, Any] | None = None
    averaging: Averaging | dict[str, Any] | None = None
    compression: Quantization | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for key, cls in (
            ("optimizer", ClientOptimizer),
            ("averaging", Averaging),
            ("compression", Quantization),
        ):
            value = getattr(self, key)
            if isinstance(value, dict):
                made = (
                    Averaging.from_table(value, "client.averaging")
                    if cls is Averaging
                    else from_mapping(cls, value, f"client.{key}")
                )
                object.__setattr__(self, key, made)


def step_budget(rows: int, training: LocalTraining) -> int:
    """Steps one round of ``training`` takes on ``rows`` examples."""
    steps = training.epochs * math.ceil(rows / training.batch_size)
    return min(steps, training.max_steps) if training.max_steps else steps


def train_with_methods(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalTraining,
    methods: ClientMethods,
    generator: torch.Generator,
    *,
    lr: float | None = None,
) -> tuple[float, int, dict[str, Any] | None]:
    """Minibatch training with ``methods``; returns (mean loss, steps, averaged arrays or None).

    ``generator`` draws the shuffling and, for zeroth-order optimisers, the
    directions; ``lr`` (the instruction's ``lr``) overrides the optimiser's.
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    choice = methods.optimizer or ClientOptimizer(name="sgd", weight_decay=training.weight_decay)
    if lr is not None:
        choice = ClientOptimizer(**{**choice.__dict__, "lr": lr})
    optimizer = build_optimizer(
        choice, params, generator=generator, sgd_lr=training.lr, momentum=training.momentum
    )
    budget = max(step_budget(len(y), training), 1)
    averager = methods.averaging.for_budget(budget) if methods.averaging is not None else None
    steps, total, n = 0, 0.0, len(y)
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, training.batch_size):
            if training.max_steps and steps >= training.max_steps:
                break
            idx = order[start : start + training.batch_size]
            xb, yb = x[idx], y[idx]
            if choice.zeroth_order:
                loss = optimizer.step(
                    lambda xb=xb, yb=yb: nn.functional.cross_entropy(model(xb), yb)
                )
            else:
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
            total += float(loss.detach())
            steps += 1
            if averager is not None and averager.due(steps):
                averager.push(model_arrays(model))
    averaged = averager.average() if averager is not None and averager.ready else None
    return (total / steps if steps else 0.0), steps, averaged


def make_methods_client_app(
    model: ModelSpec, data: DatasetSpec, training: LocalTraining, methods: ClientMethods
) -> ClientApp:
    """A ClientApp training ``model`` on ``data``'s clients with ``methods``."""
    if training.dp_sgd is not None or training.keep_momentum:
        raise ValueError(
            "client.dp_sgd and client.keep_momentum are not combined with client methods"
        )
    mods = (
        [quantized_upload(methods.compression, base_seed=training.seed)]
        if methods.compression is not None
        else []
    )
    app = ClientApp(mods=mods)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        x, y = as_tensors(*cached_dataset(data).train.client(partition))
        key = _arrays_key(message)
        config = _config(message)
        server_round = int(config.get("server-round", 0))
        lr: Any = config.get("lr")
        if float(config.get("proximal-mu", 0.0)) > 0:
            raise ValueError(
                "proximal-mu > 0 (FedProx) is not supported with client optimizer, "
                "averaging or compression methods"
            )
        net = cached_model(model)
        load_arrays(net, to_numpy(message.content[key]))
        loss, steps, averaged = train_with_methods(
            net,
            x,
            y,
            training,
            methods,
            client_generator(training.seed, server_round, partition),
            lr=float(lr) if isinstance(lr, (int, float)) else None,
        )
        upload = averaged if averaged is not None else model_arrays(net)
        metrics = MetricRecord({"num-examples": int(len(y)), "train_loss": loss, "steps": steps})
        content = RecordDict({key: to_record(upload), "metrics": metrics})
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        dataset = cached_dataset(data)
        split = dataset.test if dataset.test.sizes()[partition] > 0 else dataset.train
        x, y = as_tensors(*split.client(partition))
        net = cached_model(model)
        load_arrays(net, to_numpy(message.content[_arrays_key(message)]))
        metrics = MetricRecord({"num-examples": int(len(y)), **evaluate_model(net, x, y)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=message)

    return app
