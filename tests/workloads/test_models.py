"""Models and the local-SGD ClientApp."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec
from fedsim.engine import NODE_ID_OFFSET
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays, model_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app


@pytest.mark.parametrize(
    "spec,shape",
    [
        (ModelSpec(kind="logreg", input_shape=(60,), num_classes=10), (5, 60)),
        (
            ModelSpec(kind="mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16, 8)),
            (5, 1, 8, 8),
        ),
        (ModelSpec(kind="cnn", input_shape=(1, 8, 8), num_classes=10), (5, 1, 8, 8)),
        (
            ModelSpec(kind="cnn", input_shape=(1, 28, 28), num_classes=62, hidden=(120, 84)),
            (5, 1, 28, 28),
        ),
    ],
)
def test_models_map_inputs_to_logits(spec, shape):
    out = build_model(spec)(torch.zeros(shape))
    assert out.shape == (5, spec.num_classes)


def test_logreg_has_one_linear_layer():
    arrays = initial_arrays(ModelSpec(kind="logreg", input_shape=(60,), num_classes=10), 0)
    assert sorted(v.shape for v in arrays.values()) == [(10,), (10, 60)]


def test_initial_arrays_follow_the_seed_and_leave_torch_rng_alone():
    spec = ModelSpec(kind="mlp", input_shape=(4,), num_classes=3)
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a, b, c = initial_arrays(spec, 1), initial_arrays(spec, 1), initial_arrays(spec, 2)
    assert torch.equal(torch.rand(1), before)
    assert all(np.array_equal(a[k], b[k]) for k in a) and not all(
        np.array_equal(a[k], c[k]) for k in a
    )


def test_load_and_read_weights_in_place():
    spec = ModelSpec(kind="mlp", input_shape=(4,), num_classes=3)
    model = build_model(spec)
    target = initial_arrays(spec, 9)
    load_arrays(model, {k: v.copy() for k, v in target.items()})
    assert all(np.array_equal(model_arrays(model)[k], target[k]) for k in target)
    with pytest.raises(ValueError, match="differing keys"):
        load_arrays(model, {"nope": np.zeros(1)})


def test_bad_model_specs_are_named():
    with pytest.raises(ConfigError, match="model.input_shape"):
        ModelSpec(kind="cnn", input_shape=(64,), num_classes=10)
    with pytest.raises(ConfigError, match="model.num_classes"):
        ModelSpec(kind="mlp", input_shape=(4,), num_classes=1)


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def call(app, spec, partition, server_round=1, **config):
    message = Message(
        RecordDict(
            {
                "arrays": to_record(initial_arrays(spec, 0)),
                "config": ConfigRecord({"server-round": server_round, **config}),
            }
        ),
        NODE_ID_OFFSET + partition,
        "train",
    )
    message.metadata.__dict__["_message_id"] = "m"
    context = Context(
        run_id=1,
        node_id=NODE_ID_OFFSET + partition,
        node_config={"partition-id": partition, "num-partitions": 10},
        state=RecordDict(),
        run_config={},
    )
    return app(message, context)


def test_client_app_trains_deterministically_per_round_and_client():
    data = DatasetSpec(source="digits", partition="iid", num_clients=10, seed=0)
    spec = ModelSpec(kind="mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16,))
    app = make_client_app(spec, data, LocalTraining(epochs=1, batch_size=8, lr=0.1, seed=4))
    a, b, c = call(app, spec, 2), call(app, spec, 2), call(app, spec, 2, server_round=2)
    wa, wb, wc = (to_numpy(r.content["arrays"]) for r in (a, b, c))
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert not all(np.array_equal(wa[k], wc[k]) for k in wa)
    metrics = a.content["metrics"]
    assert metrics["num-examples"] > 0 and metrics["steps"] == -(-metrics["num-examples"] // 8)
    # A FedProx term pulls the update toward the global model.
    start = initial_arrays(spec, 0)
    prox = to_numpy(call(app, spec, 2, **{"proximal-mu": 2.0}).content["arrays"])

    def distance(w):
        return sum(float(np.sum((w[k] - start[k]) ** 2)) for k in w)

    assert distance(prox) < distance(wa)
