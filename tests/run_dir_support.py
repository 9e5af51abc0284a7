"""Shared pieces of the tests of ``fedsim plot``, ``fedsim compare`` and TensorBoard events:
small copies of the quickstart config run to real run directories, and the values of a round
line read straight from its JSON (not through :mod:`fedsim.frontend.run_series`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedsim.config import load_toml
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret

QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart" / "config.toml"
SECRETS = RunSecret.from_passphrase("run directory tests")


def small_quickstart(**changes: Any) -> dict[str, Any]:
    """The quickstart config, 3 rounds of 10 of 60 clients (one epoch, local backend), with
    ``changes`` (top-level keys, or a section's keys as a dict merged into that section)."""
    raw = load_toml(QUICKSTART)
    raw["rounds"] = 3
    raw["data"]["num_clients"] = 60
    raw["client"]["epochs"] = 1
    raw["strategy"]["clients_per_round"] = 10
    raw["evaluation"].update(clients=5, every=2)
    raw["engine"] = {"backend": "local", "workers": 1}
    for key, value in changes.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return raw


def private(seed: int, noise_multiplier: float) -> dict[str, Any]:
    """The small quickstart under DP-FedAvg."""
    options = {"clipping_norm": 0.5, "noise_multiplier": noise_multiplier}
    return small_quickstart(seed=seed, strategy={"name": "dp-fedavg", "options": options})


def run(raw: dict[str, Any], out: Path, resume: bool = False) -> dict[str, Any]:
    return run_experiment(
        ExperimentConfig.from_dict(raw), out, resume=resume, progress=False, secrets=SECRETS
    )


def rounds(out: Path) -> list[dict[str, Any]]:
    return read_rounds(out / "rounds.jsonl")


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def expected(records: list[dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of ``metric`` in ``records``, from the lines' JSON as the README
    describes them (costs from round 1 on)."""
    path = {
        "train/train_loss": ("train", "metrics", "train_loss"),
        "evaluate/accuracy": ("evaluate", "metrics", "accuracy"),
        "evaluate/loss": ("evaluate", "metrics", "loss"),
        "central/accuracy": ("central", "accuracy"),
        "central/loss": ("central", "loss"),
        "privacy/epsilon": ("privacy", "epsilon"),
        "bytes_up": ("bytes_up",),
        "bytes_down": ("bytes_down",),
        "seconds": ("seconds",),
    }[metric]
    xs, ys = [], []
    for record in records:
        value: Any = record
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None or (len(path) == 1 and record["round"] == 0):
            continue
        xs.append(record["round"])
        ys.append(float(value))
    return xs, ys

