"""HDM-HB (monotone hypergradient descent with heavy ball): descent, speed, config, Ray."""

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
from fedsim.workloads.optim import HDMHB, ClientOptimizer, build_optimizer
from fedsim.workloads.supervised import LocalTraining, make_client_app


def spd_quadratic(seed, dim=40, condition=100.0):
    """f(x) = x'Ax/2 - b'x with eigenvalues geometric in [1, condition]; returns (A, b, f*)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    eigenvalues = torch.logspace(0, float(np.log10(condition)), dim, dtype=torch.float64)
    a = q @ torch.diag(eigenvalues) @ q.T
    b = torch.randn(dim, generator=g, dtype=torch.float64)
    solution = torch.linalg.solve(a, b)
    return a, b, float(0.5 * solution @ a @ solution - b @ solution)


def iterations_to_tolerance(step, value, f_start, f_star, tol=1e-6, limit=20000):
    for k in range(1, limit + 1):
        step()
        if (value() - f_star) / (f_start - f_star) <= tol:
            return k
    return limit


def test_hdm_hb_never_increases_f_and_beats_gradient_descent_on_a_quadratic():
    a, b, f_star = spd_quadratic(seed=3)
    lipschitz = float(torch.linalg.eigvalsh(a).max())

    def f(x):
        return 0.5 * x @ a @ x - b @ x

    x = torch.zeros(len(b), dtype=torch.float64)
    f_start = float(f(x))

    def gd_step():
        x.sub_((a @ x - b) / lipschitz)

    gd_count = iterations_to_tolerance(gd_step, lambda: float(f(x)), f_start, f_star)

    w = torch.nn.Parameter(torch.zeros(len(b), dtype=torch.float64))
    optimizer = HDMHB([w])
    losses = []

    def closure():
        optimizer.zero_grad()
        loss = f(w)
        loss.backward()
        return loss

    def hdm_step():
        losses.append(float(optimizer.step(closure)))
        assert float(f(w.detach())) == pytest.approx(losses[-1], rel=1e-12, abs=1e-12)

    hdm_count = iterations_to_tolerance(hdm_step, lambda: losses[-1], f_start, f_star)
    assert np.all(np.diff(losses) <= 0.0)  # monotone: null steps keep f
    assert gd_count > 100  # the problem is not trivially conditioned
    assert hdm_count <= 0.6 * gd_count


def test_hdm_hb_rejects_a_trial_that_raises_f_and_keeps_the_iterate():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = HDMHB([w], lr=50.0)  # far too large a step size rate: first trials overshoot
    curvature = torch.tensor([1.0, 400.0], dtype=torch.float64)

    def closure():
        optimizer.zero_grad()
        loss = 0.5 * (curvature * w * w).sum()
        loss.backward()
        return loss

    previous = float(closure().detach())
    rejected = 0
    for _ in range(40):
        before = w.detach().clone()
        now = float(optimizer.step(closure))
        assert now <= previous
        if now == previous:
            rejected += 1
            assert torch.equal(w.detach(), before)
        previous = now
    assert rejected >= 1
    assert previous < 1e-2 * 0.5 * (1 + 400 * 4)


def test_hdm_hb_step_needs_a_closure_and_checks_its_arguments():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="closure"):
        HDMHB([w]).step()
    with pytest.raises(ValueError, match=r"beta_max=1\.0"):
        HDMHB([w], beta_max=1.0)
    with pytest.raises(ValueError, match=r"lr=0"):
        HDMHB([w], lr=0)


def test_client_optimizer_config_selects_hdm_hb_and_names_bad_values():
    config = from_mapping(ClientOptimizer, {"name": "hdm-hb", "lr": 0.2}, "client.optimizer")
    assert config.full_batch and not config.zeroth_order
    w = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer(config, [w], generator=torch.Generator())
    assert isinstance(optimizer, HDMHB) and optimizer.defaults["lr"] == 0.2
    with pytest.raises(ConfigError, match=r"client\.optimizer\.name.*hdm-hbb.*hdm-hb"):
        from_mapping(ClientOptimizer, {"name": "hdm-hbb"}, "client.optimizer")
    with pytest.raises(ConfigError, match=r"client\.optimizer\.weight_decay"):
        ClientOptimizer(name="hdm-hb", weight_decay=0.1)
    with pytest.raises(ConfigError, match=r"client\.optimizer\.lr"):
        ClientOptimizer(name="hdm-hb", lr=-1.0)


def test_full_batch_client_training_is_monotone_in_the_full_loss():
    spec = DatasetSpec(source="digits", partition="iid", num_clients=8, seed=0)
    dataset = build_dataset(spec)
    x, y = dataset.train.client(0)
    x = torch.from_numpy(np.array(x, dtype=np.float32))
    y = torch.from_numpy(np.array(y, dtype=np.int64))
    model = build_model(ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10))
    load_arrays(
        model,
        initial_arrays(
            ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10), 0
        ),
    )

    def full_loss():
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x), y))

    start = full_loss()
    hdm = ClientOptimizer(name="hdm-hb")
    first = LocalTraining(epochs=1, batch_size=len(y), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    _, steps, _ = train_with_methods(model, x, y, first, torch.Generator(), optimizer=hdm)
    # a fresh optimiser's first trial is x itself (P = 0, no momentum yet): a null step
    assert steps == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    training = LocalTraining(epochs=5, batch_size=len(y), seed=0)
    losses = [start]
    for _ in range(6):  # 6 rounds of 5 full-batch steps on the same client
        _, steps, _ = train_with_methods(model, x, y, training, torch.Generator(), optimizer=hdm)
        assert steps == 5
        losses.append(full_loss())
    assert np.all(np.diff(losses) <= 0.0)
    assert losses[-1] < 0.5 * start


@pytest.mark.ray
def test_hdm_hb_clients_run_in_a_client_app_on_ray(ray_engine):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=8, seed=4)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10)
    methods = {"optimizer": {"name": "hdm-hb"}}
    training = LocalTraining(epochs=10, batch_size=10_000, seed=1, **methods)
    app = make_client_app(model, spec, training)

    class Phases:
        def __init__(self):
            self.reports = []

        def phase_finished(self, report):
            self.reports.append(report)

    phases = Phases()
    random.seed(0)
    grid = ray_engine.open_run(app, 8, datasets=((spec, dataset),), observer=phases)
    start = initial_arrays(model, 0)
    final = to_numpy(run_rounds(FedAvg(fraction_evaluate=0.0), grid, to_record(start), 2))
    train = [r for r in phases.reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [8, 8]
    assert all(r.client_metrics["steps"] == 10 for r in train)
    assert train[1].client_metrics["train_loss"] < train[0].client_metrics["train_loss"]
    for name, value in final.items():
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start[name])


def test_experiment_config_selects_hdm_hb():
    from pathlib import Path

    from fedsim.frontend.run_config import ExperimentConfig

    path = Path(__file__).parents[2] / "experiments/workloads/configs/hdm_hb.toml"
    config = ExperimentConfig.load(path)
    assert config.client.optimizer.name == "hdm-hb" and config.client.optimizer.full_batch
