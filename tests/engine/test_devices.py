"""Accelerators (issue 20, point 4): ``[engine] device`` / ``--device``, GPU shares of Ray
workers, and the device string reaching the model and every batch of the built-in
workloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from byo_support import write_user_module
from torch import nn

from fedsim import cli
from fedsim.config import ConfigError
from fedsim.engine import EngineConfig
from fedsim.engine.simulation import gpu_share
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.models import (
    ModelSpec,
    build_model,
    check_device_available,
    load_arrays,
    model_arrays,
)
from fedsim.randomness import RunSecret

SECRETS = RunSecret.from_passphrase("devices")
QUICKSTART = Path(__file__).parents[1] / "apps" / "quickstart"
#: a device this machine lacks: the test reroutes every move there to the CPU and records it
FAKE = "cuda:7"


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_devices_a_run_may_name(device):
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:01", "tpu", ""])
def test_unknown_device_strings_are_refused_naming_the_key(device):
    with pytest.raises(ConfigError, match=r"engine\.device = .* 'cpu', 'cuda', 'cuda:N'"):
        EngineConfig(device=device)


def test_gpus_for_cpu_workers_and_cuda_n_for_ray_gpus_contradict():
    with pytest.raises(ConfigError) as err:
        EngineConfig(device="cpu", gpus_per_worker=0.5)
    assert err.value.key == "engine.gpus_per_worker" and "engine.device = 'cuda'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        EngineConfig(device="mps", gpus_per_worker=1)
    assert err.value.key == "engine.gpus_per_worker"
    with pytest.raises(ConfigError) as err:
        EngineConfig(device="cuda:1", gpus_per_worker=0.25)
    assert err.value.key == "engine.device" and "as cuda:0" in str(err.value)
    # what fits: Ray's share with cuda, cuda:N addressed by hand with no Ray GPUs
    assert EngineConfig(device="cuda", gpus_per_worker=0.25).gpus_per_worker == 0.25
    assert EngineConfig(device="cuda:1", gpus_per_worker=0).device == "cuda:1"
    assert EngineConfig(device="cpu", gpus_per_worker=0).gpus_per_worker == 0


@pytest.mark.parametrize(
    "gpus, workers, share", [(1, 4, 0.25), (2, 3, 0.5), (4, 4, 1.0), (8, 2, 1.0), (2, 5, 1 / 3)]
)
def test_unset_gpus_per_worker_spreads_cuda_workers_over_the_gpus(gpus, workers, share):
    """Each share divides 1 (Ray packs a fraction within one GPU) and every worker fits."""
    got = gpu_share(gpus, workers)
    assert got == pytest.approx(share)
    per_gpu = round(1 / got)
    assert per_gpu * gpus >= workers


def test_cuda_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(ConfigError, match=r"engine\.device = 'cuda' .*Ray cluster with GPUs"):
        gpu_share(0, 2)


@pytest.fixture()
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_a_missing_device_is_refused_naming_the_key(no_cuda, monkeypatch):
    with pytest.raises(ConfigError, match=r"engine\.device = 'cuda' .*sees 0 CUDA GPU"):
        check_device_available("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device_available("cuda:1")
    with pytest.raises(ConfigError, match=r"engine\.device = 'cuda:2' .*sees 2 CUDA GPU"):
        check_device_available("cuda:2")
    check_device_available("cpu")


def digits_config(**engine):
    return {
        "rounds": 1,
        "data": {"source": "digits", "partition": "iid", "num_clients": 4},
        "model": {"kind": "logreg"},
        "strategy": {"clients_per_round": 2},
        "engine": {"backend": "local", **engine},
    }


def test_run_with_cuda_on_a_machine_without_it_fails_before_anything_runs(
    no_cuda, tmp_path, capsys
):
    """``fedsim run --device cuda`` exits with the error and writes no run directory."""
    path = tmp_path / "config.toml"
    path.write_text(
        'rounds = 1\n[data]\nsource = "digits"\npartition = "iid"\nnum_clients = 4\n'
        '[strategy]\nclients_per_round = 2\n[engine]\nbackend = "local"\n'
    )
    code = cli.main(["run", str(path), "--out", str(tmp_path / "out"), "--device", "cuda"])
    assert code != 0
    assert "engine.device = 'cuda'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    code = cli.main(["run", str(path), "--out", str(tmp_path / "out"), "--device", "gpu"])
    assert code != 0 and "--device = 'gpu'" in capsys.readouterr().err
    app = ["flwr-run", str(QUICKSTART), "--num-supernodes", "2", "--out", str(tmp_path / "f")]
    code = cli.main([*app, "--device", "cuda:x"])
    assert code != 0 and "--device = 'cuda:x'" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()
    with pytest.raises(ConfigError, match=r"engine\.gpus_per_worker"):
        ExperimentConfig.from_dict(digits_config(gpus_per_worker=1))


@pytest.mark.parametrize("strategy", ["pfedhb", "pfedbayes"])
def test_personalised_clients_follow_the_device(moves, tmp_path, strategy):
    """The Bayesian clients of the personalised strategies place their models on the device
    once per process (at most two: pFedBayes's personal and local-global models) and move
    every client's training and test rows there."""
    raw = {
        "seed": 3,
        "rounds": 1,
        "data": {"source": "digits", "partition": "iid", "num_clients": 4, "test_fraction": 0.25},
        "model": {"kind": "bayes-mlp", "hidden": [6]},
        "personal": {"head_steps": 1, "body_epochs": 1, "mc_samples": 2, "eval_samples": 2},
        "strategy": {"name": strategy, "clients_per_round": 2, "sampling": "uniform"},
        "evaluation": {"every": 1},
        "engine": {"backend": "local", "device": FAKE},
    }
    run_experiment(
        ExperimentConfig.from_dict(raw), tmp_path / "run", progress=False, secrets=SECRETS
    )
    modules = [name for kind, _, name in moves if kind == "module"]
    assert modules and set(modules) == {"BayesMLP"} and len(modules) <= 2  # one per slot
    rows = [s for kind, s, dtype in moves if kind == "tensor" and dtype == "torch.float32"]
    labels = [s for kind, s, dtype in moves if kind == "tensor" and dtype == "torch.int64"]
    assert rows and len(rows) == len(labels)
    assert all(len(s) == 2 and s[1] == 64 for s in rows)  # digits' 8x8 features, flattened
    assert sorted(s[0] for s in rows) == sorted(s[0] for s in labels)


@pytest.fixture()
def moves(monkeypatch):
    """Every ``.to(FAKE)`` of a module or tensor is recorded and carried out on the CPU
    instead: what reached the device, without one."""
    seen: list[tuple[str, tuple[int, ...], str]] = []

    def swap(args, kwargs):
        hit = False
        args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, (str, torch.device)) and str(a) == FAKE:
                args[i], hit = "cpu", True
        if str(kwargs.get("device")) == FAKE:
            kwargs["device"], hit = "cpu", True
        return hit, tuple(args), kwargs

    tensor_to, module_to = torch.Tensor.to, nn.Module.to

    def to_tensor(self, *args, **kwargs):
        hit, args, kwargs = swap(args, kwargs)
        if hit:
            seen.append(("tensor", tuple(self.shape), str(self.dtype)))
        return tensor_to(self, *args, **kwargs)

    def to_module(self, *args, **kwargs):
        hit, args, kwargs = swap(args, kwargs)
        if hit:
            seen.append(("module", (), type(self).__name__))
        return module_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_tensor)
    monkeypatch.setattr(nn.Module, "to", to_module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    return seen


@pytest.mark.parametrize("client", [{}, {"optimizer": {"name": "mars-adamw"}}])
def test_the_device_reaches_the_model_and_every_batch(moves, tmp_path, client):
    """A run on ``device = FAKE`` (in-process workers): the workload moves its model there
    once and the rows of every client it trains and evaluates (features (n, 5) float32,
    labels (n,) int64), for plain SGD and for the client methods. Without the plumbing
    nothing reaches FAKE and the test fails."""
    code = write_user_module(tmp_path / "user")
    raw = {
        "rounds": 2,
        "seed": 2,
        "data": {
            "source": "python",
            "loader": "byo_user:clients",
            "python_path": [str(code)],
            "partition": "natural",
            "num_clients": 4,
            "options": {"count": 4, "rows": 10},
        },
        "model": {"factory": "byo_user:make", "python_path": [str(code)]},
        "client": {"batch_size": 4, **client},
        "strategy": {"clients_per_round": 2},
        "evaluation": {"clients": 2},
        "engine": {"backend": "local", "device": FAKE},
    }
    run_experiment(
        ExperimentConfig.from_dict(raw), tmp_path / "run", progress=False, secrets=SECRETS
    )
    modules = [name for kind, _, name in moves if kind == "module"]
    assert modules == ["Recorder"]  # built and placed once per process, then reused
    features = [s for kind, s, dtype in moves if kind == "tensor" and dtype == "torch.float32"]
    labels = [s for kind, s, dtype in moves if kind == "tensor" and dtype == "torch.int64"]
    # 2 rounds x (2 training + 2 evaluating clients), each its rows of x and of y
    assert len(features) == len(labels) == 8
    assert all(len(s) == 2 and s[1] == 5 for s in features)
    assert sorted(s[0] for s in features) == sorted(s[0] for s in labels)


def test_weights_cross_devices_through_load_and_model_arrays():
    """``load_arrays`` writes into tensors off the CPU (through ``copy_``) and
    ``model_arrays`` reads them back as numpy arrays; on the meta device the copy runs but
    holds no data, so reading back must fail loudly, never return stale CPU values."""
    spec = ModelSpec(kind="mlp", input_shape=(3,), num_classes=2, hidden=(4,))
    model = build_model(spec)
    arrays = {k: v.copy() + 1.0 for k, v in model_arrays(model).items()}
    on_meta = build_model(spec).to("meta")
    load_arrays(on_meta, arrays)  # a same-shape copy is accepted on any device
    bad = {**arrays, "layers.0.weight": arrays["layers.0.weight"][:, :2]}
    with pytest.raises(ValueError, match="does not fit the model"):
        load_arrays(on_meta, bad)
    with pytest.raises(NotImplementedError):
        model_arrays(on_meta)


def test_the_language_model_and_its_batches_follow_the_device(moves, monkeypatch):
    """The downstream LM (built on the CPU from the seed, then placed) gets every training
    and evaluation batch (ids, mask, labels) on its device; a bad device string is refused
    when the client app is made."""
    from fedsim.workloads import downstream_lm
    from fedsim.workloads.downstream_lm import BOS, LMSpec, LMTraining, train_and_evaluate
    from fedsim.workloads.lm_client import make_lm_client_app

    placed = []  # the models moved to FAKE report it as their device (they are on the CPU)
    real_place = downstream_lm.place
    monkeypatch.setattr(
        downstream_lm, "place", lambda m, d: placed.append(m) or real_place(m, d)
    )
    real_device = downstream_lm.model_device
    monkeypatch.setattr(
        downstream_lm,
        "model_device",
        lambda m: torch.device(FAKE) if any(m is p for p in placed) else real_device(m),
    )

    spec = LMSpec(vocab_size=12, hidden=16, layers=1, heads=2, max_positions=40)
    sequences = [np.array([BOS, 2, 3, 4, 5, 3]), np.array([BOS, 4, 5, 6, 2])]
    training = LMTraining(epochs=2, batch_size=1, lr=5e-3)
    _, arrays, losses = train_and_evaluate(sequences, sequences, spec, training, 3, device=FAKE)
    assert [name for kind, _, name in moves if kind == "module"] == ["LlamaForCausalLM"]
    batches = [shape for kind, shape, dtype in moves if kind == "tensor"]
    # 4 training steps of one sequence and one evaluation batch of both, 3 tensors each
    assert len(batches) == 3 * (len(losses) + 1) and len(losses) == 4
    assert {s[0] for s in batches} == {1, 2}
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    with pytest.raises(ConfigError, match="device = 'tpu'"):
        make_lm_client_app(spec, [sequences], training, seed=1, device="tpu")
