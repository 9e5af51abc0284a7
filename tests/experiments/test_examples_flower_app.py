"""examples/flower_app_dp runs as its README says: a plain Flower app whose ServerApp switches
FedAvg for fedsim's DPFedAvg or DMM, with epsilon in every round of rounds.jsonl."""

import json
from pathlib import Path

import pytest

from fedsim.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app_dp"
ROUNDS, NODES = 2, 12


def run(out: Path, strategy: str, backend: str = "local") -> list[dict]:
    argv = ["flwr-run", str(EXAMPLE), "--federation", "local", "--num-supernodes", str(NODES)]
    overrides = f'strategy="{strategy}" num-server-rounds={ROUNDS}'
    code = main([*argv, "--run-config", overrides, "--backend", backend, "--out", str(out),
                 "--no-progress"])
    assert code == 0
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("strategy", "clients"), [("dp-fedavg", NODES // 2), ("dmm", NODES)])
def test_each_private_strategy_reports_epsilon_every_round(tmp_path, strategy, clients):
    lines = run(tmp_path / strategy, strategy)
    assert [r["round"] for r in lines] == list(range(ROUNDS + 1))  # round 0: the initial model
    epsilons = [r["privacy"]["epsilon"] for r in lines[1:]]
    assert all(e > 0 for e in epsilons) and epsilons == sorted(epsilons)
    assert [r["privacy"]["rounds_accounted"] for r in lines[1:]] == list(range(1, ROUNDS + 1))
    assert all(r["train"]["messages"] == clients for r in lines[1:])
    assert all("metrics" not in r["train"] for r in lines[1:])  # clients' numbers stay private
    assert lines[-1]["central"]["accuracy"] > lines[0]["central"]["accuracy"]
    summary = json.loads((tmp_path / strategy / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == epsilons[-1]


def test_fedavg_has_no_privacy_lines(tmp_path):
    """Flower's own FedAvg: what its ``start`` files in its Result is in rounds.jsonl, the
    evaluate_fn's central evaluation (round 0: the initial model) and the aggregated train
    metrics of each round."""
    lines = run(tmp_path / "fedavg", "fedavg")
    assert [r["round"] for r in lines] == list(range(ROUNDS + 1))
    assert all("privacy" not in r for r in lines)
    assert all("train_loss" in r["train"]["metrics"] for r in lines[1:])
    assert sorted(lines[0]) == sorted(
        ["round", "time_s", "seconds", "clients_per_s", "bytes_down", "bytes_up", "central"])
    assert all(sorted(r["central"]) == ["accuracy", "loss"] for r in lines)
    assert all(sorted(r["aggregated"]) == ["train_loss"] for r in lines[1:])
    assert lines[-1]["central"]["accuracy"] > lines[0]["central"]["accuracy"]


@pytest.mark.ray
def test_on_ray_workers_dp_fedavg_reports_the_same_privacy_lines(tmp_path, ray_session):
    """Ray workers fold the clipped sums (worker-side reduction); the records are the same."""
    on_ray, local = run(tmp_path / "ray", "dp-fedavg", "ray"), run(tmp_path / "local", "dp-fedavg")
    assert [r["privacy"] for r in on_ray] == [r["privacy"] for r in local]
    assert [r["aggregated"]["dp-clients"] for r in on_ray[1:]] == [NODES // 2] * ROUNDS
