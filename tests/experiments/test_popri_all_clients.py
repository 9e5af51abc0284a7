"""The POPri study on every packaged docstring client (configs/cpu-all.toml): the stored runs
hold what experiments/popri/README.md says of them, and the paired table is theirs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.popri import paired_table
from experiments.popri.run import HERE, eps_key, load_config
from fedsim.data.text import cached_text_federation

CONFIG = HERE / "configs" / "cpu-all.toml"
RUNS = [HERE / "runs" / name for name in ("cpu-all", "cpu-all-seed1", "cpu-all-seed2")]


def stages(run: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run / "stages").glob("*.json")}


def test_every_packaged_client_is_in_the_federation():
    config = load_config(CONFIG)
    assert config.data.max_clients is None
    federation = cached_text_federation(config.data)
    for run in RUNS:
        summary = stages(run)["public"]["federation"]
        assert summary["clients"] == federation.num_clients > 1000
        assert summary["train_texts"] == len(federation.all_train())


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_points_are_noised_to_their_epsilon_and_popri_feedback_heard_every_client(run):
    config = load_config(CONFIG)
    found = stages(run)
    seeds = set()
    for method in ("popri", "pe", "dp-fedavg"):
        for epsilon in config.epsilons:
            stage = found[f"{method}-eps{eps_key(epsilon)}"]
            seeds.add(stage["run_nonce"])
            if math.isinf(epsilon):
                assert stage["noise_multiplier"] == 0.0
            else:
                assert stage["noise_multiplier"] > 0
                assert stage["epsilon_spent"] <= epsilon * (1 + 1e-9)
    assert len(seeds) == 3 * len(config.epsilons)  # every point under its own nonce
    for epsilon in config.epsilons:
        (row,) = found[f"popri-eps{eps_key(epsilon)}"]["rounds"]
        assert row["clients_sampled"] == found["public"]["federation"]["clients"]


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_popri_fine_tunes_on_the_same_texts_at_every_epsilon(run):
    """The README: the noise changes none of POPri's preference pairs at this scale."""
    found = stages(run)
    texts = [found[f"popri-eps{e}"]["synthetic"] for e in ("1", "4", "inf")]
    assert texts[0] == texts[1] == texts[2]
    assert len({found[f"popri-eps{e}"]["accuracy"] for e in ("1", "4", "inf")}) == 1


def test_paired_table_is_recomputed_from_the_stored_runs_and_every_interval_holds_zero():
    config = load_config(CONFIG)
    epsilons = [eps_key(e) for e in config.epsilons]
    stored = json.loads((RUNS[0] / "paired.json").read_text())
    assert stored["replicates"] == [r.name for r in RUNS]
    assert paired_table.paired_results(epsilons, RUNS) == stored["comparisons"]
    for entry in stored["comparisons"]:
        assert len(entry["differences"]) == 3
        assert entry["low"] <= entry["mean"] <= entry["high"]
        assert entry["low"] <= 0 <= entry["high"] and entry["verdict"] == "level"
