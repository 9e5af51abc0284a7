"""Federated LoRA fine-tuning with CoTo: a client training whose global arrays are the adapters.

The base model (:class:`~fedsim.models.ModelSpec` with the weights of
``LoRATraining.base``) is frozen and never sent: each instruction carries the
global adapter (the LoRA A and B matrices, :func:`~fedsim.workloads.coto.adapter_arrays`),
the client loads it into its peft model, trains the adapter with CoTo's
progressive activation (:mod:`fedsim.workloads.coto`) and replies with its
adapter only, so the engine's ``bytes_down``/``bytes_up`` count adapters. The
server is any FedAvg-family strategy: it averages A and B matrix by matrix
(FedAvg of adapters, as in FedIT, Zhang et al. 2024).

CoTo's horizon is the whole run: a client with ``s`` local steps per round takes
``T = rounds x s`` and counts ``t = (server_round - 1) x s + local step``, so every
client follows the same p(t) whatever rounds it is sampled in. Its draws come
from their own stream ``SeedSequence([seed, server_round, partition, 1])``, apart
from the shuffling, so ``coto_p0 = 1`` trains exactly as plain LoRA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim.config import require
from fedsim.models import ModelSpec, place
from fedsim.workloads.coto import (
    CoToController,
    CoToSchedule,
    LoRATraining,
    adapter_arrays,
    build_lora_model,
    load_adapter_arrays,
)
from fedsim.workloads.methods import train_with_methods
from fedsim.workloads.optim.choice import ClientOptimizer
from fedsim.workloads.training import (
    ClientTraining,
    Exclusion,
    LocalSteps,
    TrainResult,
    TrainTask,
)

if TYPE_CHECKING:
    import peft

_WITH_OPTIMIZER_ONLY = "unset with client.lora (LoRA clients combine with client.optimizer only)"

EXCLUDES = {
    "lora": (
        *(
            Exclusion(key, _WITH_OPTIMIZER_ONLY, named=key)
            for key in ("dp_sgd", "keep_momentum", "averaging", "compression", "conformal")
        ),
        Exclusion(
            "whole-batch-optimizer",
            "a minibatch gradient optimiser with client.lora (sgd, mars-adamw, mars-lion)",
            named="optimizer.name",
        ),
        Exclusion("fedprox", "unset with FedProx (LoRA clients add no proximal term)"),
    )
}
"""What ``[client.lora]`` cannot be combined with (checked by
:func:`fedsim.workloads.supervised.check_parts`)."""

_LORA_MODELS: dict[tuple[ModelSpec, LoRATraining], peft.PeftModel] = {}


def cached_lora_model(spec: ModelSpec, lora: LoRATraining) -> peft.PeftModel:
    """This process's LoRA model for (spec, lora) on ``spec.device``, built once; adapters
    overwritten per client."""
    key = (spec, lora)
    model = _LORA_MODELS.get(key)
    if model is None:
        model = _LORA_MODELS[key] = place(build_lora_model(spec, lora), spec.device)
    return model


def coto_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The stream of one client's CoTo draws in one round (apart from its shuffling)."""
    words = [seed, server_round, partition_id, 1]
    state = np.random.SeedSequence(words).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def _require_rounds(lora: LoRATraining) -> None:
    require(
        lora.rounds >= 1,
        "client.lora.rounds",
        lora.rounds,
        "an integer >= 1 from Python (the run's rounds, CoTo's horizon)",
    )


def train_lora(
    model: peft.PeftModel,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalSteps,
    lora: LoRATraining,
    generator: torch.Generator,
    *,
    server_round: int,
    partition_id: int,
    optimizer: ClientOptimizer | None = None,
    lr: float | None = None,
) -> TrainResult:
    """One round of local LoRA training (CoTo if ``lora.coto``) with ``optimizer`` (None:
    SGD), shuffled by ``generator``.

    Every adapter is switched back on before returning, so the model then computes
    the full adapted output.
    """
    _require_rounds(lora)
    budget = max(training.budget(len(y)), 1)
    controller: CoToController | None = None
    if lora.coto:
        schedule = CoToSchedule(lora.coto_p0, lora.rounds * budget, lora.coto_ramp)
        controller = CoToController(
            model, schedule, coto_generator(training.seed, server_round, partition_id)
        )
    offset = max(server_round - 1, 0) * budget
    try:
        if controller is not None:
            controller.enable_all()  # the optimiser is built over every adapter
        loss, steps, _ = train_with_methods(
            model,
            x,
            y,
            training,
            generator,
            optimizer=optimizer,
            lr=lr,
            before_step=None if controller is None else lambda s: controller.activate(offset + s),
        )
    finally:
        if controller is not None:
            controller.enable_all()
    metrics: dict[str, float | int] = {}
    if controller is not None:
        metrics["coto-active-fraction"] = controller.active_fraction
        metrics["coto-p"] = controller.schedule.probability(offset + max(steps - 1, 0))
    return TrainResult(loss, steps, metrics)


class AdapterTraining(ClientTraining):
    """Clients fine-tuning LoRA adapters of ``spec`` (``[client.lora]``) with an optional
    minibatch ``[client.optimizer]``; the arrays in and out are the adapters only."""

    name = "client.lora"

    def __init__(
        self,
        spec: ModelSpec,
        steps: LocalSteps,
        lora: LoRATraining,
        optimizer: ClientOptimizer | None = None,
    ) -> None:
        _require_rounds(lora)
        build_lora_model(spec, lora)  # checks targets and base weights before any round runs
        super().__init__(spec, steps)
        self.lora, self.optimizer = lora, optimizer

    def model(self) -> nn.Module:
        return cached_lora_model(self.spec, self.lora)

    def load(self, model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
        load_adapter_arrays(model, arrays)

    def arrays(self, model: nn.Module) -> dict[str, np.ndarray]:
        return adapter_arrays(model)

    def train(
        self, model: nn.Module, task: TrainTask, generator: torch.Generator, state: RecordDict
    ) -> TrainResult:
        return train_lora(
            model,
            task.x,
            task.y,
            self.steps,
            self.lora,
            generator,
            server_round=task.server_round,
            partition_id=task.partition,
            optimizer=self.optimizer,
            lr=task.lr,
        )
