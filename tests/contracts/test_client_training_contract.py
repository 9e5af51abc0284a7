"""The contract every :class:`fedsim.workloads.training.ClientTraining` passes (module
docstring there): on a client's rows it trains the model it was loaded with (the upload moves,
its loss is finite, it takes steps); the upload has the received arrays' keys, shapes and
dtypes and shares no memory with them; the received arrays are never written; a client's
result is a function of the global arrays, its seed, round and secret only -- also after other
clients ran on the same reused model; and its ClientApp (:func:`training_app`) replies
``num-examples`` = its training rows, with method metrics that never overwrite the reply's own
keys.

The trainings are found in the source tree (:mod:`contracts.discovery`); each has examples in
:data:`EXAMPLES` (``[client]`` tables that the dispatcher turns into that class; a registered
client method's declared ``example`` table is one already), and a training without one fails
:func:`test_every_client_training_has_examples`. A training that reads instruction records
(``ClientTraining.inputs``) gets them from its method's server half, as in a run.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY

from contracts.discovery import implementations
from fedsim.data import DatasetSpec, cached_dataset
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.models import ModelSpec
from fedsim.randomness import NODE_SECRET_KEY, RunSecret
from fedsim.record_codec import to_record
from fedsim.workloads.client_app import train_task, training_app
from fedsim.workloads.supervised import CLIENT_METHODS, LocalTraining, client_training
from fedsim.workloads.training import ClientTraining, client_generator

CLIENTS = 30
DATA = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
MLP = ModelSpec(kind="mlp", input_shape=(64,), num_classes=10, hidden=(8,))
LOGREG = ModelSpec(kind="logreg", input_shape=(64,), num_classes=10)
STEPS = {"epochs": 1, "batch_size": 16, "lr": 0.1, "max_steps": 2, "seed": 3}
#: per class: (label, model, [client] table); the dispatcher must pick that class for it
EXAMPLES: dict[str, list[tuple[str, ModelSpec, dict]]] = {
    "fedsim.workloads.sgd:SGDTraining": [
        ("sgd", MLP, {}),
        ("sgd-kept-momentum", MLP, {"momentum": 0.9, "keep_momentum": True}),
    ],
    "fedsim.workloads.dp_sgd:PrivateSGD": [
        ("dp-sgd", MLP, {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}),
    ],
    "fedsim.workloads.constrained:ConstrainedTraining": [
        ("constraints", LOGREG, {"constraints": {}})
    ],
    "fedsim.workloads.lora_client:AdapterTraining": [
        ("lora", MLP, {"lora": {"rounds": 2, "targets": ["layers.0"]}}),
    ],
    "fedsim.workloads.methods:MethodsTraining": [
        ("mars-adamw", MLP, {"optimizer": {"name": "mars-adamw"}}),
        ("r-adazo", MLP, {"optimizer": {"name": "r-adazo"}}),
        ("ema", MLP, {"averaging": {"kind": "ema"}}),
        ("compression", MLP, {"compression": {"bits": 4}}),
        ("conformal", MLP, {"conformal": {}}),
        ("sst", MLP, {"sst": {}}),
    ],
}
#: training class -> the registered client method that selects it (its server half's records)
METHOD_OF = {}
for method in CLIENT_METHODS:
    table = {method.key: dict(method.example)}
    made = type(client_training(MLP, LocalTraining(**STEPS, **table)))
    name = f"{made.__module__}:{made.__qualname__}"
    EXAMPLES.setdefault(name, []).append((f"client.{method.key}", MLP, table))
    METHOD_OF[name] = method
FOUND = implementations(ClientTraining)
NAMES = sorted(FOUND)
CASES = [
    pytest.param(name, model, table, id=label)
    for name in NAMES
    for label, model, table in EXAMPLES.get(name, [])
]
ROOT = RunSecret.from_passphrase("client-training-contract")


def test_every_client_training_has_examples():
    """The trainings found in the tree (printed with -v) are the ones this suite trains."""
    print("client trainings:", ", ".join(NAMES))
    assert NAMES, "no ClientTraining subclass found under fedsim/, strategies/, protocols/"
    missing = sorted(set(NAMES) - set(EXAMPLES))
    assert not missing, f"client trainings without contract examples: {missing}"
    stale = sorted(set(EXAMPLES) - set(NAMES))
    assert not stale, f"examples for trainings that no longer exist: {stale}"


def build(name: str, model: ModelSpec, table: dict) -> ClientTraining:
    training = client_training(model, LocalTraining(**STEPS, **table))
    assert f"{type(training).__module__}:{type(training).__qualname__}" == name
    return training


def context(partition: int) -> Context:
    """Client ``partition``'s context: its ids, its own secret, a fresh state."""
    config = {
        PARTITION_ID_KEY: partition,
        NUM_PARTITIONS_KEY: CLIENTS,
        NODE_SECRET_KEY: ROOT.client(partition).token(),
    }
    return Context(
        run_id=1, node_id=NODE_ID_OFFSET + partition, node_config=config, state=RecordDict(),
        run_config={},
    )  # fmt: skip


