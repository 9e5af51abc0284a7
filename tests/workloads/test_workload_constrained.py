"""Smoothed primal-dual under linear inequality constraints: QP optimum, parity clients, Ray."""

import random

import numpy as np
import pytest
import scipy.optimize
import torch
from flwr.serverapp.strategy import FedAvg

from fedsim.config import ConfigError, from_mapping
from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.constrained import (
    LinearConstraints,
    SmoothedPrimalDual,
    train_constrained,
)
from fedsim.workloads.supervised import LocalTraining, make_client_app


def convex_qp(seed, n=10, m=6):
    rng = np.random.default_rng(seed)
    root = rng.standard_normal((n, n))
    q_matrix = root @ root.T / n + 0.5 * np.eye(n)
    q_vector = 3 * rng.standard_normal(n)
    a = rng.standard_normal((m, n))
    b = rng.uniform(0.1, 0.5, m)
    return q_matrix, q_vector, a, b


def reference_solution(q_matrix, q_vector, a, b):
    """The KKT point: SLSQP finds the active set, the KKT linear system gives the point."""
    result = scipy.optimize.minimize(
        lambda x: 0.5 * x @ q_matrix @ x + q_vector @ x,
        np.zeros(len(q_vector)),
        jac=lambda x: q_matrix @ x + q_vector,
        constraints=[{"type": "ineq", "fun": lambda x: b - a @ x, "jac": lambda x: -a}],
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 2000},
    )
    active = a @ result.x - b > -1e-6
    n, k = len(q_vector), int(active.sum())
    kkt = np.block([[q_matrix, a[active].T], [a[active], np.zeros((k, k))]])
    solution = np.linalg.solve(kkt, np.concatenate([-q_vector, b[active]]))
    x, multipliers = solution[:n], solution[n:]
    assert np.all(multipliers >= 0) and np.all(a @ x - b <= 1e-12)  # a true KKT point
    assert np.linalg.norm(x - result.x) < 1e-4
    return x


def solve(q_matrix, q_vector, a, b, steps=3000, **kwargs):
    w = torch.nn.Parameter(torch.zeros(len(q_vector), dtype=torch.float64))
    q_t, c_t = torch.from_numpy(q_matrix), torch.from_numpy(q_vector)
    optimizer = SmoothedPrimalDual([w], torch.from_numpy(a), torch.from_numpy(b), **kwargs)
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * w @ q_t @ w + c_t @ w).backward()  # exact gradient, one per step
        optimizer.step()
    return w.detach().numpy(), optimizer


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_gradients_reach_the_qp_optimum_with_no_violation(seed):
    q_matrix, q_vector, a, b = convex_qp(seed)
    star = reference_solution(q_matrix, q_vector, a, b)
    unconstrained = np.linalg.solve(q_matrix, -q_vector)
    assert np.max(a @ unconstrained - b) > 0.1  # the constraints bind
    w, optimizer = solve(q_matrix, q_vector, a, b)
    assert np.linalg.norm(w - star) < 1e-6 * max(1.0, np.linalg.norm(star))
    assert optimizer.violation() < 1e-8
    y = optimizer.dual.numpy()
    # KKT: y >= 0, complementary slackness, stationarity
    assert np.all(y >= 0)
    assert np.max(np.abs(y * (a @ w - b))) < 1e-7
    np.testing.assert_allclose(q_matrix @ w + q_vector + a.T @ y, 0.0, atol=1e-6)


def test_box_projection_and_penalty_keep_the_optimum():
    q_matrix, q_vector, a, b = convex_qp(2)
    eye = np.eye(len(q_vector))
    star = reference_solution(
        q_matrix, q_vector, np.vstack([a, eye, -eye]), np.concatenate([b, np.full(20, 0.3)])
    )
    assert np.max(np.abs(star)) == pytest.approx(0.3)  # the box binds
    w, optimizer = solve(q_matrix, q_vector, a, b, lower=-0.3, upper=0.3, penalty=1.0)
    assert np.all(np.abs(w) <= 0.3 + 1e-15)
    assert np.linalg.norm(w - star) < 1e-6
    assert optimizer.violation() < 1e-8


def test_smoothed_primal_dual_checks_its_arguments():
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    a, b = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(m, 3\)"):
        SmoothedPrimalDual([w], torch.ones(2, 4, dtype=torch.float64), b)
    with pytest.raises(ValueError, match=r"smoothing=0"):
        SmoothedPrimalDual([w], a, b, smoothing=0)
    with pytest.raises(ValueError, match=r"dual"):
        SmoothedPrimalDual([w], a, b, dual=torch.tensor([-1.0, 0.0], dtype=torch.float64))


def digits_client(partition=0):
    spec = DatasetSpec(source="digits", partition="iid", num_clients=4, seed=0)
    dataset = build_dataset(spec)
    x, y = dataset.train.client(partition)
    x = torch.from_numpy(np.array(x, dtype=np.float32))
    y = torch.from_numpy(np.array(y, dtype=np.int64))
    model_spec = ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10)
    model = build_model(model_spec)
    load_arrays(model, initial_arrays(model_spec, 0))
    return spec, dataset, model_spec, model, x, y


