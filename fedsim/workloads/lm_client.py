"""Federated training of the downstream LM on the clients' own text, as a Flower ClientApp.

The DP-FL baseline of POPri (Hou et al., ICML 2025, Sec. 5: DP-FedAvg, McMahan et al. 2018)
trains the downstream model directly on private text: the server's
:class:`~strategies.methods.dp_fedavg.strategy.DPFedAvg` clips each client's update, adds Gaussian
noise and accounts the rounds; this module is the client side. A client loads the global weights
(:func:`~fedsim.workloads.downstream_lm.lm_arrays` layout: trainable parameters, tied
embeddings once), trains on its own sequences with
:func:`~fedsim.workloads.downstream_lm.train_lm` (AdamW, fresh optimiser state each round) and
replies with its new weights, ``num-examples`` (its sequences) and ``train_loss``. The
evaluate handler reports next-token accuracy on the client's sequences.

Batch order is drawn from ``SeedSequence([seed, server_round, partition_id])``, so a client's
update depends only on the global model, the round and the seed. Each worker builds one model
and overwrites its weights per client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.config import device_name
from fedsim.models import place
from fedsim.record_codec import records_of, to_numpy, to_record
from fedsim.workloads.downstream_lm import (
    LMSpec,
    LMTraining,
    lm_arrays,
    load_lm_arrays,
    next_token_accuracy,
    train_lm,
)
from fedsim.workloads.training import client_generator


def _arrays_of(message: Message) -> tuple[str, ArrayRecord]:
    found = records_of(message.content, ArrayRecord)
    if len(found) != 1:
        raise ValueError(f"expected one ArrayRecord in the instruction, found {len(found)}")
    return found[0]


def _server_round(message: Message) -> int:
    for _, record in records_of(message.content, ConfigRecord):
        if "server-round" in record:
            return int(record["server-round"])
    return 0


def _checked_clients(
    spec: LMSpec, client_sequences: Sequence[Sequence[np.ndarray]]
) -> list[list[np.ndarray]]:
    """Each client's sequences, each a 1-d array of at least two ids of ``spec``'s
    vocabulary (a ValueError naming the first that is not)."""
    clients = [list(group) for group in client_sequences]
    for i, group in enumerate(clients):
        for s in group:
            if not (isinstance(s, np.ndarray) and s.ndim == 1 and len(s) >= 2):
                raise ValueError(
                    f"client_sequences[{i}] holds {s!r:.60}; each sequence is a 1-d id array "
                    "of length >= 2 (<bos> and one token)"
                )
            if int(s.max()) >= spec.vocab_size or int(s.min()) < 0:
                raise ValueError(
                    f"client_sequences[{i}] holds ids outside [0, {spec.vocab_size}) "
                    "(spec.vocab_size)"
                )
    return clients


def make_lm_client_app(
    spec: LMSpec,
    client_sequences: Sequence[Sequence[np.ndarray]],
    training: LMTraining,
    seed: int,
    device: str = "cpu",
) -> ClientApp:
    """A ClientApp training ``spec``'s model on ``client_sequences[partition-id]``, on
    ``device`` (the model is built on the CPU from ``seed``, then moved; batches follow it).

    ``client_sequences[i]`` are client ``i``'s texts as compact-id sequences
    (:func:`~fedsim.workloads.downstream_lm.to_sequences`).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed = {seed!r} is not allowed: an integer")
    device_name(device, "device")
    clients = _checked_clients(spec, client_sequences)
    app = ClientApp()
    cache: dict[str, Any] = {"model": None}

    def model_with(arrays: ArrayRecord) -> Any:
        if cache["model"] is None:
            cache["model"] = place(spec.build(seed), device)
        load_lm_arrays(cache["model"], to_numpy(arrays))
        return cache["model"]

    def sequences_of(context: Context) -> list[np.ndarray]:
        partition = int(context.node_config["partition-id"])
        if not 0 <= partition < len(clients):
            raise ValueError(
                f"partition-id = {partition} is not allowed: in [0, {len(clients)}) "
                "(one entry of client_sequences per client)"
            )
        return clients[partition]

    @app.train()
    def train(message: Message, context: Context) -> Message:
        key, arrays = _arrays_of(message)
        model = model_with(arrays)
        sequences = sequences_of(context)
        server_round = _server_round(message)
        partition = int(context.node_config["partition-id"])
        losses: list[float] = []
        if sequences:
            losses = train_lm(
                model, sequences, training, client_generator(seed, server_round, partition)
            )
        return _trained_reply(message, key, model, len(sequences), losses)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        _, arrays = _arrays_of(message)
        return _accuracy_reply(message, model_with(arrays), sequences_of(context))

    return app


def _trained_reply(
    message: Message, key: str, model: Any, examples: int, losses: list[float]
) -> Message:
    """The train reply: the trained arrays under ``key``, the examples, mean loss and steps."""
    metrics = MetricRecord(
        {
            "num-examples": examples,
            "train_loss": float(np.mean(losses)) if losses else 0.0,
            "steps": len(losses),
        }
    )
    content = RecordDict({key: to_record(lm_arrays(model)), "metrics": metrics})
    return Message(content=content, reply_to=message)


def _accuracy_reply(message: Message, model: Any, sequences: list[np.ndarray]) -> Message:
    """The evaluate reply: next-token accuracy over the client's sequences."""
    result = next_token_accuracy(model, sequences) if sequences else None
    metrics = MetricRecord(
        {
            "num-examples": 0 if result is None else result.predictions,
            "accuracy": 0.0 if result is None else result.accuracy,
        }
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=message)
