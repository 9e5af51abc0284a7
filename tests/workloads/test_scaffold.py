"""SCAFFOLD as the client method [client.scaffold] (fedsim/workloads/scaffold.py): the
corrected step and option II on one full-batch step, the server's steps on x and c, a run
from a config, and the combinations it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from fedsim.config import ConfigError
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.scaffold import CLIENT_STATE, KEY, Scaffold, ScaffoldServer, ScaffoldTraining
from fedsim.workloads.supervised import LocalTraining, client_training
from fedsim.workloads.training import LocalSteps, TrainTask
from tests.run_dir_support import rounds, run, small_quickstart

LOGREG = ModelSpec(kind="logreg", input_shape=(64,), num_classes=10)


def _one_full_batch_step(server_c, own_c, lr=0.1):
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.normal(size=(20, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=20))
    model = build_model(LOGREG)
    start = initial_arrays(LOGREG, 1)
    load_arrays(model, start)
    state = RecordDict()
    if own_c is not None:
        state[CLIENT_STATE] = to_record(own_c)
    training = ScaffoldTraining(LOGREG, LocalSteps(batch_size=64, lr=lr))
    task = TrainTask(0, x, y, 1, inputs={KEY: server_c})
    result = training.train(model, task, torch.Generator().manual_seed(0), state)
    ref = build_model(LOGREG)  # the full-batch gradient at the start, on its own
    load_arrays(ref, start)
    nn.functional.cross_entropy(ref(x), y).backward()
    grad = {k: p.grad.numpy().copy() for k, p in ref.named_parameters()}
    trained = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return start, grad, trained, state, result


def test_one_full_batch_step_corrects_the_gradient_and_option_ii_gives_the_gradient():
    rng = np.random.default_rng(0)
    shapes = {k: v.shape for k, v in initial_arrays(LOGREG, 1).items()}
    c = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    ci = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    start, grad, trained, state, result = _one_full_batch_step(c, ci)
    assert result.steps == 1
    new_ci = to_numpy(state[CLIENT_STATE])
    for k in shapes:
        # y = x - lr (g + c - c_i): the step moved along the corrected gradient
        np.testing.assert_allclose(trained[k], start[k] - 0.1 * (grad[k] + c[k] - ci[k]), atol=1e-5)
        # with K = 1 option II's c_i+ is the gradient at x (option I), whatever c and c_i
        np.testing.assert_allclose(new_ci[k], grad[k], atol=1e-4)
        np.testing.assert_allclose(result.replies[KEY][k], new_ci[k] - ci[k], atol=1e-6)


def test_with_zero_controls_the_step_is_plain_sgd():
    zeros = {k: np.zeros_like(v) for k, v in initial_arrays(LOGREG, 1).items()}
    start, grad, trained, _, _ = _one_full_batch_step(zeros, None)
    for k in start:
        np.testing.assert_allclose(trained[k], start[k] - 0.1 * grad[k], atol=1e-5)


def test_the_server_steps_the_model_by_eta_g_and_the_control_by_the_cohort_share():
    server = ScaffoldServer(Scaffold(server_lr=0.5), population=8)
    sent = server.instruction(1, {"w": np.full(3, 1.0, np.float32)})
    np.testing.assert_array_equal(sent["w"], 0.0)  # c starts at zero
    server.control = {"w": np.full(3, 0.25)}
    deltas = [{"w": np.full(3, 1.0, np.float32)}, {"w": np.full(3, 3.0, np.float32)}]
    new = server.aggregate(1, deltas, {"w": np.full(3, 4.5, np.float32)})
    # x + 0.5 * (4.5 - 1) = 2.75; c + 2/8 * mean(1, 3) = 0.75
    np.testing.assert_allclose(new["w"], 2.75)
    np.testing.assert_allclose(server.control["w"], 0.75)
    np.testing.assert_allclose(server.instruction(2, new)["w"], 0.75)


def test_the_table_selects_scaffold_and_refuses_other_methods_by_name():
    assert isinstance(client_training(LOGREG, LocalTraining(scaffold={})), ScaffoldTraining)
    with pytest.raises(ConfigError, match="client.scaffold.server_lr"):
        LocalTraining(scaffold={"server_lr": 0})
    with pytest.raises(ConfigError, match="client.scaffold"):
        LocalTraining(scaffold={}, optimizer={"name": "mars-adamw"})


def test_a_scaffold_run_from_a_config_trains_and_keeps_a_server_control(tmp_path: Path):
    raw = small_quickstart(client={"scaffold": {"server_lr": 1.0}})
    raw["evaluation"]["clients"] = 0
    run(raw, tmp_path / "run")
    lines = rounds(tmp_path / "run")
    assert [line["round"] for line in lines if line["round"] > 0] == [1, 2, 3]
    assert all(line["train"]["clients"] == 10 for line in lines if line["round"] > 0)


def test_scaffold_with_a_private_strategy_is_refused_at_load():
    raw = small_quickstart(
        client={"scaffold": {}},
        strategy={"name": "dp-fedavg", "options": {"clipping_norm": 1.0, "noise_multiplier": 1.0}},
    )
    with pytest.raises(ConfigError, match="client.scaffold"):
        ExperimentConfig.from_dict(raw)
