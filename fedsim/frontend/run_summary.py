"""summary.json of a ``fedsim run``: what ran, how long it took, what it sent, its final
metrics and versions (:func:`run_summary_record`), and its privacy keys
(:func:`privacy_summary`)."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import torch
from flwr.serverapp.strategy import Strategy

from fedsim import __version__
from fedsim.config import to_mapping
from fedsim.data import FederatedDataset
from fedsim.engine import Engine
from fedsim.frontend.run_config import ExperimentConfig
from strategies.plumbing.recorded_start import run_summary


def run_summary_record(
    config: ExperimentConfig,
    dataset: FederatedDataset,
    engine: Engine,
    records: list[dict[str, Any]],
    started: float,
    ready: float,
    finished: float,
) -> dict[str, Any]:
    rounds = [r for r in records if r["round"] >= 1]
    trained = sum(r.get("train", {}).get("clients", 0) for r in rounds)
    last_central = next((r["central"] for r in reversed(records) if "central" in r), None)
    last_eval = next(
        (r["evaluate"].get("metrics") for r in reversed(rounds) if "evaluate" in r), None
    )
    return {
        "name": config.name,
        "config": to_mapping(config),
        "rounds": len(rounds),
        "clients_trained": trained,
        "seconds": {
            "total": finished - started,
            "setup": ready - started,
            "rounds": finished - ready,
            "engine_startup": dict(engine.startup_s),
        },
        "clients_per_s": trained / (finished - ready) if finished > ready else 0.0,
        "bytes": {
            "down": sum(r["bytes_down"] for r in records),
            "up": sum(r["bytes_up"] for r in records),
        },
        "final": {
            "central": last_central,
            "evaluate": last_eval,
            "train": rounds[-1].get("train", {}).get("metrics") if rounds else None,
        },
        "dataset": {"name": dataset.name, **dataset.stats()},
        "engine": engine.describe(),
        "versions": {
            "fedsim": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
    }


def privacy_summary(strategy: Strategy, records: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's privacy keys: the run's epsilon (when the strategy keeps a ledger),
    why it stopped early (if it did), and the worst client's own epsilon (client DP-SGD)."""
    out = run_summary(strategy)
    if "privacy" in out and records and "privacy" in records[-1]:  # the run's, at the boundary
        out["privacy"] = records[-1]["privacy"]
        out["unaccounted_releases"] = records[-1]["privacy"].get("unaccounted_releases", 0)
    client = [r["client_privacy"] for r in records if "client_privacy" in r]
    if client:
        out["max_client_epsilon"] = max(c["max_epsilon"] for c in client)
        out["client_privacy"] = {
            "delta": client[-1]["delta"],
            "accountant": client[-1]["accountant"],
        }
    return out
