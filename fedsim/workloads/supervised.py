"""Local SGD training and evaluation as a Flower ClientApp (the common case).

:func:`make_client_app` returns a real :class:`flwr.clientapp.ClientApp` with
``@app.train()`` and ``@app.evaluate()`` handlers, usable on fedsim's engine and
on Flower's own runtime alike. Each handler reads its client's rows from the
federated dataset (``context.node_config["partition-id"]``), reuses one model
per worker process (weights overwritten in place from the message), and draws
its shuffling from ``SeedSequence([seed, server_round, partition_id])``, so a
client's update depends only on the global model, the round and the seed.

Train replies carry ``num-examples`` (training rows, FedAvg's weight) and
``train_loss`` (mean over steps). If the instruction's config has
``proximal-mu`` (Flower's FedProx sets it), the FedProx term
``mu/2 * ||w - w_global||^2`` (Li et al. 2020, eq. 2) is added to the loss.

With ``LocalTraining.dp_sgd`` set, clients train with sample-level DP-SGD
instead (:mod:`fedsim.workloads.dp_sgd`, Opacus), drawing batches and noise from
their own secret (``client_secret(context.node_config)``), and their replies also
carry ``dp-sgd-epsilon``, their own epsilon over every round they trained in; their
``train_loss`` (computed on private rows, un-noised) leaves the client only with
``metrics_in_clear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedsim.config import from_mapping, require
from fedsim.data import DatasetSpec, cached_dataset
from fedsim.models import ModelSpec, build_model, load_arrays, model_arrays
from fedsim.randomness import client_secret
from fedsim.records import records_of, to_numpy, to_record
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.compression import Quantization
from fedsim.workloads.conformal import (
    SCORES_RECORD,
    SCORES_REQUEST,
    ConformalTraining,
    score_reply_record,
)
from fedsim.workloads.constrained import LinearConstraints, make_constrained_client_app
from fedsim.workloads.coto import LoRATraining
from fedsim.workloads.dp_sgd import DPSGD, train_client
from fedsim.workloads.optim.choice import ClientOptimizer
from fedsim.workloads.sst import SparseSpectral


@dataclass(frozen=True, kw_only=True)
class LocalTraining:
    """Client-side SGD.

    Attributes:
        epochs: passes over the client's training rows per round.
        batch_size: examples per step.
        lr: learning rate (a ``lr`` key in the instruction's config overrides it).
        momentum, weight_decay: torch.optim.SGD's.
        max_steps: cap on steps per round (0: no cap).
        keep_momentum: keep each client's momentum buffers in its
            ``context.state`` from one round to the next (a stateful client;
            needs ``momentum > 0``).
        seed: root seed of the clients' shuffling.
        dp_sgd: train with sample-level DP-SGD (a ``[client.dp_sgd]`` table of
            :class:`~fedsim.workloads.dp_sgd.DPSGD` keys: noise_multiplier,
            max_grad_norm, delta, accountant, secure_mode); None: plain SGD.
        optimizer: a ``[client.optimizer]`` table
            (:class:`~fedsim.workloads.optim.ClientOptimizer`: MARS-AdamW/Lion,
            R-AdaZO, ZO-AdaMM); None: SGD.
        averaging: ``[client.averaging]`` LAWA/EMA of the local iterates, whose
            average is uploaded (:class:`~fedsim.workloads.averaging.Averaging`).
        compression: ``[client.compression]`` layer-wise quantised uploads
            (:class:`~fedsim.workloads.compression.Quantization`).
        conformal: ``[client.conformal]`` conformal training objective (DPSM,
            :class:`~fedsim.workloads.conformal.ConformalTraining`).
        sst: ``[client.sst]`` sparse spectral training of the Linear layers
            (:class:`~fedsim.workloads.sst.SparseSpectral`: rank, period, resvd_every).
        constraints: ``[client.constraints]`` per-client linear inequality constraints on
            a logistic regression, trained with the smoothed primal-dual method
            (:class:`~fedsim.workloads.constrained.LinearConstraints`); replaces SGD and
            combines with no other client method.
        The last four train through :mod:`fedsim.workloads.methods`.
        lora: ``[client.lora]`` federated LoRA fine-tuning with CoTo
            (:class:`~fedsim.workloads.coto.LoRATraining`): the global arrays
            are the adapters only (:mod:`fedsim.workloads.lora_client`); combines
            with a minibatch ``optimizer`` only.
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_steps: int = 0
    keep_momentum: bool = False
    seed: int = 0
    dp_sgd: DPSGD | dict[str, Any] | None = None
    optimizer: ClientOptimizer | dict[str, Any] | None = None
    averaging: Averaging | dict[str, Any] | None = None
    compression: Quantization | dict[str, Any] | None = None
    conformal: ConformalTraining | dict[str, Any] | None = None
    sst: SparseSpectral | dict[str, Any] | None = None
    constraints: LinearConstraints | dict[str, Any] | None = None
    lora: LoRATraining | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.constraints, dict):
            made = from_mapping(LinearConstraints, self.constraints, "client.constraints")
            object.__setattr__(self, "constraints", made)
        for key in ("dp_sgd", "optimizer", "averaging", "compression", "conformal", "sst", "lora"):
            require(
                self.constraints is None or getattr(self, key) is None,
                f"client.{key}",
                str(getattr(self, key)),
                "unset with client.constraints (smoothed primal-dual training)",
            )
        if isinstance(self.sst, dict):
            object.__setattr__(self, "sst", from_mapping(SparseSpectral, self.sst, "client.sst"))
        require(
            self.sst is None
            or (self.dp_sgd is None and not self.keep_momentum and self.lora is None),
            "client.sst",
            str(self.sst),
            "unset with client.dp_sgd, client.keep_momentum or client.lora",
        )
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", from_mapping(LoRATraining, self.lora, "client.lora"))
        if isinstance(self.conformal, dict):
            made = from_mapping(ConformalTraining, self.conformal, "client.conformal")
            object.__setattr__(self, "conformal", made)
        if isinstance(self.dp_sgd, dict):  # a table from a config: check each key
            object.__setattr__(self, "dp_sgd", from_mapping(DPSGD, self.dp_sgd, "client.dp_sgd"))
        for key, cls in (("optimizer", ClientOptimizer), ("compression", Quantization)):
            if isinstance(getattr(self, key), dict):
                object.__setattr__(
                    self, key, from_mapping(cls, getattr(self, key), f"client.{key}")
                )
        if isinstance(self.averaging, dict):
            averaging = Averaging.from_table(self.averaging, "client.averaging")
            object.__setattr__(self, "averaging", averaging)
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
        require(
            self.conformal is None
            or not isinstance(self.optimizer, ClientOptimizer)
            or not (self.optimizer.zeroth_order or self.optimizer.full_batch),
            "client.optimizer.name",
            getattr(self.optimizer, "name", None),
            "a minibatch gradient optimiser with client.conformal (DPSM splits each batch)",
        )
        for key in ("dp_sgd", "keep_momentum", "averaging", "compression", "conformal"):
            require(
                self.lora is None or getattr(self, key) in (None, False),
                f"client.{key}",
                str(getattr(self, key)),
                "unset with client.lora (LoRA clients combine with client.optimizer only)",
            )
        require(
            self.lora is None
            or not isinstance(self.optimizer, ClientOptimizer)
            or not (self.optimizer.zeroth_order or self.optimizer.full_batch),
            "client.optimizer.name",
            getattr(self.optimizer, "name", None),
            "a minibatch gradient optimiser with client.lora (sgd, mars-adamw, mars-lion)",
        )
        for key in ("optimizer", "averaging", "compression", "conformal"):
            require(
                getattr(self, key) is None or (self.dp_sgd is None and not self.keep_momentum),
                f"client.{key}",
                str(getattr(self, key)),
                "unset when client.dp_sgd or client.keep_momentum is set",
            )

    @property
    def uses_methods(self) -> bool:
        """Whether an optimizer, averaging or compression is configured."""
        return any(
            v is not None
            for v in (self.optimizer, self.averaging, self.compression, self.conformal, self.sst)
        )


