"""The client workloads of ``experiments/bench/secure_scale.py``, by name (:data:`WORKLOADS`).

* ``synthetic`` (:func:`synthetic_client_app`): a client's update is a fixed vector of norm
  :data:`UPDATE_NORM` drawn from ``(partition, round)`` on a model of d parameters (one
  float32 vector): the benchmark measures the protocol and the engine, not training.
* ``lenet``: the engine benchmark's workload (``experiments/bench/engine.py``): LeNet-5
  (:class:`fedsim.models.SmallCNN`: two 5x5 conv + 2x2 max-pool blocks, fully connected
  120-84-62, :data:`LENET_DIM` parameters in 10 arrays) trained for one local epoch of plain SGD
  (batch 10, lr 0.05) on FEMNIST-like writers (:func:`fedsim.data.femnist_like`, generated:
  ``--writers`` writers of ``--rows-per-writer`` training rows each, 28x28 glyphs in 62
  classes, built once by the harness and memory-mapped by every worker). The engine registers
  ``--population`` clients (10^6: node ids are computed, nothing stored per client) but there
  are only ``writers`` writers: **registered client p trains on writer ``p % writers``** (its
  ``partition-id`` is rewritten for the training call only; its node id, its secret and its
  state stay its own), so at 10^6 registered clients and 1000 writers each writer's rows
  serve 1000 registered clients. d is the model's parameter count (``--dims`` is ignored).

Both workloads keep a small state per client in the engine's client-state store (its rounds
seen); the ``lenet`` clients also record there the seconds their training took
(``perf_counter``, the clock of the engine's ``client_s``) per round, which the harness reads
back after the run (:func:`training_seconds`) to split ``client_s`` into training and
secure-protocol seconds. They travel only with the client's state to the engine's state store
(as every client state does); no message, and so no strategy, carries them. A benchmark
instrument: a deployed client keeps no such record.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

UPDATE_NORM = 0.5
"""L2 norm of every synthetic client update (below the clipping norm 1)."""
ARRAY_KEY = "w"
STATE_KEY = "bench"
"""``context.state`` key of a benchmark client's own record (rounds seen, training seconds)."""
CLASSES = 62
LENET_DIM = 48_846
"""Parameters of LeNet-5 on 28x28 inputs and 62 classes (checked by :func:`lenet_model`)."""


# ----------------------------------------------------------------------------- synthetic
def synthetic_client_app(dim: int, seed: int):
    """A real Flower ClientApp whose train reply is the global vector plus a fixed update of
    norm :data:`UPDATE_NORM`, the client's simulated data: the public stream ``(seed, round,
    Stream.PARTITION, partition)``; the client counts its rounds in ``context.state`` (so every
    client is stateful)."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: PLC0415
    from flwr.clientapp import ClientApp  # noqa: PLC0415

    from fedsim.randomness import Stream, public_generator  # noqa: PLC0415
    from fedsim.record_codec import to_numpy, to_record  # noqa: PLC0415

    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        ((key, record),) = [
            (k, v) for k, v in message.content.items() if isinstance(v, ArrayRecord)
        ]
        weights = to_numpy(record)[ARRAY_KEY]
        if weights.shape != (dim,):
            raise ValueError(f"the global vector has shape {weights.shape}, expected ({dim},)")
        config = message.content["config"]
        partition = int(context.node_config["partition-id"])
        server_round = int(config.get("server-round", 0))
        rng = public_generator(seed, server_round, Stream.PARTITION, partition)
        update = rng.standard_normal(dim, dtype=np.float32)
        update *= UPDATE_NORM / float(np.linalg.norm(update))
        _count_round(context, server_round, None)
        content = RecordDict(
            {
                key: to_record({ARRAY_KEY: weights + update}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        return Message(content=content, reply_to=message)

    return app


def _count_round(context, server_round: int, train_s: float | None) -> None:
    """Add one round (and its training seconds, if any) to the client's own record."""
    from flwr.app import ConfigRecord  # noqa: PLC0415

    seen = context.state.get(STATE_KEY)
    old = dict(seen) if isinstance(seen, ConfigRecord) else {}
    record = {"rounds": int(old.get("rounds", 0)) + 1}
    if train_s is not None:
        record["train-rounds"] = [*old.get("train-rounds", []), int(server_round)]
        record["train-s"] = [*old.get("train-s", []), float(train_s)]
    context.state[STATE_KEY] = ConfigRecord(record)


