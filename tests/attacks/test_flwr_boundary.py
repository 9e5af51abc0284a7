"""The server's ServerApp against fedsim's DPFedAvg under `fedsim flwr-run`: every way around
the strategy ends in the run's records, never in an optimistic epsilon.

The adversary is the ServerApp's author (tests/apps/boundary: it runs DPFedAvg around
Flower's FedAvg, 5 of 20 nodes a round, z = 1, 4 rounds, and logs the node ids of every
train instruction that leaves). Each attack goes through the real command line; the checks
read only what a user reads: summary.json, rounds.jsonl, and the instructions that left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.engine import ClientRegistry, UniformCohort
from fedsim.privacy import accounting
from fedsim.privacy.accounting import FixedSizeSampling, FullParticipation

APP = Path(__file__).resolve().parents[1] / "apps" / "boundary"
NODES, COHORT, ROUNDS, Z, DELTA = 20, 5, 4, 1.0, 1e-5
#: what the ledger claims for 4 rounds of 5 of 20 (replace-one, the relation it amplifies)
CLAIMED = accounting.epsilon(Z, FixedSizeSampling(COHORT, NODES), ROUNDS, DELTA, "rdp",
                             "replace_one")


def flwr_run(out: Path, attack: str, *extra: str, run_config: str = "") -> dict:
    sent = out.parent / f"{out.name}-sent.json"
    overrides = f'attack="{attack}" sent-path="{sent}" {run_config}'.strip()
    argv = ["flwr-run", str(APP), "--backend", "local", "--no-progress", "--out", str(out)]
    assert main([*argv, "--run-config", overrides, *extra]) == 0
    lines = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    return {
        "summary": json.loads((out / "summary.json").read_text()),
        "lines": lines,
        "sent": json.loads(sent.read_text()),
    }


def epsilon_of(privacy: dict) -> float:
    return float("inf") if privacy.get("epsilon_infinite") else privacy["epsilon"]


def test_a_patched_random_sample_does_not_choose_the_cohort_the_ledger_amplifies(tmp_path):
    """`random.sample` patched to the lowest 5 node ids: the cohorts that leave are still the
    strategy's own uniform draw (its secret stream), so 18.36 is what ran."""
    run = flwr_run(tmp_path / "patched", "patched-sample", run_config="num-server-rounds=8")
    lowest = sorted(ClientRegistry(NODES).node_ids())[:COHORT]
    assert len(run["sent"]) == 8 and all(len(nodes) == COHORT for nodes in run["sent"])
    assert any(nodes != lowest for nodes in run["sent"])  # the patch chose nothing
    assert len({tuple(nodes) for nodes in run["sent"]}) > 1
    assert len({n for nodes in run["sent"] for n in nodes}) > 2 * COHORT
    privacy = run["summary"]["privacy"]
    assert privacy["sampling"] == {
        "model": "FixedSizeSampling", "sample_size": COHORT, "population": NODES
    }
    assert privacy["unaccounted_releases"] == 0


def test_two_strategies_started_one_after_the_other_compose(tmp_path):
    """Two DPFedAvg runs of 4 rounds each on the same nodes: the run's epsilon is that of 8
    rounds, in summary.json and the last line of rounds.jsonl (before: the second's 4)."""
    run = flwr_run(tmp_path / "two", "two-strategies")
    eight = accounting.epsilon(Z, FixedSizeSampling(COHORT, NODES), 2 * ROUNDS, DELTA, "rdp",
                               "replace_one")
    privacy = run["summary"]["privacy"]
    assert privacy["epsilon"] == pytest.approx(eight, rel=1e-9)
    assert privacy["epsilon"] > CLAIMED * 1.2
    assert privacy["mechanisms"] == ["DPFedAvg", "DPFedAvg"]
    assert run["lines"][-1]["privacy"]["epsilon"] == privacy["epsilon"]
    print(f"two strategies: epsilon {privacy['epsilon']:.2f} (each alone: {CLAIMED:.2f})")


def test_a_train_phase_outside_the_strategy_makes_epsilon_infinite(tmp_path):
    """`grid.send_and_receive` of a train phase before the strategy starts: every node's raw
    update reached the ServerApp; the records say so and epsilon is infinite."""
    run = flwr_run(tmp_path / "raw", "raw-phase")
    assert run["sent"][0] == sorted(ClientRegistry(NODES).node_ids())  # the raw phase
    privacy = run["summary"]["privacy"]
    assert privacy["epsilon_infinite"] is True and epsilon_of(privacy) == float("inf")
    assert privacy["unaccounted_releases"] == NODES
    assert privacy["unaccounted"] == {"train": NODES}
    assert run["summary"]["unaccounted_releases"] == NODES
    last = run["lines"][-1]["privacy"]
    assert last["unaccounted_releases"] == NODES and epsilon_of(last) == float("inf")


def test_instructions_added_after_the_sampling_check_are_not_summed(tmp_path):
    """A subclass sends 5 more nodes per round after the plan check: the aggregate never sums
    a reply to an instruction it did not send (a worker fold that mixes them is refused
    whole); what it refused reached the ServerApp outside the mechanism, so epsilon is
    infinite."""
    run = flwr_run(tmp_path / "extra", "extra-instructions")
    assert all(len(nodes) == 2 * COHORT for nodes in run["sent"])
    rounds = [line for line in run["lines"] if line["round"] >= 1]
    assert len(rounds) == ROUNDS
    assert all(line["aggregated"]["dp-clients"] <= COHORT for line in rounds)
    assert all(line["aggregated"]["rejected"] for line in rounds)
    privacy = run["summary"]["privacy"]
    assert privacy["unaccounted_releases"] >= COHORT * ROUNDS
    assert epsilon_of(privacy) == float("inf")
    assert epsilon_of(run["lines"][-1]["privacy"]) == float("inf")


