"""Plain local SGD, optionally with FedProx's proximal term and momentum kept across rounds.

Minibatch ``torch.optim.SGD`` over the client's rows (:func:`train_epochs`). If the
instruction's config has ``proximal-mu`` (Flower's FedProx sets it), the FedProx term
``mu/2 * ||w - w_global||^2`` (Li et al. 2020, eq. 2) is added to the loss. With
``keep_momentum`` each client keeps its SGD momentum buffers in its ``context.state``
(:data:`MOMENTUM_STATE`) from one round to the next; DP-SGD shares these helpers.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.training import (
    ClientTraining,
    LocalSteps,
    TrainResult,
    TrainTask,
    minibatches,
)

MOMENTUM_STATE = "fedsim.momentum"


def sgd_optimizer(
    params: list[nn.Parameter],
    steps: LocalSteps,
    lr: float | None,
    momentum_buffers: list[np.ndarray] | None,
) -> torch.optim.SGD:
    """``torch.optim.SGD`` with ``steps``' settings (``lr`` overrides its lr), its momentum
    started from ``momentum_buffers`` (one per parameter) when there are any."""
    optimizer = torch.optim.SGD(
        params,
        lr=steps.lr if lr is None else lr,
        momentum=steps.momentum,
        weight_decay=steps.weight_decay,
    )
    if momentum_buffers:
        for p, buf in zip(params, momentum_buffers, strict=True):
            optimizer.state[p]["momentum_buffer"] = torch.from_numpy(np.array(buf)).to(p.device)
    return optimizer


def final_buffers(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[np.ndarray]:
    """SGD's momentum buffers after a round (zeros for a parameter that never stepped)."""
    return [
        optimizer.state[p]["momentum_buffer"].cpu().numpy().copy()
        if "momentum_buffer" in optimizer.state[p]
        else np.zeros(tuple(p.shape), np.float32)
        for p in params
    ]


def load_momentum(state: RecordDict) -> list[np.ndarray]:
    """The client's momentum buffers from earlier rounds (empty on its first)."""
    if MOMENTUM_STATE not in state:
        return []
    saved = to_numpy(state[MOMENTUM_STATE])
    return [saved[f"m{i}"] for i in range(len(saved))]


def store_momentum(state: RecordDict, buffers: list[np.ndarray]) -> None:
    """Keep the client's momentum buffers for its next round."""
    state[MOMENTUM_STATE] = to_record({f"m{i}": b for i, b in enumerate(buffers)})


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    generator: torch.Generator,
    *,
    lr: float | None = None,
    proximal_mu: float = 0.0,
    momentum_buffers: list[np.ndarray] | None = None,
) -> tuple[float, int]:
    """Minibatch SGD on (x, y); returns (mean training loss, steps taken).

    ``momentum_buffers`` (one per parameter) start SGD's momentum where a
    previous round left it, and are overwritten with the final buffers.
    """
    model.train()
    params = list(model.parameters())
    optimizer = sgd_optimizer(params, training, lr, momentum_buffers)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
    steps = 0
    total = torch.zeros((), device=y.device)
    for idx in minibatches(
        len(y),
        training.batch_size,
        generator,
        epochs=training.epochs,
        max_steps=training.max_steps,
    ):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        if anchor is not None:
            prox = sum(
                ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
            )
            loss = loss + 0.5 * proximal_mu * prox
        loss.backward()
        optimizer.step()
        total += loss.detach()
        steps += 1
    if momentum_buffers is not None:
        momentum_buffers[:] = final_buffers(optimizer, params)
    return (float(total) / steps if steps else 0.0), steps


class SGDTraining(ClientTraining):
    """Plain local SGD (the default training): honours FedProx's ``proximal-mu`` and keeps
    momentum across rounds with ``keep_momentum``."""

    name = "plain SGD"
    proximal = True

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        buffers = load_momentum(state) if self.steps.keep_momentum else None
        loss, steps = train_epochs(
            model,
            task.x,
            task.y,
            self.steps,
            generator,
            lr=task.lr,
            proximal_mu=task.proximal_mu,
            momentum_buffers=buffers,
        )
        if buffers is not None:
            store_momentum(state, buffers)
        return TrainResult(loss, steps)