# ----------------------------------------------------------------------------- LeNet-5
def lenet_model():
    """The LeNet-5 spec of the engine benchmark; its parameter count must be LENET_DIM."""
    from fedsim.models import ModelSpec, initial_arrays  # noqa: PLC0415

    spec = ModelSpec(kind="cnn", input_shape=(1, 28, 28), num_classes=CLASSES, hidden=(120, 84))
    dim = sum(int(a.size) for a in initial_arrays(spec, 0).values())
    if dim != LENET_DIM:
        raise RuntimeError(f"LeNet-5 has {dim} parameters, LENET_DIM says {LENET_DIM}")
    return spec


def make_writers(directory: Path, writers: int, rows: int, seed: int) -> Path:
    """FEMNIST-like ``writers`` of ``rows`` training rows each (and a quarter as many test
    rows), saved under ``directory`` for memory-mapping; returns the saved directory."""
    from fedsim.data import DatasetSpec, build_dataset  # noqa: PLC0415

    if writers < 1 or rows < 1:
        raise ValueError(f"writers={writers}, rows per writer={rows}; both must be >= 1")
    spec = DatasetSpec(
        source="femnist",
        partition="natural",
        num_clients=writers,
        samples_per_client=rows * 5 // 4,
        test_fraction=0.2,
        seed=seed,
    )
    dataset = build_dataset(spec)
    sizes = dataset.train.sizes()
    if not np.all(sizes == rows):
        raise RuntimeError(f"expected {rows} training rows per writer, got {set(sizes.tolist())}")
    return dataset.save(directory)


def writer_app(inner, writers: int):
    """A ClientApp that runs ``inner`` (a training ClientApp) for registered client p on
    writer ``p % writers``'s rows and records its training seconds in its own state."""
    from flwr.app import Context, Message  # noqa: PLC0415
    from flwr.clientapp import ClientApp  # noqa: PLC0415

    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        config = {
            **context.node_config,
            "partition-id": partition % writers,
            "num-partitions": writers,
        }
        local = Context(
            run_id=context.run_id,
            node_id=context.node_id,
            node_config=config,
            state=context.state,  # the registered client's own state
            run_config=context.run_config,
        )
        start = time.perf_counter()
        reply = inner(message, local)
        seconds = time.perf_counter() - start
        if not reply.has_error():
            server_round = int(message.content["config"].get("server-round", 0))
            _count_round(context, server_round, seconds)
        return reply

    return app


def lenet_client_app(point) -> Any:
    """The ``lenet`` ClientApp of ``point``: LeNet-5, one epoch of SGD on writer
    ``p % point.writers`` of the saved writers at ``point.data_dir``."""
    from fedsim.data import DatasetSpec  # noqa: PLC0415
    from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: PLC0415

    if not point.data_dir or point.writers < 1:
        raise ValueError(
            f"workload 'lenet' needs the writers' directory and count, got "
            f"data_dir={point.data_dir!r}, writers={point.writers}"
        )
    data = DatasetSpec(
        source="npy", partition="natural", num_clients=point.writers, path=point.data_dir
    )
    training = LocalTraining(epochs=1, batch_size=10, lr=0.05, seed=point.seed)
    return writer_app(make_client_app(lenet_model(), data, training), point.writers)


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Workload:
    """A benchmark workload: its ClientApp for a point, the initial global arrays, and the
    model size (None: the point's ``dim``)."""

    client_app: Callable[[Any], Any]
    initial: Callable[[Any], dict[str, np.ndarray]]
    dim: int | None = None


def _lenet_initial(point) -> dict[str, np.ndarray]:
    from fedsim.models import initial_arrays  # noqa: PLC0415

    return initial_arrays(lenet_model(), point.seed)


WORKLOADS: dict[str, Workload] = {
    "synthetic": Workload(
        client_app=lambda point: synthetic_client_app(point.dim, point.seed),
        initial=lambda point: {ARRAY_KEY: np.zeros(point.dim, dtype=np.float32)},
    ),
    "lenet": Workload(client_app=lenet_client_app, initial=_lenet_initial, dim=LENET_DIM),
}
"""Client workloads by name (``--workload``)."""


def training_seconds(store, nodes: dict[int, set[int]]) -> dict[int, dict[str, float]]:
    """Per round: the training seconds the clients of ``nodes[round]`` recorded in their own
    states (``train_s``, summed) and how many recorded one (``train_calls``)."""
    wanted = set().union(*nodes.values()) if nodes else set()
    out = {r: {"train_s": 0.0, "train_calls": 0} for r in nodes}
    for node, blob in store.get_many(sorted(wanted)).items():
        record = pickle.loads(blob).get(STATE_KEY)
        if record is None or "train-s" not in record:
            continue
        for server_round, seconds in zip(record["train-rounds"], record["train-s"], strict=True):
            if server_round in out and node in nodes[server_round]:
                out[server_round]["train_s"] += float(seconds)
                out[server_round]["train_calls"] += 1
    return out
