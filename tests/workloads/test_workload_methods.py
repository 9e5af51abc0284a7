"""Client methods in a ClientApp: MARS, R-AdaZO, local LAWA/EMA, quantised uploads."""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays, model_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.client_app import training_app
from fedsim.workloads.compression import Quantization
from fedsim.workloads.methods import MethodsTraining, train_with_methods
from fedsim.workloads.supervised import LocalTraining, make_client_app
from fedsim.workloads.training import as_tensors, evaluate_model
from strategies.methods.averaging import AveragedGlobalModel
from strategies.methods.quantized import DequantizedUploads

SPEC = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=20, seed=1)


@pytest.fixture(scope="module")
def federation():
    dataset = build_dataset(SPEC)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    return dataset, model


class Phases:
    def __init__(self):
        self.reports = []

    def phase_finished(self, report):
        self.reports.append(report)


def run(engine, federation, methods, strategy, rounds=2, training=None):
    dataset, model = federation
    training = training or LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=3)
    if methods:  # the [client] tables, checked and selected as from a config
        app = make_client_app(model, SPEC, replace(training, **methods))
    else:  # the methods' training loop with no method: as plain SGD
        app = training_app(MethodsTraining(model, training), SPEC)
    phases = Phases()
    random.seed(0)
    grid = engine.open_run(app, dataset.num_clients, datasets=((SPEC, dataset),), observer=phases)
    final = run_rounds(strategy, grid, to_record(initial_arrays(model, 0)), rounds)
    return to_numpy(final), phases.reports


def central_accuracy(federation, arrays):
    dataset, model = federation
    net = build_model(model)
    load_arrays(net, arrays)
    xs, ys = zip(*(as_tensors(*dataset.train.client(c)) for c in range(dataset.num_clients)))
    return evaluate_model(net, torch.cat(xs), torch.cat(ys))["accuracy"]


def test_default_methods_match_plain_sgd_training(local_engine, federation):
    dataset, model = federation
    training = LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=3)
    ours, _ = run(local_engine, federation, {}, FedAvg(fraction_evaluate=0.0))
    app = make_client_app(model, SPEC, training)
    random.seed(0)
    grid = local_engine.open_run(app, dataset.num_clients, datasets=((SPEC, dataset),))
    plain = to_numpy(
        run_rounds(FedAvg(fraction_evaluate=0.0), grid, to_record(initial_arrays(model, 0)), 2)
    )
    for name, value in plain.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["mars-adamw", "mars-lion", "r-adazo"])
def test_client_optimizers_train_in_a_client_app(local_engine, federation, name):
    lr = {"mars-adamw": 1e-2, "mars-lion": 1e-2, "r-adazo": 1e-3}[name]
    methods = {"optimizer": {"name": name, "lr": lr}}
    start = initial_arrays(federation[1], 0)
    final, reports = run(local_engine, federation, methods, FedAvg(fraction_evaluate=0.0), rounds=3)
    assert all(np.all(np.isfinite(v)) for v in final.values())
    assert any(not np.array_equal(final[k], start[k]) for k in start)
    if not name.startswith("r-"):
        assert central_accuracy(federation, final) > central_accuracy(federation, start) + 0.2


def test_local_iterate_averaging_uploads_the_average():
    dataset = build_dataset(SPEC)
    model = ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10)
    x, y = as_tensors(*dataset.train.client(0))
    training = LocalTraining(epochs=3, batch_size=8, lr=0.1, seed=0)
    raw_net, avg_net = build_model(model), build_model(model)
    start = initial_arrays(model, 0)
    load_arrays(raw_net, start)
    load_arrays(avg_net, start)
    _, steps, none = train_with_methods(raw_net, x, y, training, torch.Generator().manual_seed(1))
    assert none is None
    one = Averaging(kind="lawa", k=1, every=1, burn_in=0)
    _, _, last = train_with_methods(
        avg_net, x, y, training, torch.Generator().manual_seed(1), averaging=one
    )
    for name, value in model_arrays(raw_net).items():  # k = 1: the last iterate
        np.testing.assert_array_equal(last[name], value)
    net = build_model(model)
    load_arrays(net, start)
    ema = Averaging(kind="ema", beta=0.9, every=1, burn_in=0)
    _, _, smooth = train_with_methods(
        net, x, y, training, torch.Generator().manual_seed(1), averaging=ema
    )
    assert any(not np.array_equal(smooth[k], v) for k, v in model_arrays(net).items())


def test_server_lawa_and_quantised_uploads_on_the_local_engine(local_engine, federation):
    dense_final, dense = run(
        local_engine, federation, {}, FedAvg(fraction_evaluate=0.0)
    )
    methods = {"compression": Quantization(bits=4)}
    strategy = AveragedGlobalModel(
        DequantizedUploads(FedAvg(fraction_evaluate=0.0)), Averaging(kind="lawa", k=2), num_rounds=2
    )
    _, quantized = run(local_engine, federation, methods, strategy)
    ratio = sum(r.bytes_up for r in quantized) / sum(r.bytes_up for r in dense)
    assert 0.1 < ratio < 0.25  # 4 of 32 bits per coordinate, plus .npy headers
    coordinates = sum(v.size for v in dense_final.values())
    trained = [r for r in quantized if r.message_type.startswith("train")]
    assert all(r.client_metrics["upload-bits"] == 4 * 32 + 4 * coordinates for r in trained)
    averaged = to_numpy(strategy.averaged())
    assert all(np.all(np.isfinite(v)) for v in averaged.values())
