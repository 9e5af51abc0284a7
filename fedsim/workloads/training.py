"""The client training interface: ``train(model, task, generator, state) -> TrainResult``.

Every way a supervised client trains (plain SGD, DP-SGD, constrained, LoRA, the client
methods) is a :class:`ClientTraining`: it names the model it trains (built once per worker
process, weights overwritten per client), how global arrays go in and come out, and its
:meth:`~ClientTraining.train` step. :mod:`fedsim.workloads.client_app` turns any of them into a
Flower ClientApp; :mod:`fedsim.workloads.supervised` picks one from the ``[client]`` table and
checks, in one place, the :class:`Exclusion` s each part declares.

Randomness: ``generator`` is the client's public shuffling stream of the round,
:func:`client_generator` (``SeedSequence([seed, server_round, partition_id])``); a
client's secrets (DP-SGD's batches and noise) come from its own
:class:`~fedsim.randomness.PartySecret`, :meth:`TrainTask.secret`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.clientapp.typing import Mod
from torch import nn

from fedsim.config import require
from fedsim.data import DatasetSpec
from fedsim.models import ModelSpec, build_model, load_arrays, model_arrays, place
from fedsim.randomness import PartySecret, client_secret


@dataclass(frozen=True, kw_only=True)
class LocalSteps:
    """The step schedule every local training shares (the plain keys of ``[client]``).

    Attributes:
        epochs: passes over the client's training rows per round.
        batch_size: examples per step.
        lr: learning rate (a ``lr`` key in the instruction's config overrides it).
        momentum, weight_decay: torch.optim.SGD's.
        max_steps: cap on steps per round (0: no cap).
        keep_momentum: keep each client's momentum buffers in its ``context.state`` from one
            round to the next (a stateful client; needs ``momentum > 0``).
        seed: root seed of the clients' shuffling (:func:`client_generator`).
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_steps: int = 0
    keep_momentum: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.epochs >= 1, "client.epochs", self.epochs, "an integer >= 1")
        require(self.batch_size >= 1, "client.batch_size", self.batch_size, "an integer >= 1")
        require(self.lr > 0, "client.lr", self.lr, "a number > 0")
        require(0 <= self.momentum < 1, "client.momentum", self.momentum, "a number in [0, 1)")
        require(self.weight_decay >= 0, "client.weight_decay", self.weight_decay, "a number >= 0")
        require(
            self.max_steps >= 0, "client.max_steps", self.max_steps, "an integer >= 0 (0: no cap)"
        )
        require(
            not self.keep_momentum or self.momentum > 0,
            "client.keep_momentum",
            self.keep_momentum,
            "false unless client.momentum > 0",
        )

    def budget(self, rows: int) -> int:
        """Steps one round takes on ``rows`` examples (epochs x batches, capped by max_steps)."""
        steps = self.epochs * -(-rows // self.batch_size)
        return min(steps, self.max_steps) if self.max_steps else steps


def minibatches(
    n: int, batch_size: int, generator: torch.Generator, *, epochs: int = 1, max_steps: int = 0
) -> Iterator[torch.Tensor]:
    """Indices of shuffled minibatches of ``n`` rows: ``epochs`` passes, each a fresh
    ``torch.randperm(n, generator)`` cut into ``batch_size`` slices (the last may be short),
    at most ``max_steps`` batches in all (0: no cap).

    Lazy: each epoch's permutation is drawn when its first batch is asked for (or, once the
    cap is reached, when the next is), so a caller that also draws from ``generator`` between
    steps sees the same stream as a hand-written loop.
    """
    taken = 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            if max_steps and taken >= max_steps:
                break
            yield order[start : start + batch_size]
            taken += 1


def client_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The public torch stream of one client in one round (its shuffling, its zeroth-order
    directions, its SST draws): ``SeedSequence([seed, server_round, partition_id])``."""
    state = np.random.SeedSequence([seed, server_round, partition_id]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy a client's rows (possibly a read-only memory map) into tensors."""
    return torch.from_numpy(np.array(x, dtype=np.float32)), torch.from_numpy(
        np.array(y, dtype=np.int64)
    )


def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            out = model(x[start : start + batch_size])
            target = y[start : start + batch_size]
            loss += float(nn.functional.cross_entropy(out, target, reduction="sum"))
            correct += int((out.argmax(1) == target).sum())
    n = max(len(y), 1)
    return {"loss": loss / n, "accuracy": correct / n}


_MODELS: dict[ModelSpec, nn.Module] = {}


def cached_model(spec: ModelSpec) -> nn.Module:
    """This process's model for ``spec`` on ``spec.device`` (built once, weights overwritten
    per client)."""
    model = _MODELS.get(spec)
    if model is None:
        model = _MODELS[spec] = place(build_model(spec), spec.device)
    return model


@dataclass(frozen=True)
class TrainTask:
    """What a train instruction gives client ``partition``: its training rows, the server
    round, the server's learning rate (None: the client's own), FedProx's ``proximal-mu``
    (0: none), the client's ``node_config`` (where its secret is) and ``inputs``, the
    records the training declares in :attr:`ClientTraining.inputs`, read from the
    instruction (a client method's server half put them there,
    :mod:`fedsim.workloads.client_method`)."""

    partition: int
    x: torch.Tensor
    y: torch.Tensor
    server_round: int
    lr: float | None = None
    proximal_mu: float = 0.0
    node_config: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def secret(self) -> PartySecret:
        """The client's own secret (:func:`fedsim.randomness.client_secret`)."""
        return client_secret(self.node_config)

    def to(self, device: str) -> TrainTask:
        """This task with its rows on ``device`` (where the model trains)."""
        return replace(self, x=self.x.to(device), y=self.y.to(device))


@dataclass(frozen=True)
class TrainResult:
    """What one client's round of training produced.

    Attributes:
        loss: mean training loss over the steps (None: not released, e.g. DP-SGD's
            un-noised loss without ``metrics_in_clear``).
        steps: optimiser steps taken.
        metrics: further reply metrics (method-specific).
        upload: the arrays to send (None: the trained model's, :meth:`ClientTraining.arrays`).
        replies: further records of arrays for the reply, by key (a client method's record
            for its server half, :mod:`fedsim.workloads.client_method`).
    """

    loss: float | None
    steps: int
    metrics: dict[str, float | int] = field(default_factory=dict)
    upload: dict[str, np.ndarray] | None = None
    replies: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass(frozen=True)
class Exclusion:
    """A part of ``[client]`` that cannot be combined with ``feature``.

    ``feature`` is a ``[client]`` table that is set (``"dp_sgd"``, ``"lora"``, ...),
    ``"keep_momentum"``, ``"fedprox"`` (the server adds a proximal term) or
    ``"whole-batch-optimizer"`` (a zeroth-order or full-batch ``client.optimizer``). The error
    names ``client.<named>`` (None: the declaring part) with its value and ``allowed``.
    """

    feature: str
    allowed: str
    named: str | None = None


class ClientTraining(ABC):
    """One way a client trains ``spec`` with the schedule ``steps``.

    Subclasses set :attr:`name` (used in errors), :attr:`proximal` (whether they add
    FedProx's ``proximal-mu`` term) and :attr:`inputs` (the instruction records of arrays
    they read, :attr:`TrainTask.inputs`), implement :meth:`train` and override the model
    hooks when they train something other than :func:`cached_model` with dense arrays.
    """

    name: str = "client training"
    proximal: bool = False
    inputs: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, steps: LocalSteps) -> None:
        self.spec, self.steps = spec, steps

    @property
    def device(self) -> str:
        """Where the model trains and the client's rows go (``spec.device``)."""
        return self.spec.device

    def model(self) -> nn.Module:
        """This process's model to train, on :attr:`device` (weights are loaded into it per
        client)."""
        return cached_model(self.spec)

    def evaluation_model(self) -> nn.Module:
        """This process's model to evaluate the global arrays with."""
        return self.model()

    def load(self, model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
        """Load the instruction's global arrays into ``model``."""
        load_arrays(model, arrays)

    def arrays(self, model: nn.Module) -> dict[str, np.ndarray]:
        """The arrays a client uploads from its trained ``model``."""
        return model_arrays(model)

    def mods(self) -> list[Mod]:
        """Flower mods around the ClientApp (e.g. upload quantisation)."""
        return []

    def evaluation_metrics(
        self, model: nn.Module, data: DatasetSpec, partition: int
    ) -> dict[str, float]:
        """Metrics an evaluate reply adds for client ``partition`` (none by default)."""
        return {}

    @abstractmethod
    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        """One round on ``task``'s rows, in place on ``model`` (loaded with the global
        arrays); ``generator`` is the client's public stream of the round, ``state`` its
        ``context.state`` (kept across rounds)."""
