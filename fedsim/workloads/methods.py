"""Local training with a method plugged in: optimiser, iterate averaging, upload quantisation.

:class:`ClientMethods` names the methods (each optional):

* ``optimizer`` — :class:`~fedsim.workloads.optim.ClientOptimizer` (MARS-AdamW,
  MARS-Lion, R-AdaZO, ZO-AdaMM, HDM-HB, or SGD); a fresh optimiser per round, so its
  state resets with every new global model (see :mod:`fedsim.workloads.optim.mars`);
  HDM-HB is full batch: the round keeps its step budget (epochs x batches, capped by
  ``max_steps``) but every step evaluates the loss on all the client's rows;
* ``averaging`` — :class:`~fedsim.workloads.averaging.Averaging` of the local
  iterates (LAWA / EMA over the round's step budget); the client trains the raw
  weights and uploads the average;
* ``compression`` — :class:`~fedsim.workloads.compression.Quantization` of the
  upload (:mod:`fedsim.workloads.upload`; the server side is
  ``strategies.quantized.DequantizedUploads``);
* ``conformal`` — :class:`~fedsim.workloads.conformal.ConformalTraining`: the
  DPSM objective (cross-entropy plus a soft prediction-set size at a learned
  quantile tau, which each client keeps in its ``context.state``). Not with
  zeroth-order or full-batch optimisers;
* ``sst`` — :class:`~fedsim.workloads.sst.SparseSpectral`: sparse spectral training
  of every Linear layer (all singular values, ``rank`` sampled singular-vector pairs
  per period, periodic re-SVD) from the SVD of the received global weights; the
  client uploads the dense weights. Gradient optimisers only, no averaging.

:func:`train_with_methods` is the training loop and :func:`make_methods_client_app`
the ClientApp (same data, seeding and replies as
:func:`fedsim.workloads.supervised.make_client_app`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedsim.config import ConfigError, from_mapping
from fedsim.data import DatasetSpec
from fedsim.models import ModelSpec, load_arrays, model_arrays
from fedsim.records import to_numpy, to_record
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.compression import Quantization
from fedsim.workloads.conformal import (
    DPSM,
    TAU_STATE,
    ConformalTraining,
)
from fedsim.workloads.optim.choice import ClientOptimizer, build_optimizer
from fedsim.workloads.sst import SparseSpectral, SparseSpectralTraining
from fedsim.workloads.supervised import (
    LocalTraining,
    cached_model,
    client_generator,
    model_evaluation,
    train_instruction,
)
from fedsim.workloads.upload import quantized_upload


@dataclass(frozen=True, kw_only=True)
class ClientMethods:
    """Methods applied on top of :class:`~fedsim.workloads.supervised.LocalTraining`."""

    optimizer: ClientOptimizer | dict[str, Any] | None = None
    averaging: Averaging | dict[str, Any] | None = None
    compression: Quantization | dict[str, Any] | None = None
    conformal: ConformalTraining | dict[str, Any] | None = None
    sst: SparseSpectral | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.conformal, dict):
            made = from_mapping(ConformalTraining, self.conformal, "client.conformal")
            object.__setattr__(self, "conformal", made)
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
        if self.conformal is not None and isinstance(self.optimizer, ClientOptimizer):
            if self.optimizer.zeroth_order or self.optimizer.full_batch:
                raise ValueError(
                    f"client.optimizer.name = {self.optimizer.name!r} is not allowed with "
                    "client.conformal: a minibatch gradient optimiser (DPSM splits each batch)"
                )
        self._check_sst()

    def _check_sst(self) -> None:
        """``[client.sst]``: a gradient optimiser on minibatches, no iterate averaging."""
        if isinstance(self.sst, dict):
            object.__setattr__(self, "sst", from_mapping(SparseSpectral, self.sst, "client.sst"))
        if self.sst is None:
            return
        if isinstance(self.optimizer, ClientOptimizer) and (
            self.optimizer.zeroth_order or self.optimizer.full_batch
        ):
            raise ConfigError(
                "client.optimizer.name",
                self.optimizer.name,
                "a gradient optimiser (sgd, mars-adamw, mars-lion) with client.sst",
            )
        if self.averaging is not None:
            raise ConfigError("client.averaging", str(self.averaging), "unset with client.sst")


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
    objective: DPSM | None = None,
    before_step: Callable[[int], object] | None = None,
    after_step: Callable[[torch.optim.Optimizer], object] | None = None,
) -> tuple[float, int, dict[str, Any] | None]:
    """Minibatch training with ``methods``; returns (mean loss, steps, averaged arrays or None).

    ``generator`` draws the shuffling and, for zeroth-order optimisers, the
    directions; ``lr`` (the instruction's ``lr``) overrides the optimiser's.
    ``objective`` is the DPSM loss (with its tau) when ``methods.conformal`` is
    set; None builds one at ``initial_tau``. ``before_step(step)`` runs before
    each step (CoTo's layer activation, :mod:`fedsim.workloads.coto`);
    ``after_step(optimizer)`` after each gradient step. With ``methods.sst`` the
    steps train a spectral copy of ``model`` (:mod:`fedsim.workloads.sst`) whose
    dense weights are written back into ``model`` at the end.
    """
    if isinstance(methods.sst, SparseSpectral):
        sst = SparseSpectralTraining(model, methods.sst, generator)
        result = train_with_methods(
            sst.model,
            x,
            y,
            training,
            replace(methods, sst=None),
            generator,
            lr=lr,
            objective=objective,
            before_step=before_step,
            after_step=sst.after_step,
        )
        sst.export(model)
        return result
    if objective is None and isinstance(methods.conformal, ConformalTraining):
        objective = DPSM(methods.conformal)
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
            if before_step is not None:
                before_step(steps)
            if choice.full_batch:  # HDM-HB: every step sees all the client's rows
                loss = optimizer.step(lambda: _full_batch_loss(model, optimizer, x, y))
            elif choice.zeroth_order:
                loss = optimizer.step(
                    lambda xb=xb, yb=yb: nn.functional.cross_entropy(model(xb), yb)
                )
            else:
                optimizer.zero_grad(set_to_none=True)
                if objective is not None:
                    loss = objective.loss(model(xb), yb)
                else:
                    loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                if after_step is not None:
                    after_step(optimizer)
            total += float(loss.detach())
            steps += 1
            if averager is not None and averager.due(steps):
                averager.push(model_arrays(model))
    averaged = averager.average() if averager is not None and averager.ready else None
    return (total / steps if steps else 0.0), steps, averaged


def _full_batch_loss(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The closure of a full-batch optimiser: loss on all of (x, y), gradients filled."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


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
        task = train_instruction(
            message, context, data, no_proximal="client optimizer, averaging or compression methods"
        )
        partition, x, y, key = task.partition, task.x, task.y, task.key
        server_round, lr = task.server_round, task.lr
        net = cached_model(model)
        load_arrays(net, to_numpy(message.content[key]))
        objective = None
        if isinstance(methods.conformal, ConformalTraining):
            saved = context.state.get(TAU_STATE)
            objective = DPSM(methods.conformal, None if saved is None else saved["tau"])
        loss, steps, averaged = train_with_methods(
            net,
            x,
            y,
            training,
            methods,
            client_generator(training.seed, server_round, partition),
            lr=lr,
            objective=objective,
        )
        upload = averaged if averaged is not None else model_arrays(net)
        metrics = MetricRecord({"num-examples": int(len(y)), "train_loss": loss, "steps": steps})
        if objective is not None:
            context.state[TAU_STATE] = MetricRecord({"tau": objective.tau})
            metrics["dpsm-tau"] = objective.tau
            metrics["dpsm-size"] = objective.last_size
        content = RecordDict({key: to_record(upload), "metrics": metrics})
        return Message(content=content, reply_to=message)

    app.evaluate()(model_evaluation(model, data))

    return app
