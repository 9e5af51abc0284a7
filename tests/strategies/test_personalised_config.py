"""pFedHB, pFedVEM, pFedBayes and FedAvg + fine-tuning from a run config: validated up front,
run end to end by ``fedsim run``, evaluated into rounds.jsonl, resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_strategy import build_experiment_strategy, participation_for
from strategies.registry import PERSONALISED, build_strategy

BASE = {
    "seed": 3,
    "rounds": 4,
    "data": {
        "source": "digits",
        "partition": "split-classes",
        "classes_per_client": 5,
        "num_clients": 8,
        "test_fraction": 0.25,
    },
    "model": {"kind": "bayes-mlp", "hidden": [12]},
    "personal": {"head_steps": 2, "body_epochs": 1, "mc_samples": 2, "eval_samples": 2},
    "strategy": {"name": "pfedhb", "clients_per_round": 2, "sampling": "poisson"},
    "evaluation": {"every": 2},
    "engine": {"backend": "local"},
}

RUNS = {
    "pfedhb-adam": ("pfedhb", {"server_solver": "adam"}),
    "pfedhb-exact": ("pfedhb", {"server_solver": "exact", "iterations": 50}),
    "pfedvem": ("pfedvem", {}),
    "pfedbayes": ("pfedbayes", {"schedule": "sampled"}),
    "fedavg-ft": ("fedavg-ft", {"finetune_epochs": 1}),
}


def raw(**sections):
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name].update(value)
        else:
            out[name] = value
    return out


def toml(config: dict) -> str:
    lines = []
    for key, value in config.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            for k, v in value.items():
                if isinstance(v, dict):
                    inner = ", ".join(f"{a} = {json.dumps(b)}" for a, b in v.items())
                    lines.append(f"{k} = {{ {inner} }}")
                else:
                    lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def opts(**options):
    return {"strategy": {"options": options}}


def test_registry_lists_the_personalised_methods():
    assert PERSONALISED == ("pfedhb", "pfedvem", "pfedbayes", "fedavg-ft", "local-only")
    assert {name for name, _ in RUNS.values()} <= set(PERSONALISED)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_each_method_runs_from_a_config_and_writes_its_evaluation(tmp_path, run):
    name, options = RUNS[run]
    path = tmp_path / "run.toml"
    path.write_text(toml(raw(strategy={"name": name, "options": options})))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    records = [r for r in read_rounds(tmp_path / "out" / "rounds.jsonl") if r["round"] >= 1]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    for record in records:
        evaluated = record["round"] % 2 == 0
        assert ("aggregated_evaluate" in record) == evaluated
        assert ("central" in record) == evaluated
        assert record["aggregated"]["reporting"] >= 2
        if not evaluated:
            continue
        personal, central = record["aggregated_evaluate"], record["central"]
        assert personal["clients"] == 8
        for key in ("personal_acc_mean", "personal_acc_mc", "personal_ece_mean"):
            assert 0.0 <= personal[key] <= 1.0, key
        for key in ("global_acc", "global_ece"):
            assert 0.0 <= central[key] <= 1.0, key
        assert np.isfinite(central["global_nll"])
    trained = {r["aggregated"]["trained"] for r in records}
    if name in ("pfedbayes", "fedavg-ft"):  # only the reporting clients train
        assert trained <= set(range(2, 8))
    else:  # every client personalises every round
        assert trained == {8}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["config"]["strategy"]["name"] == name


@pytest.mark.parametrize(
    ("sections", "key", "allowed"),
    [
        (opts(lam_mu=-1.0), "strategy.options.lam_mu", ">= 0"),
        (opts(lam_mu="big"), "strategy.options.lam_mu", "a number"),
        (opts(server_solver="sgd"), "strategy.options.server_solver", "'adam'"),
        (
            opts(hyperprior="conjugate"),
            "strategy.options.server_solver",
            "'exact' with hyperprior",
        ),
        (opts(server_steps=0), "strategy.options.server_steps", ">= 1"),
        (
            opts(server_milestones=[80, 60]),
            "strategy.options.server_milestones",
            "increasing",
        ),
        (
            opts(server_solver="exact", hyperprior="conjugate", nig={"kappa0": -1}),
            "strategy.options.nig.kappa0",
            ">= 0",
        ),
        (opts(momentum=0.9), "strategy.options.momentum", "a known key"),
        (opts(head_layers=1), "strategy.options.head_layers", "a known key"),
        (opts(schedule="some"), "strategy.options.schedule", "'all' or 'sampled'"),
        (opts(min_clients=0), "strategy.options.min_clients", ">= 1"),
        (
            {"strategy": {"name": "pfedvem", "options": {"beta": 1.0}}},
            "strategy.options.beta",
            "[0, 1)",
        ),
        (
            {"strategy": {"name": "fedavg-ft", "options": {"finetune_epochs": -1}}},
            "strategy.options.finetune_epochs",
            ">= 0",
        ),
        (
            {"strategy": {"name": "fedavg-ft", "options": {"schedule": "all"}}},
            "strategy.options.schedule",
            "known keys are finetune_epochs, min_clients",
        ),
        (
            {"strategy": {"name": "local-only", "options": {"min_clients": 2}}},
            "strategy.options.min_clients",
            "a known key",
        ),
        ({"strategy": {"sampling": "min-separation"}}, "strategy.sampling", "'poisson'"),
        ({"model": {"kind": "mlp"}}, "model.kind", "'bayes-mlp' with strategy.name"),
        ({"model": {"head_layers": 2}}, "model.head_layers", "the body keeps at least one"),
        ({"model": {"rho_init": -200.0}}, "model.rho_init", "rho >= -87"),
        ({"personal": {"head_lr": 0.0}}, "personal.head_lr", "> 0"),
        ({"personal": {"head_kl": -1.0}}, "personal.head_kl", ">= 0"),
        ({"personal": {"steps": 3}}, "personal.steps", "known keys"),
        ({"client": {"epochs": 3}}, "client", "configured by [personal]"),
        ({"evaluation": {"clients": 2}}, "evaluation.clients", "every client evaluates"),
        ({"strategy": {"name": "fedavg"}}, "personal", "no [personal] table"),
    ],
)
def test_bad_personalised_configs_name_the_key(sections, key, allowed):
    config = raw(**sections)
    with pytest.raises(ConfigError) as err:
        built = ExperimentConfig.from_dict(config)
        build_experiment_strategy(built, participation_for(built, 8))
    assert err.value.key == key, str(err.value)
    assert allowed in err.value.allowed, str(err.value)


def test_bayes_mlp_needs_a_personalised_strategy():
    config = raw(strategy={"name": "fedavg"})
    del config["personal"]
    with pytest.raises(ConfigError, match=r"model.kind = 'bayes-mlp' .*'mlp'"):
        ExperimentConfig.from_dict(config)


def test_build_strategy_points_personalised_names_to_their_builder():
    with pytest.raises(ConfigError, match="build_personalised_strategy"):
        build_strategy("pfedhb", {}, expected_clients=2, evaluate_fraction=0.0, seed=0)


def test_killed_personalised_run_resumes_to_the_same_rounds(tmp_path):
    """The server's Adam moments and every client's personal model survive a resume."""
    path = tmp_path / "run.toml"
    path.write_text(toml(raw(rounds=5, checkpoint_every=1, state_memory_mb=0)))
    full = tmp_path / "full"
    assert main(["run", str(path), "--out", str(full), "--no-progress"]) == 0
    timing = ("seconds", "time_s", "clients_per_s", "compute_s")

    def strip(record):
        if isinstance(record, dict):
            return {k: strip(v) for k, v in record.items() if k not in timing}
        return record

    expected = [strip(r) for r in read_rounds(full / "rounds.jsonl")]
    killed = tmp_path / "killed"
    env = dict(os.environ, RAY_ADDRESS="")
    command = [sys.executable, "-m", "fedsim", "run", str(path), "--out", str(killed)]
    proc = subprocess.Popen([*command, "--no-progress"], env=env)
    deadline = time.monotonic() + 300
    while len(read_rounds(killed / "rounds.jsonl")) < 4:  # rounds 0..3 written
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resume = [sys.executable, "-m", "fedsim", "run", "--resume", str(killed), "--no-progress"]
    assert subprocess.run(resume, env=env, timeout=300).returncode == 0
    assert [strip(r) for r in read_rounds(killed / "rounds.jsonl")] == expected