def global_arrays(training: ClientTraining, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays of the training's shapes and dtypes, drawn from ``seed`` (never what a previous
    client left in the reused model)."""
    template = training.arrays(training.model())
    rng = np.random.default_rng(seed)
    return {
        k: (0.1 * rng.normal(size=v.shape)).astype(v.dtype) for k, v in sorted(template.items())
    }


def instruction(arrays, partition: int, server_round: int, training=None) -> Message:
    """A train instruction for client ``partition``, with the records ``training`` declares
    (:attr:`ClientTraining.inputs`) from its client method's server half."""
    content = RecordDict(
        {"arrays": to_record(arrays), "config": ConfigRecord({"server-round": server_round})}
    )
    if training is not None and training.inputs:
        method = METHOD_OF[f"{type(training).__module__}:{type(training).__qualname__}"]
        table = getattr(LocalTraining(**{method.key: dict(method.example)}), method.key)
        half = method.server(table, CLIENTS)
        content[half.key] = to_record(half.instruction(server_round, arrays))
    return Message(content, NODE_ID_OFFSET + partition, "train")


def train_once(training, arrays, partition=0, server_round=1, ctx=None):
    """What :func:`training_app`'s train handler does, with the arrays handed in directly:
    ``(upload, result)``."""
    ctx = ctx or context(partition)
    message = instruction(arrays, partition, server_round, training)
    task = train_task(message, ctx, DATA, training.inputs)
    task = task.to(training.device)
    net = training.model()
    training.load(net, arrays)
    generator = client_generator(training.steps.seed, task.server_round, task.partition)
    result = training.train(net, task, generator, ctx.state)
    upload = training.arrays(net) if result.upload is None else result.upload
    return upload, result


@pytest.mark.parametrize("name, model, table", CASES)
def test_it_trains_and_uploads_arrays_shaped_as_received(name, model, table):
    training = build(name, model, table)
    received = global_arrays(training)
    kept = {k: v.copy() for k, v in received.items()}
    upload, result = train_once(training, received)
    assert upload.keys() == received.keys()
    for key, value in upload.items():
        assert isinstance(value, np.ndarray), key
        assert value.shape == received[key].shape and value.dtype == received[key].dtype, key
        assert np.all(np.isfinite(value)), key
        assert not np.shares_memory(value, received[key]), f"{key} aliases the received array"
    for key, value in kept.items():  # the instruction's arrays are the server's
        np.testing.assert_array_equal(received[key], value, err_msg=f"{key} was written")
    moved = sum(float(np.abs(upload[k].astype(np.float64) - kept[k]).sum()) for k in kept)
    assert moved > 0, "training left every received array as it was"
    assert result.steps >= 1
    assert result.loss is None or np.isfinite(result.loss)


@pytest.mark.parametrize("name, model, table", CASES)
def test_a_clients_update_depends_on_its_inputs_only(name, model, table):
    """Client 0 twice, with client 1 (other arrays, another round) between, on the one model
    a worker reuses: the same bits; a fresh instance of the training agrees."""
    training = build(name, model, table)
    arrays = global_arrays(training, seed=1)
    first, result = train_once(training, arrays, partition=0, server_round=2)
    train_once(training, global_arrays(training, seed=2), partition=1, server_round=5)
    again, result_again = train_once(training, arrays, partition=0, server_round=2)
    fresh, _ = train_once(build(name, model, table), arrays, partition=0, server_round=2)
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)
        np.testing.assert_array_equal(fresh[key], first[key], err_msg=key)
    assert result_again.loss == result.loss and result_again.steps == result.steps
    assert result_again.metrics == result.metrics


@pytest.mark.parametrize("name, model, table", CASES)
def test_its_client_app_reports_num_examples_and_keeps_the_reply_keys(name, model, table):
    training = build(name, model, table)
    app = training_app(training, DATA)
    partition = 3
    rows = len(cached_dataset(DATA).train.client(partition)[1])
    arrays = global_arrays(training)
    reply = app(instruction(arrays, partition, 1, training), context(partition))
    assert not reply.has_error(), reply.error
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == rows > 0
    _, result = train_once(training, arrays, partition=partition)
    assert metrics["steps"] == result.steps
    reserved = {"num-examples", "train_loss", "steps"} & set(result.metrics)
    assert not reserved, f"method metrics overwrite the reply's {sorted(reserved)}"
    assert not [k for k in result.metrics if k.startswith("fedsim.")], result.metrics
    assert "arrays" in reply.content


@pytest.mark.parametrize("name, model, table", CASES)
def test_its_client_app_evaluates_the_global_arrays(name, model, table):
    training = build(name, model, table)
    app = training_app(training, DATA)
    message = instruction(global_arrays(training), 4, 1)
    message = Message(message.content, NODE_ID_OFFSET + 4, "evaluate")
    reply = app(message, context(4))
    assert not reply.has_error(), reply.error
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] > 0
    assert np.isfinite(metrics["loss"]) and 0 <= metrics["accuracy"] <= 1