def client_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The torch generator of one client in one round."""
    state = np.random.SeedSequence([seed, server_round, partition_id]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy a client's rows (possibly a read-only memory map) into tensors."""
    return torch.from_numpy(np.array(x, dtype=np.float32)), torch.from_numpy(
        np.array(y, dtype=np.int64)
    )


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: LocalTraining,
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
    optimizer = torch.optim.SGD(
        params,
        lr=training.lr if lr is None else lr,
        momentum=training.momentum,
        weight_decay=training.weight_decay,
    )
    if momentum_buffers:
        for p, buf in zip(params, momentum_buffers, strict=True):
            optimizer.state[p]["momentum_buffer"] = torch.from_numpy(np.array(buf))
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
    n = len(y)
    steps = 0
    total = torch.zeros(())
    for _ in range(training.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, training.batch_size):
            if training.max_steps and steps >= training.max_steps:
                break
            idx = order[start : start + training.batch_size]
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
        momentum_buffers[:] = [
            optimizer.state[p]["momentum_buffer"].numpy().copy()
            if "momentum_buffer" in optimizer.state[p]
            else np.zeros(tuple(p.shape), np.float32)
            for p in params
        ]
    return (float(total) / steps if steps else 0.0), steps


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


@dataclass(frozen=True)
class TrainInstruction:
    """What a train message asks of client ``partition``: its training rows, the key of the
    global arrays, the config, the server round and the server's learning rate (None: the
    client's own)."""

    partition: int
    x: torch.Tensor
    y: torch.Tensor
    key: str
    config: ConfigRecord
    server_round: int
    lr: float | None