def test_replies_handed_twice_are_summed_once(tmp_path):
    """A subclass hands every reply to the aggregate twice (the sum would move by 2C under
    noise z C: z halves, 65.81 for a reported 18.36): the copies are refused."""
    run = flwr_run(tmp_path / "twice", "handed-twice")
    rounds = [line for line in run["lines"] if line["round"] >= 1]
    assert [line["aggregated"]["dp-clients"] for line in rounds] == [COHORT] * ROUNDS
    assert all(line["aggregated"]["rejected"] for line in rounds)  # the copies
    privacy = run["summary"]["privacy"]
    assert privacy["epsilon"] == pytest.approx(CLAIMED, rel=1e-9)
    assert privacy["unaccounted_releases"] == 0


# -- finding 6: amplification from cohorts every client can recompute -----------------------


def public_cohorts(seed: int, rounds: int) -> list[list[int]]:
    """What a client holding the public seed (config, --seed) computes for every round."""
    model, registry = UniformCohort(NODES, COHORT, seed), ClientRegistry(NODES)
    return [sorted(registry.node_ids_of(model.cohort(r))) for r in range(1, rounds + 1)]


ENGINE = ("--sampling", "uniform", "--clients-per-round", str(COHORT), "--seed", "3")


def test_engine_cohorts_that_claim_amplification_are_not_the_public_seeds(tmp_path):
    """`--sampling uniform`: amplification is claimed, so the cohorts are the server's secret
    draw; an adversary recomputing them from the public seed gets other nodes."""
    run = flwr_run(tmp_path / "secret", "none", *ENGINE, run_config="fraction-train=1.0")
    guessed = public_cohorts(3, ROUNDS)
    assert all(len(nodes) == COHORT for nodes in run["sent"])
    assert sum(a == b for a, b in zip(run["sent"], guessed)) == 0
    assert run["summary"]["participation"]["cohorts"] == "secret"
    assert run["summary"]["privacy"]["sampling"]["model"] == "FixedSizeSampling"


def test_public_engine_cohorts_are_accounted_without_amplification(tmp_path):
    """`--public-cohorts`: every client recomputes the cohorts, so the epsilon reported is the
    unamplified one of the client the adversary sees in the most rounds."""
    extra = (*ENGINE, "--public-cohorts")
    run = flwr_run(tmp_path / "public", "none", *extra, run_config="fraction-train=1.0")
    guessed = public_cohorts(3, ROUNDS)
    assert run["sent"] == guessed  # the adversary knows every cohort
    counts: dict[int, int] = {}
    for nodes in guessed:
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
    worst = max(counts.values())
    unamplified = accounting.epsilon(Z, FullParticipation(), worst, DELTA)
    privacy = run["summary"]["privacy"]
    assert privacy["cohorts"] == "public" and privacy["max_rounds_per_client"] == worst
    assert privacy["epsilon"] == pytest.approx(unamplified, rel=1e-9)
    assert run["summary"]["participation"]["cohorts"] == "public"
    amplified = accounting.epsilon(Z, FixedSizeSampling(COHORT, NODES), ROUNDS, DELTA, "rdp",
                                   "replace_one")
    print(f"public cohorts: {privacy['epsilon']:.2f} for a client in {worst} of {ROUNDS} "
          f"rounds (amplified, as before: {amplified:.2f})")


# -- Flower's legacy messages: client content outside the mechanism, counted ----------------


def test_a_legacy_get_parameters_reply_outside_the_strategy_makes_epsilon_infinite(tmp_path):
    """``get_parameters`` to one node before DPFedAvg starts, as ``DefaultWorkflow`` asks for
    initial parameters: the node's own vector reached the ServerApp in clear; the run's
    records count it and epsilon is infinite (on main the grid refused the message type
    mid-run with a ValueError traceback)."""
    run = flwr_run(tmp_path / "parameters", "legacy-parameters")
    privacy = run["summary"]["privacy"]
    assert privacy["unaccounted"] == {"get_parameters": 1}
    assert privacy["unaccounted_releases"] == 1 and epsilon_of(privacy) == float("inf")
    assert epsilon_of(run["lines"][-1]["privacy"]) == float("inf")
    asked = [line["get_parameters"] for line in run["lines"] if "get_parameters" in line]
    assert [section["clients"] for section in asked] == [1]  # the phase is in the records
    assert len(run["sent"]) == ROUNDS  # the strategy's rounds ran after it


def test_legacy_get_properties_replies_outside_the_strategy_make_epsilon_infinite(tmp_path):
    """``get_properties`` to every node (Flower's legacy federated analytics): every node's
    properties are a release nothing accounts."""
    run = flwr_run(tmp_path / "properties", "legacy-properties")
    privacy = run["summary"]["privacy"]
    assert privacy["unaccounted"] == {"get_properties": NODES}
    assert run["summary"]["unaccounted_releases"] == NODES
    assert epsilon_of(privacy) == float("inf")
    assert epsilon_of(run["lines"][-1]["privacy"]) == float("inf")