def test_parity_rows_measure_the_mean_logit_gap_of_the_two_groups():
    _, _, _, model, x, _ = digits_client()
    constraints = LinearConstraints(feature=21, threshold=0.5, epsilon=0.25)
    a, b = constraints.matrices(model, x)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    group = x.reshape(len(x), -1)[:, 21] > 0.5
    with torch.no_grad():
        logits = model(x).double()
    gap = logits[group].mean(0) - logits[~group].mean(0)
    torch.testing.assert_close(a @ w, torch.stack([gap, -gap], 1).reshape(-1), atol=1e-4, rtol=0)
    assert torch.equal(b, torch.full((20,), 0.25, dtype=torch.float64))
    nobody = LinearConstraints(feature=21, threshold=1e9)
    assert nobody.matrices(model, x)[0].shape == (0, w.numel())


def test_constrained_client_training_closes_the_gap_that_sgd_leaves_open():
    _, _, _, model, x, y = digits_client()
    constraints = LinearConstraints(feature=21, threshold=0.5, epsilon=0.1, lr=0.3)
    a, b = constraints.matrices(model, x)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_constrained(
        model,
        x,
        y,
        constraints,
        epochs=8,
        batch_size=32,
        max_steps=0,
        generator=torch.Generator().manual_seed(0),
    )
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    assert result["violation"] == pytest.approx(float((a @ w - b).clamp(min=0).max()))
    with torch.no_grad():
        constrained_loss = float(torch.nn.functional.cross_entropy(model(x), y))
    model.load_state_dict(start)
    with torch.no_grad():
        start_loss = float(torch.nn.functional.cross_entropy(model(x), y))
    free = LinearConstraints(feature=21, threshold=0.5, epsilon=1e6, lr=0.3)  # never binds
    unconstrained = train_constrained(
        model,
        x,
        y,
        free,
        epochs=8,
        batch_size=32,
        max_steps=0,
        generator=torch.Generator().manual_seed(0),
    )
    w_free = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    sgd_violation = float((a @ w_free - b).clamp(min=0).max())
    assert sgd_violation > 0.5
    assert result["violation"] < 0.1 * sgd_violation
    assert np.all(result["dual"] >= 0) and result["dual"].max() > 0
    assert np.all(unconstrained["dual"] == 0)
    assert constrained_loss < 0.6 * start_loss  # it still learns the task


def test_constraint_config_errors_name_key_value_and_allowed():
    with pytest.raises(ConfigError, match=r"client\.constraints\.kind.*budget.*parity"):
        from_mapping(LinearConstraints, {"kind": "budget"}, "client.constraints")
    with pytest.raises(ConfigError, match=r"client\.constraints\.epsilon"):
        LinearConstraints(epsilon=-1.0)
    with pytest.raises(ConfigError, match=r"client\.constraints\.smoothing"):
        LinearConstraints(smoothing=1.5)
    with pytest.raises(ConfigError, match=r"client\.constraints\.feature.*64"):
        _, _, _, model, x, _ = digits_client()
        LinearConstraints(feature=64).matrices(model, x)
    with pytest.raises(ConfigError, match=r"client\.optimizer.*client\.constraints"):
        LocalTraining(constraints={"epsilon": 0.1}, optimizer={"name": "mars-adamw"})
    with pytest.raises(ValueError, match="logreg"):
        spec = DatasetSpec(source="digits", partition="iid", num_clients=4, seed=0)
        mlp = ModelSpec(kind="mlp", input_shape=(64,), num_classes=10)
        make_client_app(mlp, spec, LocalTraining(constraints={"epsilon": 0.1}))


@pytest.mark.ray
def test_constrained_clients_run_in_a_client_app_on_ray(ray_engine):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=1.0, num_clients=6, seed=3)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="logreg", input_shape=dataset.feature_shape, num_classes=10)
    constraints = {"feature": 21, "threshold": 0.5, "epsilon": 0.05, "lr": 0.3}
    training = LocalTraining(epochs=3, batch_size=32, seed=1, constraints=constraints)
    app = make_client_app(model, spec, training)

    class Phases:
        def __init__(self):
            self.reports = []

        def phase_finished(self, report):
            self.reports.append(report)

    phases = Phases()
    random.seed(0)
    grid = ray_engine.open_run(app, 6, datasets=((spec, dataset),), observer=phases)
    start = initial_arrays(model, 0)
    final = to_numpy(run_rounds(FedAvg(fraction_evaluate=0.0), grid, to_record(start), 3))
    train = [r for r in phases.reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [6, 6, 6]
    metrics = [r.client_metrics for r in train]
    assert all(m["constraint-violation"] < m["constraint-violation-start"] for m in metrics[1:])
    assert metrics[-1]["dual-norm"] > 0  # duals kept in the clients' state
    for name, value in final.items():
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start[name])


def test_experiment_config_selects_constraints_and_checks_the_model():
    import tomllib
    from pathlib import Path

    from fedsim.frontend.run_config import ExperimentConfig

    path = Path(__file__).parents[2] / "experiments/workloads/configs/constrained.toml"
    config = ExperimentConfig.load(path)
    assert isinstance(config.client.constraints, LinearConstraints)
    assert config.client.constraints.epsilon == 0.05
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    raw["model"]["kind"] = "mlp"
    with pytest.raises(ConfigError, match=r"model\.kind.*mlp.*logreg"):
        ExperimentConfig.from_dict(raw)
    raw["model"]["kind"] = "logreg"
    raw["client"]["constraints"]["dual_lr"] = 0
    with pytest.raises(ConfigError, match=r"client\.constraints\.dual_lr"):
        ExperimentConfig.from_dict(raw)
