"""Conformal workloads: split conformal, multi-group online conformal (groups = clients),
DPSM conformal training; config keys; both inside ClientApps on the Ray engine."""

import math
import random

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_strategy import build_experiment_strategy, participation_for
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays
from fedsim.record_codec import to_record
from fedsim.workloads.conformal import (
    DPSM,
    ConformalTraining,
    GroupStream,
    OnlineCalibrator,
    OnlineConformal,
    class_scores,
    coverage_and_size,
    label_scores,
    prediction_sets,
    soft_set_size,
    split_conformal_threshold,
)
from fedsim.workloads.methods import train_with_methods
from fedsim.workloads.supervised import LocalTraining, make_client_app
from fedsim.workloads.training import as_tensors
from strategies.methods.conformal import ConformalEvaluation
from strategies.plumbing.wrapper import server_reply


def shifted_stream(seed: int, points: int = 8000):
    """Four groups whose score scales differ and reverse halfway through the stream."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 4, points)
    before, after = np.array([0.2, 0.4, 0.6, 0.9]), np.array([0.9, 0.6, 0.3, 0.2])
    late = np.arange(points) >= points // 2
    scale = np.where(late, after[groups], before[groups])
    return scale * rng.beta(2, 2, points), groups, late


# ---------------------------------------------------------------- online calibration


def test_multigroup_miss_rate_per_group_tracks_alpha_where_aci_does_not():
    scores, groups, late = shifted_stream(seed=0)
    results = {}
    for kind in ("aci", "multigroup"):
        calibrator = OnlineCalibrator(OnlineConformal(kind=kind, alpha=0.1, eta=0.05))
        misses, _ = calibrator.observe_stream(scores, groups)
        results[kind] = (misses, calibrator.miss_rates())
    aci_misses, aci_rates = results["aci"]
    assert abs(aci_misses.mean() - 0.1) < 0.01  # ACI: marginal coverage holds...
    assert max(abs(r - 0.1) for r in aci_rates.values()) > 0.07  # ...per group it does not
    aci_late = [aci_misses[late & (groups == g)].mean() for g in range(4)]
    assert max(aci_late) > 0.3 and min(aci_late) < 0.01  # after the shift: far off both ways
    mg_misses, mg_rates = results["multigroup"]
    assert set(mg_rates) == {0, 1, 2, 3}
    assert all(abs(r - 0.1) < 0.015 for r in mg_rates.values())
    assert all(abs(mg_misses[late & (groups == g)].mean() - 0.1) < 0.03 for g in range(4))


def test_multigroup_without_global_group_and_overlap_free_thresholds():
    calibrator = OnlineCalibrator(OnlineConformal(alpha=0.2, eta=0.5, global_group=False))
    # group 7 misses (score 1 > 0), group 3 is covered (score -1 <= 0): thetas move apart
    calibrator.observe(1.0, 7)
    calibrator.observe(-1.0, 3)
    assert calibrator.threshold(7) == pytest.approx(0.5 * 0.8)
    assert calibrator.threshold(3) == pytest.approx(-0.5 * 0.2)
    assert calibrator.theta_global == 0.0
    with_global = OnlineCalibrator(OnlineConformal(alpha=0.2, eta=0.5))
    with_global.observe(1.0, 7)
    assert with_global.threshold(7) == pytest.approx(0.8)  # own + global theta
    assert with_global.threshold(3) == pytest.approx(0.4)  # global theta only


def test_a_round_of_streams_is_interleaved_and_reported_per_group():
    streams = [
        GroupStream(5, np.array([0.9, 0.1, 0.8]), np.array([[0.9, 0.2], [0.1, 0.5], [0.8, 0.0]])),
        GroupStream(2, np.array([0.3]), np.array([[0.3, 0.6]])),
    ]
    config = OnlineConformal(kind="multigroup", alpha=0.25, eta=0.4)
    reference = OnlineCalibrator(config)
    misses, thresholds = reference.observe_stream([0.3, 0.9, 0.1, 0.8], [2, 5, 5, 5])
    calibrator = OnlineCalibrator(config)
    metrics = calibrator.observe_round(streams)
    assert calibrator.theta == reference.theta
    assert calibrator.theta_global == reference.theta_global
    assert metrics["conformal-groups"] == [2, 5]
    assert metrics["conformal-group-miss"] == [float(misses[0]), float(misses[1:].mean())]
    assert metrics["conformal-miss"] == pytest.approx(misses.mean())
    sizes = [
        (np.array(s) <= q).sum()
        for s, q in zip([[0.3, 0.6], [0.9, 0.2], [0.1, 0.5], [0.8, 0.0]], thresholds, strict=True)
    ]
    assert metrics["conformal-set-size"] == pytest.approx(np.mean(sizes))
    totals = calibrator.miss_rates()
    assert metrics["conformal-max-gap"] == pytest.approx(
        max(abs(t - 0.25) for t in totals.values())
    )
    second = calibrator.observe_round(streams[1:])
    assert second["conformal-groups"] == [2]
    assert second["conformal-group-miss-total"] == [calibrator.miss_rates()[2]]
    with pytest.raises(ValueError, match="one stream per round"):
        calibrator.observe_round([streams[1], streams[1]])


def test_evaluate_replies_without_scores_are_an_error():
    strategy = ConformalEvaluation(FedAvg(), OnlineConformal())
    metrics = MetricRecord({"num-examples": 3, "accuracy": 0.5})
    reply = server_reply(RecordDict({"metrics": metrics}), 1)
    with pytest.raises(RuntimeError, match="1 of 1 evaluate replies carry no conformal scores"):
        strategy.aggregate_evaluate(1, [reply])


# ---------------------------------------------------------------- split conformal


def test_split_conformal_threshold_rank_and_coverage():
    assert split_conformal_threshold(np.arange(1.0, 10.0), 0.2) == 8.0  # ceil(10 * 0.8) = 8th
    assert split_conformal_threshold(np.arange(5.0), 0.1) == math.inf  # ceil(6 * 0.9) = 6 > 5
    with pytest.raises(ValueError, match="alpha"):
        split_conformal_threshold(np.arange(5.0), 1.0)
    rng = np.random.default_rng(4)
    covered = []
    for _ in range(400):  # exchangeable calibration + test scores: coverage >= 1 - alpha
        draws = rng.exponential(size=51)
        covered.append(draws[50] <= split_conformal_threshold(draws[:50], 0.1))
    assert np.mean(covered) >= 0.9 - 0.03
    scores = np.array([[0.1, 0.7, 0.95], [0.6, 0.2, 0.3]])
    np.testing.assert_array_equal(
        prediction_sets(scores, 0.5), [[True, False, False], [False, True, True]]
    )
    assert coverage_and_size(scores, np.array([1, 2]), 0.5) == (0.5, 1.5)


# ---------------------------------------------------------------- DPSM


def test_dpsm_quantile_converges_to_the_empirical_quantile_with_a_frozen_model():
    generator = torch.Generator().manual_seed(0)
    model = build_model(ModelSpec(kind="mlp", input_shape=(20,), num_classes=5, hidden=(16,)))
    x = torch.randn(2000, 20, generator=generator)
    y = torch.randint(0, 5, (2000,), generator=generator)
    with torch.no_grad():
        logits = model(x)  # frozen model: fixed scores
    truth = label_scores(1.0 - torch.softmax(logits, 1).numpy(), y.numpy())
    objective = DPSM(ConformalTraining(alpha=0.1, lr_qr=0.01, initial_tau=0.0))
    taus = []
    for step in range(600):
        idx = torch.randint(0, 2000, (64,), generator=generator)
        objective.loss(logits[idx], y[idx])
        if step >= 300:
            taus.append(objective.tau)
    empirical = np.quantile(truth, 0.9)
    assert abs(np.mean(taus) - empirical) < 0.01
    assert abs((truth <= np.mean(taus)).mean() - 0.9) < 0.02


def test_soft_set_size_term_shrinks_the_sets():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 10, generator=generator, requires_grad=True)
    size = soft_set_size(1.0 - torch.softmax(logits, 1), tau=0.8, temperature=0.1)
    size.backward()
    with torch.no_grad():
        stepped = logits - 5.0 * logits.grad
        after = soft_set_size(1.0 - torch.softmax(stepped, 1), tau=0.8, temperature=0.1)
    assert after < size
    objective = DPSM(ConformalTraining(mu_size=0.1))
    one = objective.loss(
        logits[:1].detach(), torch.tensor([3])
    )  # a one-row batch: CE only, tau kept
    assert objective.tau == 0.5
    assert float(one.detach()) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits[:1].detach(), torch.tensor([3])))
    )


@pytest.fixture(scope="module")
def digits():
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=8, seed=2)
    return spec, build_dataset(spec)


def test_dpsm_trained_model_is_covered_after_split_conformal_calibration(digits):
    _, dataset = digits
    x_all = np.concatenate([dataset.train.client(k)[0] for k in range(8)])
    y_all = np.concatenate([dataset.train.client(k)[1] for k in range(8)])
    x_train, y_train = as_tensors(x_all, y_all)
    x_held, y_held = as_tensors(*dataset.central_test)
    spec = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    model = build_model(spec)
    load_arrays(model, initial_arrays(spec, seed=0))
    objective = DPSM(ConformalTraining(alpha=0.1, mu_size=0.1, lr_qr=0.05))
    training = LocalTraining(epochs=4, batch_size=32, lr=0.1, seed=0)
    loss, steps, _ = train_with_methods(
        model,
        x_train,
        y_train,
        training,
        torch.Generator().manual_seed(0),
        objective=objective,
    )
    assert steps == 4 * math.ceil(len(y_train) / 32) and np.isfinite(loss)
    assert objective.tau != 0.5 and objective.last_size > 0
    scores, labels = class_scores(model, x_held), y_held.numpy()
    # Split conformal covers 1 - alpha in expectation over the calibration/test split.
    coverages, sizes = [], []
    for order in map(np.random.default_rng(0).permutation, [len(labels)] * 100):
        calib, test = order[: len(order) // 2], order[len(order) // 2 :]
        q = split_conformal_threshold(label_scores(scores[calib], labels[calib]), 0.1)
        coverage, size = coverage_and_size(scores[test], labels[test], q)
        coverages.append(coverage)
        sizes.append(size)
    assert np.mean(coverages) >= 0.9 - 0.015
    assert 0.5 < np.mean(sizes) < 3.0  # informative sets: a trained model, not "all classes"


# ---------------------------------------------------------------- config keys


def experiment(client=None, evaluation=None):
    return ExperimentConfig.from_dict(
        {
            "name": "conformal",
            "seed": 1,
            "rounds": 2,
            "data": {"source": "digits", "partition": "dirichlet", "alpha": 0.5, "num_clients": 6},
            "model": {"kind": "mlp", "hidden": [16]},
            "client": {"epochs": 1, "batch_size": 16, "lr": 0.1, **(client or {})},
            "strategy": {"name": "fedavg", "clients_per_round": 6},
            "evaluation": {"every": 1, "central_rows": 100, "clients": 6, **(evaluation or {})},
            "engine": {"backend": "local"},
        }
    )


def test_conformal_tables_become_configs_and_bad_values_name_their_key():
    config = experiment(
        {"conformal": {"kind": "dpsm", "alpha": 0.05, "mu_size": 0.1, "lr_qr": 0.02}},
        {"conformal": {"kind": "aci", "alpha": 0.2, "eta": 0.1}},
    )
    assert config.client.conformal == ConformalTraining(alpha=0.05, mu_size=0.1, lr_qr=0.02)
    assert config.evaluation.conformal == OnlineConformal(kind="aci", alpha=0.2, eta=0.1)
    assert config.client.uses_methods
    strategy = build_experiment_strategy(config, participation_for(config, 6))
    assert isinstance(strategy.strategy, ConformalEvaluation)
    for client, evaluation, key in [
        ({"conformal": {"kind": "conftr"}}, None, "client.conformal.kind"),
        ({"conformal": {"alpha": 1.5}}, None, "client.conformal.alpha"),
        ({"conformal": {"mu_size": -1}}, None, "client.conformal.mu_size"),
        ({"conformal": {"lr_qr": 0}}, None, "client.conformal.lr_qr"),
        ({"conformal": {"temperature": 0}}, None, "client.conformal.temperature"),
        ({"conformal": {"initial_tau": 2}}, None, "client.conformal.initial_tau"),
        ({"conformal": {"size": 1}}, None, "client.conformal.size"),
        ({"conformal": {}, "optimizer": {"name": "r-adazo"}}, None, "client.optimizer.name"),
        ({"conformal": {}, "momentum": 0.9, "keep_momentum": True}, None, "client.conformal"),
        (None, {"conformal": {"kind": "mondrian"}}, "evaluation.conformal.kind"),
        (None, {"conformal": {"alpha": 0}}, "evaluation.conformal.alpha"),
        (None, {"conformal": {"eta": -0.1}}, "evaluation.conformal.eta"),
        (None, {"conformal": {}, "clients": 0}, "evaluation.clients"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            experiment(client, evaluation)
    with pytest.raises(ValueError, match="client.optimizer.name"):
        LocalTraining(optimizer={"name": "zo-adamm"}, conformal={})


def test_conformal_keys_from_config_reach_rounds_jsonl(tmp_path, local_engine):
    config = experiment({"conformal": {"mu_size": 0.1}}, {"conformal": {"kind": "multigroup"}})
    run_experiment(config, tmp_path / "run", progress=False, engine=local_engine)
    rounds = [r for r in read_rounds(tmp_path / "run" / "rounds.jsonl") if r["round"] >= 1]
    assert len(rounds) == 2
    for record in rounds:
        calibrated = record["aggregated_evaluate"]
        assert calibrated["conformal-groups"] == list(range(6))
        assert all(0 <= m <= 1 for m in calibrated["conformal-group-miss"])
        assert 0 <= calibrated["accuracy"] <= 1  # the wrapped FedAvg still aggregates
        assert "dpsm-tau" in record["train"]["metrics"]
    first, second = (r["train"]["metrics"]["dpsm-tau"] for r in rounds)
    assert first != second


# ---------------------------------------------------------------- on the Ray engine


class Phases:
    def __init__(self):
        self.reports = []

    def phase_finished(self, report):
        self.reports.append(report)


@pytest.mark.ray
def test_multigroup_calibration_over_client_evaluations_on_ray(ray_engine, digits):
    spec, dataset = digits
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(16,))
    app = make_client_app(model, spec, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=1))
    strategy = ConformalEvaluation(
        FedAvg(fraction_evaluate=1.0), OnlineConformal(alpha=0.1, eta=0.05)
    )
    outcomes = []
    random.seed(0)
    grid = ray_engine.open_run(app, 8, datasets=((spec, dataset),))
    run_rounds(strategy, grid, to_record(initial_arrays(model, 0)), 2, on_round=outcomes.append)
    test_rows = dataset.test.sizes()
    evaluated = [k for k in range(8) if test_rows[k] > 0]
    points = {k: 0 for k in evaluated}
    for outcome in outcomes:
        metrics = dict(outcome.evaluate_metrics.items())
        assert metrics["conformal-groups"] == evaluated
        assert 0 <= metrics["accuracy"] <= 1 and 1 <= metrics["conformal-set-size"] <= 10
        for k in evaluated:
            points[k] += test_rows[k]
    assert strategy.calibrator.points == points  # every test row of every client, every round
    totals = strategy.calibrator.miss_rates()
    assert list(dict(outcomes[-1].evaluate_metrics.items())["conformal-group-miss-total"]) == [
        pytest.approx(totals[k]) for k in evaluated
    ]
    assert set(strategy.calibrator.theta) == set(evaluated)


@pytest.mark.ray
def test_dpsm_training_runs_in_a_client_app_on_ray_and_keeps_tau(ray_engine, digits):
    spec, dataset = digits
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(16,))
    methods = {"conformal": {"alpha": 0.1, "lr_qr": 0.04, "initial_tau": 0.0}}
    app = make_client_app(model, spec, LocalTraining(epochs=1, batch_size=16, seed=1, **methods))
    phases = Phases()
    random.seed(0)
    grid = ray_engine.open_run(app, 8, datasets=((spec, dataset),), observer=phases)
    final = run_rounds(FedAvg(fraction_evaluate=0.0), grid, to_record(initial_arrays(model, 0)), 2)
    train = [r for r in phases.reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [8, 8]
    first, second = (r.client_metrics["dpsm-tau"] for r in train)
    # tau starts at 0 (every score above it), so each step raises it by lr_qr * (1 - alpha)
    # until it nears the scores' 0.9 quantile; the second round continues from the first
    # round's tau, kept in the client state (a reset would give about the same tau again)
    assert 0.1 < first < 0.8 and second > first + 0.15
    assert all(r.client_metrics["dpsm-size"] > 0 for r in train)
    assert final is not None
