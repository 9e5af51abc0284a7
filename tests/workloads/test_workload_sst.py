"""Sparse spectral training: re-SVD, sigma >= 0, frozen pairs, sampling, config, Ray."""

import random

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from fedsim.config import ConfigError, from_mapping
from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.methods import train_with_methods
from fedsim.workloads.sst import (
    SparseSpectral,
    SparseSpectralTraining,
    SpectralLinear,
    sampling_probabilities,
)
from fedsim.workloads.supervised import LocalTraining, make_client_app


def mlp(seed=0):
    spec = ModelSpec(kind="mlp", input_shape=(12,), num_classes=5, hidden=(16,))
    model = build_model(spec)
    load_arrays(model, initial_arrays(spec, seed))
    return model


def batch(seed, rows=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)


def sgd_step(sst, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(sst.model(x), y).backward()
    optimizer.step()
    sst.after_step(optimizer)


def test_spectral_copy_is_the_same_function_and_export_round_trips():
    model = mlp()
    sst = SparseSpectralTraining(model, SparseSpectral(rank=2), torch.Generator().manual_seed(0))
    assert all(isinstance(layer, SpectralLinear) for layer in sst.layers.values())
    x, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(sst.model(x), model(x), rtol=1e-5, atol=1e-5)
    target = mlp(seed=7)
    sst.export(target)
    for (name, a), (_, b) in zip(model.state_dict().items(), target.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_resvd_reconstructs_the_effective_weight_exactly_and_keeps_sigma_non_negative():
    model = mlp()
    config = SparseSpectral(rank=3, period=4, resvd_every=1)
    sst = SparseSpectralTraining(model, config, torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(sst.model.parameters(), lr=1.0)
    clamped = 0
    for step in range(1, 13):
        x, y = batch(step)
        before = {n: (layer.u * layer.sigma) @ layer.vh for n, layer in sst.layers.items()}
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(sst.model(x), y).backward()
        if step in (2, 4):  # push the smallest singular values below 0
            for layer in sst.layers.values():
                layer.sigma.grad[-2:] += layer.sigma.detach()[-2:] + 1.0
        optimizer.step()
        clamped += sum(int((layer.sigma < 0).sum()) for layer in sst.layers.values())
        effective = {
            n: ((layer.u * layer.sigma.clamp(min=0)) @ layer.vh).detach()
            for n, layer in sst.layers.items()
        }
        sst.after_step(optimizer)
        for name, layer in sst.layers.items():
            assert bool((layer.sigma >= 0).all())
            if step % config.period == 0:  # re-SVD: same W, orthonormal factors, sorted sigma
                w = ((layer.u * layer.sigma) @ layer.vh).detach()
                torch.testing.assert_close(w, effective[name], rtol=0, atol=1e-5)
                eye = torch.eye(layer.pairs)
                torch.testing.assert_close(layer.u.T @ layer.u, eye, rtol=0, atol=1e-5)
                torch.testing.assert_close(layer.vh @ layer.vh.T, eye, rtol=0, atol=1e-5)
                assert bool((layer.sigma[:-1] >= layer.sigma[1:]).all())
            else:
                assert not torch.equal(effective[name], before[name].detach())
    assert clamped > 0  # the clamp was exercised


def test_a_step_changes_only_the_sampled_singular_vectors_and_all_sigma():
    sst = SparseSpectralTraining(
        mlp(), SparseSpectral(rank=2, period=100), torch.Generator().manual_seed(2)
    )
    optimizer = torch.optim.SGD(sst.model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for step in range(3):  # momentum and weight decay would move frozen pairs: they must not
        layers = list(sst.layers.values())
        old = [(layer.u.detach().clone(), layer.vh.detach().clone()) for layer in layers]
        sigma = [layer.sigma.detach().clone() for layer in layers]
        sgd_step(sst, optimizer, *batch(10 + step))
        for layer, (u, vh), s in zip(layers, old, sigma):
            active = layer.active
            assert int(active.sum()) == 2
            assert torch.equal(layer.u[:, ~active], u[:, ~active])
            assert torch.equal(layer.vh[~active], vh[~active])
            assert not torch.equal(layer.u[:, active], u[:, active])
            assert not torch.equal(layer.vh[active], vh[active])
            assert bool((layer.sigma != s).all())
    assert sst.trainable_per_step() == (2 * (16 + 12) + 12 + 16) + (2 * (5 + 16) + 5 + 5)


def test_pairs_are_sampled_with_the_sst_probabilities():
    sigma = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 0.0])
    probabilities = sampling_probabilities(sigma)
    torch.testing.assert_close(probabilities.sum(), torch.tensor(1.0))
    torch.testing.assert_close(probabilities[0], torch.tensor(0.5 / 6 + 0.5 * 8 / 16))
    layer = torch.nn.Linear(6, 6)
    with torch.no_grad():
        q1, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
        q2, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
        layer.weight.copy_(q1 @ torch.diag(sigma) @ q2.T)
    model = torch.nn.Sequential(layer)
    sst = SparseSpectralTraining(model, SparseSpectral(rank=1), torch.Generator().manual_seed(3))
    spectral = next(iter(sst.layers.values()))
    counts = torch.zeros(6)
    for _ in range(3000):
        sst.sample()
        counts += spectral.active.float()
    expected = sampling_probabilities(spectral.sigma.detach())
    assert float((counts / 3000 - expected).abs().max()) < 0.03


def test_sst_config_errors_name_key_value_and_allowed():
    with pytest.raises(ConfigError, match=r"client\.sst\.rank.*0.*>= 1"):
        from_mapping(SparseSpectral, {"rank": 0}, "client.sst")
    with pytest.raises(ConfigError, match=r"client\.sst\.period"):
        SparseSpectral(period=0)
    with pytest.raises(ConfigError, match=r"client\.sst\.resvd_every"):
        SparseSpectral(resvd_every=0)
    with pytest.raises(ConfigError, match=r"client\.sst\.ranks"):
        from_mapping(SparseSpectral, {"ranks": 2}, "client.sst")
    with pytest.raises(ConfigError, match=r"client\.optimizer\.name.*r-adazo"):
        LocalTraining(optimizer={"name": "r-adazo"}, sst={"rank": 2})
    with pytest.raises(ConfigError, match=r"client\.averaging"):
        LocalTraining(averaging={"kind": "ema"}, sst={"rank": 2})
    with pytest.raises(ConfigError, match=r"client\.sst\.rank"):
        LocalTraining(sst={"rank": -1})
    with pytest.raises(ValueError, match="nn.Linear"):
        SparseSpectralTraining(
            torch.nn.Sequential(torch.nn.ReLU()), SparseSpectral(), torch.Generator()
        )


def test_client_training_with_sst_lowers_the_loss_and_writes_dense_weights():
    model = mlp()
    x, _ = batch(20, rows=128)
    y = (x @ torch.randn(12, 5, generator=torch.Generator().manual_seed(4))).argmax(1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = float(torch.nn.functional.cross_entropy(model(x), y))
    sst = SparseSpectral(rank=2, period=3)
    training = LocalTraining(epochs=10, batch_size=32, lr=0.2, seed=0)
    loss, steps, averaged = train_with_methods(
        model, x, y, training, torch.Generator().manual_seed(0), sst=sst
    )
    with torch.no_grad():
        after = float(torch.nn.functional.cross_entropy(model(x), y))
    assert steps == 40 and averaged is None and after < 0.8 * before
    assert set(model.state_dict()) == set(start)  # still the dense architecture
    assert not torch.equal(model.state_dict()["layers.0.weight"], start["layers.0.weight"])


@pytest.mark.ray
def test_sst_clients_run_in_a_client_app_on_ray(ray_engine):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=8, seed=5)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(16,))
    methods = {"sst": {"rank": 4, "period": 2}}
    training = LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=1, **methods)
    app = make_client_app(model, spec, training)

    class Phases:
        def __init__(self):
            self.reports = []

        def phase_finished(self, report):
            self.reports.append(report)

    def federate():
        phases = Phases()
        random.seed(0)
        grid = ray_engine.open_run(app, 8, datasets=((spec, dataset),), observer=phases)
        final = run_rounds(
            FedAvg(fraction_evaluate=0.0), grid, to_record(initial_arrays(model, 0)), 2
        )
        return to_numpy(final), phases.reports

    (first, reports), (second, _) = federate(), federate()
    start = initial_arrays(model, 0)
    train = [r for r in reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [8, 8]
    assert set(first) == set(start)  # dense uploads
    for name, value in first.items():
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start[name])
        np.testing.assert_array_equal(value, second[name])


def test_experiment_config_selects_sst():
    from pathlib import Path

    from fedsim.frontend.run_config import ExperimentConfig

    path = Path(__file__).parents[2] / "experiments/workloads/configs/sst.toml"
    config = ExperimentConfig.load(path)
    assert config.client.sst == SparseSpectral(rank=8, period=5, resvd_every=1)
    assert config.client.uses_methods