def train_instruction(
    message: Message, context: Context, data: DatasetSpec, no_proximal: str | None = None
) -> TrainInstruction:
    """Read a train message; ``no_proximal`` names the method that refuses FedProx's
    ``proximal-mu > 0`` (None: allowed)."""
    partition = int(context.node_config["partition-id"])
    x, y = as_tensors(*cached_dataset(data).train.client(partition))
    config = _config(message)
    if no_proximal is not None and float(config.get("proximal-mu", 0.0)) > 0:
        raise ValueError(f"proximal-mu > 0 (FedProx) is not supported with {no_proximal}")
    lr: Any = config.get("lr")
    return TrainInstruction(
        partition=partition,
        x=x,
        y=y,
        key=_arrays_key(message),
        config=config,
        server_round=int(config.get("server-round", 0)),
        lr=float(lr) if isinstance(lr, (int, float)) else None,
    )


def evaluation_rows(data: DatasetSpec, partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition``'s evaluation rows: its test rows, else its training rows."""
    dataset = cached_dataset(data)
    split = dataset.test if dataset.test.sizes()[partition] > 0 else dataset.train
    return as_tensors(*split.client(partition))


def evaluation_reply(
    message: Message,
    net: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    partition: int,
    extra: dict[str, float] | None = None,
) -> Message:
    """The evaluate reply: loss, accuracy and ``extra`` metrics, plus the conformal scores when
    the server asks for them (online conformal calibration, :mod:`strategies.conformal`)."""
    metrics = MetricRecord(
        {"num-examples": int(len(y)), **evaluate_model(net, x, y), **(extra or {})}
    )
    content = RecordDict({"metrics": metrics})
    if _config(message).get(SCORES_REQUEST):
        content[SCORES_RECORD] = score_reply_record(net, x, y, partition)
    return Message(content=content, reply_to=message)


_MODELS: dict[ModelSpec, nn.Module] = {}


def cached_model(spec: ModelSpec) -> nn.Module:
    """This process's model for ``spec`` (built once, weights overwritten per client)."""
    model = _MODELS.get(spec)
    if model is None:
        model = _MODELS[spec] = build_model(spec)
    return model


def model_evaluation(model: ModelSpec, data: DatasetSpec) -> Any:
    """The evaluate handler of the supervised client apps: the global arrays scored on the
    client's evaluation rows (:func:`evaluation_reply`)."""

    def evaluate(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        x, y = evaluation_rows(data, partition)
        net = cached_model(model)
        load_arrays(net, to_numpy(message.content[_arrays_key(message)]))
        return evaluation_reply(message, net, x, y, partition)

    return evaluate


def _config(message: Message) -> ConfigRecord:
    """The instruction's config (FedAvg's "config" record; empty if none)."""
    records = records_of(message.content, ConfigRecord)
    for key, record in records:
        if key == "config":
            return record
    return records[0][1] if records else ConfigRecord()


def _arrays_key(message: Message) -> str:
    keys = [key for key, _ in records_of(message.content, ArrayRecord)]
    if len(keys) != 1:
        raise ValueError(f"expected one ArrayRecord in the instruction, found {len(keys)}")
    return keys[0]


MOMENTUM_STATE = "fedsim.momentum"


def _momentum_state(context: Context) -> list[np.ndarray]:
    """The client's momentum buffers from earlier rounds (empty on its first)."""
    if MOMENTUM_STATE not in context.state:
        return []
    saved = to_numpy(context.state[MOMENTUM_STATE])
    return [saved[f"m{i}"] for i in range(len(saved))]


def make_client_app(
    model: ModelSpec, data: DatasetSpec, training: LocalTraining, metrics_in_clear: bool = False
) -> ClientApp:
    """A ClientApp that trains ``model`` with local SGD on ``data``'s clients
    (``metrics_in_clear``: DP-SGD clients also reply their un-noised train loss)."""
    if training.lora is not None:
        from fedsim.workloads.lora_client import make_lora_client_app

        return make_lora_client_app(model, data, training)
    if training.constraints is not None:
        return make_constrained_client_app(model, data, training, training.constraints)
    if training.uses_methods:
        from fedsim.workloads.methods import ClientMethods, make_methods_client_app

        methods = ClientMethods(
            optimizer=training.optimizer,
            averaging=training.averaging,
            compression=training.compression,
            conformal=training.conformal,
            sst=training.sst,
        )
        return make_methods_client_app(model, data, training, methods)
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        task = train_instruction(message, context, data)
        partition, x, y, key, config = task.partition, task.x, task.y, task.key, task.config
        server_round, lr = task.server_round, task.lr
        buffers = _momentum_state(context) if training.keep_momentum else None
        proximal_mu = float(config.get("proximal-mu", 0.0))
        private: dict[str, float | int] = {}
        if training.dp_sgd is not None:
            if proximal_mu > 0:
                raise ValueError("client.dp_sgd does not support FedProx's proximal term")
            result, private = train_client(
                model,
                to_numpy(message.content[key]),
                x,
                y,
                training,
                context.state,
                secret=client_secret(context.node_config),
                server_round=server_round,
                lr=lr,
                momentum_buffers=buffers,
            )
            net, loss, steps = result.model, result.loss, result.steps
        else:
            net = cached_model(model)
            load_arrays(net, to_numpy(message.content[key]))
            loss, steps = train_epochs(
                net,
                x,
                y,
                training,
                client_generator(training.seed, server_round, partition),
                lr=lr,
                proximal_mu=proximal_mu,
                momentum_buffers=buffers,
            )
        if buffers is not None:
            context.state[MOMENTUM_STATE] = to_record({f"m{i}": b for i, b in enumerate(buffers)})
        metrics = MetricRecord({"num-examples": int(len(y)), "steps": steps, **private})
        if training.dp_sgd is None or metrics_in_clear:
            metrics["train_loss"] = loss
        content = RecordDict({key: to_record(model_arrays(net)), "metrics": metrics})
        return Message(content=content, reply_to=message)

    app.evaluate()(model_evaluation(model, data))

    return app
