"""Local training with methods plugged in: optimiser, iterate averaging, upload quantisation,
conformal training, sparse spectral training.

:class:`MethodsTraining` composes the ``[client]`` tables (each optional):

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
  ``strategies.methods.quantized.DequantizedUploads``);
* ``conformal`` — :class:`~fedsim.workloads.conformal.ConformalTraining`: the
  DPSM objective (cross-entropy plus a soft prediction-set size at a learned
  quantile tau, which each client keeps in its ``context.state``). Not with
  zeroth-order or full-batch optimisers;
* ``sst`` — :class:`~fedsim.workloads.sst.SparseSpectral`: sparse spectral training
  of every Linear layer (all singular values, ``rank`` sampled singular-vector pairs
  per period, periodic re-SVD) from the SVD of the received global weights; the
  client uploads the dense weights. Gradient optimisers only, no averaging.

:func:`train_with_methods` is the training loop (LoRA clients reuse it with an optimiser
only); :data:`EXCLUDES` says what each table cannot be combined with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict
from flwr.clientapp.typing import Mod
from torch import nn

from fedsim.models import ModelSpec, model_arrays
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.compression import Quantization
from fedsim.workloads.conformal import DPSM, TAU_STATE, ConformalTraining
from fedsim.workloads.optim.choice import ClientOptimizer, build_optimizer
from fedsim.workloads.sst import SparseSpectral, SparseSpectralTraining
from fedsim.workloads.training import (
    ClientTraining,
    Exclusion,
    LocalSteps,
    TrainResult,
    TrainTask,
    minibatches,
)
from fedsim.workloads.upload import quantized_upload

_NOT_WITH_DP = "unset when client.dp_sgd or client.keep_momentum is set"
_NO_PROXIMAL = "unset with FedProx (client methods add no proximal term)"


def _plain() -> tuple[Exclusion, ...]:
    """What every client method refuses: DP-SGD, kept momentum and FedProx."""
    return (
        Exclusion("dp_sgd", _NOT_WITH_DP),
        Exclusion("keep_momentum", _NOT_WITH_DP),
        Exclusion("fedprox", _NO_PROXIMAL),
    )


EXCLUDES = {
    "optimizer": _plain(),
    "averaging": _plain(),
    "compression": _plain(),
    "conformal": (
        *_plain(),
        Exclusion(
            "whole-batch-optimizer",
            "a minibatch gradient optimiser with client.conformal (DPSM splits each batch)",
            named="optimizer.name",
        ),
    ),
    "sst": (
        *(
            Exclusion(key, "unset with client.dp_sgd, client.keep_momentum or client.lora")
            for key in ("dp_sgd", "keep_momentum", "lora")
        ),
        Exclusion(
            "whole-batch-optimizer",
            "a gradient optimiser (sgd, mars-adamw, mars-lion) with client.sst",
            named="optimizer.name",
        ),
        Exclusion("averaging", "unset with client.sst", named="averaging"),
        Exclusion("fedprox", _NO_PROXIMAL),
    ),
}
"""What each client method's table cannot be combined with (checked by
:func:`fedsim.workloads.supervised.check_parts`)."""


def _gradient_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    xb: torch.Tensor,
    yb: torch.Tensor,
    objective: DPSM | None,
    after_step: Callable[[torch.optim.Optimizer], object] | None,
) -> torch.Tensor:
    """One gradient step on the minibatch (``objective``'s loss; None: cross-entropy);
    returns its loss."""
    opt.zero_grad(set_to_none=True)
    out = model(xb)
    if objective is not None:
        loss = objective.loss(out, yb)
    else:
        loss = nn.functional.cross_entropy(out, yb)
    loss.backward()
    opt.step()
    if after_step is not None:
        after_step(opt)
    return loss


def train_with_methods(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    generator: torch.Generator,
    *,
    optimizer: ClientOptimizer | None = None,
    averaging: Averaging | None = None,
    sst: SparseSpectral | None = None,
    lr: float | None = None,
    objective: DPSM | None = None,
    before_step: Callable[[int], object] | None = None,
    after_step: Callable[[torch.optim.Optimizer], object] | None = None,
) -> tuple[float, int, dict[str, Any] | None]:
    """Minibatch training with the given methods; returns (mean loss, steps, averaged arrays).

    ``generator`` draws the shuffling and, for zeroth-order optimisers, the directions (and
    SST's pair draws); ``lr`` (the instruction's ``lr``) overrides the optimiser's.
    ``objective`` is the DPSM loss (with its tau) of conformal training; None: cross-entropy.
    ``before_step(step)`` runs before each step (CoTo's layer activation,
    :mod:`fedsim.workloads.coto`); ``after_step(optimizer)`` after each gradient step. With
    ``sst`` the steps train a spectral copy of ``model`` (:mod:`fedsim.workloads.sst`) whose
    dense weights are written back into ``model`` at the end.
    """
    if sst is not None:
        spectral = SparseSpectralTraining(model, sst, generator)
        result = train_with_methods(
            spectral.model, x, y, training, generator, optimizer=optimizer, averaging=averaging,
            lr=lr, objective=objective, before_step=before_step, after_step=spectral.after_step,
        )  # fmt: skip
        spectral.export(model)
        return result
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    choice = optimizer or ClientOptimizer(name="sgd", weight_decay=training.weight_decay)
    if lr is not None:
        choice = ClientOptimizer(**{**choice.__dict__, "lr": lr})
    opt = build_optimizer(
        choice, params, generator=generator, sgd_lr=training.lr, momentum=training.momentum
    )
    budget = max(training.budget(len(y)), 1)
    averager = averaging.for_budget(budget) if averaging is not None else None
    steps, total, epochs, cap = 0, 0.0, training.epochs, training.max_steps
    for idx in minibatches(len(y), training.batch_size, generator, epochs=epochs, max_steps=cap):
        xb, yb = x[idx], y[idx]
        if before_step is not None:
            before_step(steps)
        if choice.full_batch:  # HDM-HB: every step sees all the client's rows
            loss = opt.step(lambda: _full_batch_loss(model, opt, x, y))
        elif choice.zeroth_order:
            loss = opt.step(lambda xb=xb, yb=yb: nn.functional.cross_entropy(model(xb), yb))
        else:
            loss = _gradient_step(model, opt, xb, yb, objective, after_step)
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


class MethodsTraining(ClientTraining):
    """Local training with client methods: an optimiser, iterate averaging (whose average is
    uploaded), quantised uploads (a Flower mod), conformal training (tau kept in the
    client's ``context.state``, :data:`~fedsim.workloads.conformal.TAU_STATE`) and SST."""

    name = "client optimizer, averaging or compression methods"

    def __init__(
        self,
        spec: ModelSpec,
        steps: LocalSteps,
        *,
        optimizer: ClientOptimizer | None = None,
        averaging: Averaging | None = None,
        compression: Quantization | None = None,
        conformal: ConformalTraining | None = None,
        sst: SparseSpectral | None = None,
    ) -> None:
        super().__init__(spec, steps)
        self.optimizer, self.averaging, self.compression = optimizer, averaging, compression
        self.conformal, self.sst = conformal, sst

    def mods(self) -> list[Mod]:
        if self.compression is None:
            return []
        return [quantized_upload(self.compression, base_seed=self.steps.seed)]

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        objective = None
        if self.conformal is not None:
            saved = state.get(TAU_STATE)
            objective = DPSM(self.conformal, None if saved is None else saved["tau"])
        loss, steps, averaged = train_with_methods(
            model,
            task.x,
            task.y,
            self.steps,
            generator,
            optimizer=self.optimizer,
            averaging=self.averaging,
            sst=self.sst,
            lr=task.lr,
            objective=objective,
        )
        metrics: dict[str, float | int] = {}
        if objective is not None:
            state[TAU_STATE] = MetricRecord({"tau": objective.tau})
            metrics["dpsm-tau"] = objective.tau
            metrics["dpsm-size"] = objective.last_size
        return TrainResult(loss, steps, metrics, upload=averaged)
