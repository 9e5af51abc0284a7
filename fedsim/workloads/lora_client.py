"""Federated LoRA fine-tuning with CoTo: a ClientApp whose global arrays are the adapters.

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

import numpy as np
import peft
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.config import require
from fedsim.data import DatasetSpec
from fedsim.models import ModelSpec
from fedsim.records import to_numpy, to_record
from fedsim.workloads.coto import (
    CoToController,
    CoToSchedule,
    LoRATraining,
    adapter_arrays,
    build_lora_model,
    load_adapter_arrays,
)
from fedsim.workloads.methods import ClientMethods, step_budget, train_with_methods
from fedsim.workloads.supervised import (
    LocalTraining,
    _arrays_key,
    client_generator,
    evaluation_reply,
    evaluation_rows,
    train_instruction,
)

_LORA_MODELS: dict[tuple[ModelSpec, LoRATraining], peft.PeftModel] = {}


def cached_lora_model(spec: ModelSpec, lora: LoRATraining) -> peft.PeftModel:
    """This process's LoRA model for (spec, lora), built once; adapters overwritten per client."""
    key = (spec, lora)
    model = _LORA_MODELS.get(key)
    if model is None:
        model = _LORA_MODELS[key] = build_lora_model(spec, lora)
    return model


def coto_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The stream of one client's CoTo draws in one round (apart from its shuffling)."""
    words = [seed, server_round, partition_id, 1]
    state = np.random.SeedSequence(words).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def train_lora(
    model: peft.PeftModel,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalTraining,
    *,
    server_round: int,
    partition_id: int,
    lr: float | None = None,
) -> dict[str, float | int]:
    """One round of local LoRA training (CoTo if ``training.lora.coto``); returns its metrics.

    Every adapter is switched back on before returning, so the model then computes
    the full adapted output.
    """
    lora = training.lora
    if not isinstance(lora, LoRATraining):
        raise ValueError(f"training.lora = {lora!r} is not allowed: a LoRATraining")
    require(
        lora.rounds >= 1,
        "client.lora.rounds",
        lora.rounds,
        "an integer >= 1 from Python (the run's rounds, CoTo's horizon)",
    )
    budget = max(step_budget(len(y), training), 1)
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
            ClientMethods(optimizer=training.optimizer),
            client_generator(training.seed, server_round, partition_id),
            lr=lr,
            before_step=None if controller is None else lambda s: controller.activate(offset + s),
        )
    finally:
        if controller is not None:
            controller.enable_all()
    metrics: dict[str, float | int] = {"num-examples": int(len(y)), "train_loss": loss}
    metrics["steps"] = steps
    if controller is not None:
        metrics["coto-active-fraction"] = controller.active_fraction
        metrics["coto-p"] = controller.schedule.probability(offset + max(steps - 1, 0))
    return metrics


def make_lora_client_app(model: ModelSpec, data: DatasetSpec, training: LocalTraining) -> ClientApp:
    """A ClientApp fine-tuning LoRA adapters of ``model`` on ``data``'s clients (training.lora)."""
    lora = training.lora
    if not isinstance(lora, LoRATraining):
        raise ValueError(f"training.lora = {lora!r} is not allowed: a LoRATraining or its table")
    require(
        lora.rounds >= 1,
        "client.lora.rounds",
        lora.rounds,
        "an integer >= 1 from Python (the run's rounds, CoTo's horizon)",
    )
    build_lora_model(model, lora)  # checks targets and base weights before any round runs
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        task = train_instruction(message, context, data, no_proximal="client.lora")
        key = task.key
        net = cached_lora_model(model, lora)
        load_adapter_arrays(net, to_numpy(message.content[key]))
        metrics = train_lora(
            net,
            task.x,
            task.y,
            training,
            server_round=task.server_round,
            partition_id=task.partition,
            lr=task.lr,
        )
        content = RecordDict(
            {key: to_record(adapter_arrays(net)), "metrics": MetricRecord(metrics)}
        )
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        x, y = evaluation_rows(data, partition)
        net = cached_lora_model(model, lora)
        load_adapter_arrays(net, to_numpy(message.content[_arrays_key(message)]))
        return evaluation_reply(message, net, x, y, partition)

    return app
