"""A client that knows the public seed, against DP-FedAvg's amplification under `fedsim run`.

Amplification by sampling holds only if the adversary cannot know the cohort. config.json (and
so the seed) is public: were the engine's cohorts drawn from it, every client could recompute
the rounds it was in, and against that client each of those rounds is an unamplified Gaussian.
DP-FedAvg, whose epsilon credits the sampling, therefore has its uniform and Poisson cohorts
drawn from the server's own secret: the adversary's recomputation must miss, and the cohorts
must still be the ones the accountant's model describes (m of N, distinct).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsim.engine import PoissonCohort, UniformCohort
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.grid import SimulationGrid
from fedsim.engine.participation import TRAIN
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret

CLIENTS, COHORT, ROUNDS, SEED = 12, 3, 6, 7


def config(sampling: str, strategy: str = "dp-fedavg") -> ExperimentConfig:
    options = {"clipping_norm": 0.5, "noise_multiplier": 1.0} if strategy == "dp-fedavg" else {}
    return ExperimentConfig.from_dict(
        {
            "seed": SEED,
            "rounds": ROUNDS,
            "data": {"source": "digits", "partition": "iid", "num_clients": CLIENTS},
            "model": {"kind": "logreg"},
            "client": {"lr": 0.2, "batch_size": 16},
            "evaluation": {"every": 0},
            "engine": {"backend": "local"},
            "strategy": {
                "name": strategy,
                "clients_per_round": COHORT,
                "sampling": sampling,
                "options": options,
            },
        }
    )


def trained_cohorts(monkeypatch, run) -> list[list[int]]:
    """Run ``run()`` and return, per round, the partition ids the engine sent train to."""
    sent: dict[int, set[int]] = {}
    push = SimulationGrid._push

    def record(self, messages, *rest):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type.split(".")[0] == "train":
                sent.setdefault(int(m.content["config"]["server-round"]), set()).add(
                    int(m.metadata.dst_node_id)
                )
        return push(self, messages, *rest)

    monkeypatch.setattr(SimulationGrid, "_push", record)
    run()
    assert set(sent) <= set(range(1, ROUNDS + 1)), f"train sent in rounds {sorted(sent)}"
    # a round whose cohort is empty (Poisson sampling may draw none) sends no train
    return [sorted(sent.get(r, ())) for r in range(1, ROUNDS + 1)]


def public_guess(sampling: str) -> list[list[int]]:
    """What a client holding config.json recomputes: the cohorts drawn from the seed."""
    model = (
        PoissonCohort(CLIENTS, COHORT / CLIENTS, SEED)
        if sampling == "poisson"
        else UniformCohort(CLIENTS, COHORT, SEED)
    )
    return [sorted(int(c) for c in model.cohort(r, TRAIN)) for r in range(1, ROUNDS + 1)]


@pytest.mark.parametrize("sampling", ["uniform", "poisson"])
def test_dp_fedavg_cohorts_are_not_recomputable_from_the_seed(tmp_path, monkeypatch, sampling):
    out = tmp_path / sampling
    root = RunSecret.from_passphrase("cohorts of one test run")
    cohorts = trained_cohorts(
        monkeypatch,
        lambda: run_experiment(config(sampling), out, progress=False, secrets=root),
    )
    got = [[n - NODE_ID_OFFSET for n in c] for c in cohorts]
    guessed = public_guess(sampling)
    if sampling == "uniform":
        assert all(len(c) == COHORT and len(set(c)) == COHORT for c in got)
    else:
        assert any(got), "no round trained"
    assert sum(a == b for a, b in zip(got, guessed)) <= 1, (
        f"a client holding config.json recomputed the cohorts the ledger amplifies: {got}"
    )
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    assert np.isfinite(privacy["epsilon"])


def test_cohorts_of_a_strategy_that_claims_no_amplification_stay_public(tmp_path, monkeypatch):
    """FedAvg claims nothing: its cohorts are the seed's, reproducible by anyone."""
    out = tmp_path / "fedavg"
    cohorts = trained_cohorts(
        monkeypatch,
        lambda: run_experiment(config("uniform", "fedavg"), out, progress=False),
    )
    assert [[n - NODE_ID_OFFSET for n in c] for c in cohorts] == public_guess("uniform")
