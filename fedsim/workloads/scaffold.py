"""SCAFFOLD: stochastic controlled averaging (Karimireddy et al., ICML 2020, Algorithm 1), as
the client method ``[client.scaffold]`` (both halves, :mod:`fedsim.workloads.client_method`).

The server half keeps a control variate c (zeros at first, one array per model array) and
sends it with the global model x under :data:`KEY`. Each client corrects every local SGD
step's gradient by ``c - c_i`` (line 10) and updates its own c_i by option II
(line 12: ``c_i+ = c_i - c + (x - y_i) / (K * lr)``, K the steps taken), kept in its
``context.state`` (:data:`CLIENT_STATE`); it replies its trained model y_i and
``delta c_i = c_i+ - c_i`` under :data:`KEY`. The server applies (lines 16-17)
``x <- x + eta_g * (mean(y_i) - x)`` (the wrapped strategy's mean, FedAvg's
``num-examples``-weighted one) and ``c <- c + |S| / N * mean(delta c_i)`` (unweighted, N the
registered clients). Table keys: ``server_lr`` (eta_g, 1.0). Plain SGD only; no privacy claim
(the server reads each delta c_i), so only with strategies without privacy accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim.config import require
from fedsim.models import model_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.client_method import Arrays, ClientMethod, ServerHalf
from fedsim.workloads.sgd import sgd_optimizer
from fedsim.workloads.training import (
    ClientTraining,
    Exclusion,
    TrainResult,
    TrainTask,
    minibatches,
)

#: the record of the server's c in a train instruction, and of delta c_i in its reply
KEY = "scaffold"
#: the client's own control variate c_i in its ``context.state`` (kept across rounds)
CLIENT_STATE = "fedsim.scaffold.ci"
_ALONE = "unset with client.scaffold (SCAFFOLD corrects plain SGD steps)"


@dataclass(frozen=True)
class Scaffold:
    """``[client.scaffold]``: ``server_lr`` is eta_g (Algorithm 1, line 16)."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        require(self.server_lr > 0, "client.scaffold.server_lr", self.server_lr, "a number > 0")


def corrected_sgd(
    model: nn.Module, task: TrainTask, training: ScaffoldTraining, generator: torch.Generator,
    shift: dict[str, np.ndarray],
) -> tuple[float, int]:  # fmt: skip
    """Minibatch SGD on the task's rows with ``shift`` (``c - c_i``, by parameter name) added
    to every step's gradient; returns (mean loss, steps)."""
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    shifts = [torch.from_numpy(np.asarray(shift[k], np.float32)).to(p.device) for k, p in named]
    optimizer = sgd_optimizer(params, training.steps, task.lr, None)
    steps, total = 0, torch.zeros((), device=task.y.device)
    s = training.steps
    for idx in minibatches(
        len(task.y), s.batch_size, generator, epochs=s.epochs, max_steps=s.max_steps
    ):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(task.x[idx]), task.y[idx])
        loss.backward()
        for p, g in zip(params, shifts, strict=True):
            p.grad.add_(g)
        optimizer.step()
        total += loss.detach()
        steps += 1
    return (float(total) / steps if steps else 0.0), steps


class ScaffoldTraining(ClientTraining):
    """SCAFFOLD's client (module docstring): corrected SGD, c_i kept, delta c_i replied."""

    name = "SCAFFOLD"
    inputs = (KEY,)

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        server = task.inputs[KEY]
        saved = to_numpy(state[CLIENT_STATE]) if CLIENT_STATE in state else {}
        own = {k: np.asarray(saved.get(k, np.zeros_like(v)), np.float32) for k, v in server.items()}
        start = {k: v.copy() for k, v in model_arrays(model).items()}
        shift = {k: server[k] - own[k] for k in server}
        loss, steps = corrected_sgd(model, task, self, generator, shift)
        lr = self.steps.lr if task.lr is None else task.lr
        new = model_arrays(model)
        updated = {
            k: own[k] - server[k] + (start[k] - new[k]) / (max(steps, 1) * lr) for k in server
        }
        state[CLIENT_STATE] = to_record(updated)
        delta = {k: (updated[k] - own[k]).astype(np.float32) for k in server}
        return TrainResult(loss, steps, replies={KEY: delta})


class ScaffoldServer(ServerHalf):
    """SCAFFOLD's server (module docstring): keeps c, sends it, steps x and c."""

    key = KEY

    def __init__(self, options: Scaffold, population: int) -> None:
        self.server_lr, self.population = options.server_lr, population
        self.control: Arrays | None = None
        self.sent: Arrays = {}

    def instruction(self, server_round: int, arrays: Arrays) -> Arrays:
        self.sent = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
        if self.control is None:
            self.control = {k: np.zeros_like(v) for k, v in self.sent.items()}
        return {k: v.astype(np.float32) for k, v in self.control.items()}

    def aggregate(self, server_round: int, replies: list[Arrays], new: Arrays) -> Arrays:
        step = len(replies) / self.population
        for k, value in self.control.items():
            value += step * np.mean([np.asarray(r[k], np.float64) for r in replies], axis=0)
        return {
            k: (x + self.server_lr * (np.asarray(new[k], np.float64) - x)).astype(new[k].dtype)
            for k, x in self.sent.items()
        }


METHOD = ClientMethod(
    key="scaffold",
    table=Scaffold,
    excludes=tuple(
        Exclusion(feature, _ALONE)
        for feature in (
            "dp_sgd",
            "optimizer",
            "averaging",
            "compression",
            "conformal",
            "sst",
            "constraints",
            "lora",
            "keep_momentum",
            "fedprox",
        )
    ),  # fmt: skip
    training=lambda model, steps, table: ScaffoldTraining(model, steps),
    server=ScaffoldServer,
    example={"server_lr": 1.0},
)
