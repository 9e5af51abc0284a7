"""Clients and the holder of a run directory against central DP (DP-FedAvg, the matrix
mechanism): the server's noise cannot be replayed from anything public, and the run's files
hold no un-noised client numbers.

The adversary of ``dpfedavg_seed.py`` is a client: it knows the run seed (every ClientApp
gets it in ``run_config``; config.json records it), the clipping norm and noise multiplier
(published in rounds.jsonl) and the global models of consecutive rounds (it receives them).
With noise from the seed it recovered the exact sum of clipped updates; now whatever stream
it derives from the seed leaves a residual of the size of the noise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError
from fedsim.engine import ClientRegistry
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.privacy.matrix import noise_stream
from fedsim.privacy.participation import Participation
from fedsim.privacy.sampling import PoissonSampling
from fedsim.randomness import RunSecret, Stream, public_generator
from fedsim.record_codec import to_numpy, to_record
from strategies.plumbing.server_secret import bind_parties
from strategies.registry import build_strategy

SEED, C, Z, M, D = 0, 1.0, 1.0, 5, 400
ROOT = RunSecret.from_passphrase("central dp, unknown to the clients")


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1


class _Grid:
    def get_node_ids(self):
        return ClientRegistry(M).node_ids()


def seed_streams(seed: int, server_round: int):
    """Every stream a client can derive from the seed and the round: what DP-FedAvg drew
    from before (``default_rng([seed, 1])``), the matrix mechanism's old per-round seed, the
    seed itself, and every public stream of the round."""
    old_matrix = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])
    yield "default_rng([seed, 1])", np.random.default_rng([seed, 1])
    yield "default_rng(seed)", np.random.default_rng(seed)
    yield "default_rng([seed, round])", np.random.default_rng([seed, server_round])
    yield "old matrix stream", np.random.default_rng([old_matrix, server_round - 1])
    for kind in Stream:
        yield f"public {kind.name}", public_generator(seed, server_round, kind)


def one_round(strategy, server_round, w0, updates):
    """The strategy's round: the clients train from ``w0`` and reply ``w0 + update``."""
    strategy.configure_train(server_round, to_record({"w": w0}), ConfigRecord(), _Grid())
    replies = [
        Message(
            RecordDict({"arrays": to_record({"w": w0 + u}), "metrics": MetricRecord({"n": 1})}),
            reply_to=Message(RecordDict(), node, "train"),
        )
        for node, u in zip(ClientRegistry(M).node_ids(), updates, strict=True)
    ]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return to_numpy(arrays)["w"], metrics


def clipped_sum(updates):
    return sum(u * min(1.0, C / np.linalg.norm(u)) for u in updates)


def secret_updates(rng):
    return [rng.normal(size=D) * 0.1 for _ in range(M)]  # the clients' private updates


def test_a_client_that_knows_the_seed_cannot_strip_dp_fedavgs_noise():
    options = {"clipping_norm": C, "noise_multiplier": Z}
    strategy = build_strategy(
        "dp-fedavg", options, expected_clients=M, evaluate_fraction=0.0, seed=SEED,
        sampling=PoissonSampling(0.25),
    )
    bind_parties(strategy, ROOT.server())  # what the front end does
    rng = np.random.default_rng(1)
    w0 = np.zeros(D)
    for server_round in (1, 2):
        updates = secret_updates(rng)
        w1, metrics = one_round(strategy, server_round, w0, updates)
        noise_std = metrics["dp-noise-std"] * M  # published: z C
        true_sum = clipped_sum(updates)
        for name, guess in seed_streams(SEED, server_round):
            recovered = (w1 - w0) * M - guess.normal(0.0, noise_std, size=D)
            residual = np.sqrt(np.mean((recovered - true_sum) ** 2))
            assert residual > 0.5 * Z * C, f"{name} strips the noise"  # noise-sized: ~sqrt(2) z C
        # the attack itself works: with the server's own stream the sum comes out exactly
        own = strategy.noise_generator(server_round, "update").normal(0.0, noise_std, size=D)
        np.testing.assert_allclose((w1 - w0) * M - own, true_sum, atol=1e-9)
        w0 = w1


def test_a_client_that_knows_the_seed_cannot_strip_the_matrix_mechanisms_noise():
    options = {"clipping_norm": C, "noise_multiplier": Z, "kind": "banded", "bands": 2}
    strategy = build_strategy(
        "matrix-mechanism", options, expected_clients=M, evaluate_fraction=0.0, seed=SEED,
        rounds=4, sampling=Participation.separated(2, 2),
    )
    bind_parties(strategy, ROOT.server())
    f, sigma = strategy.factorization, strategy.noise_std
    rng = np.random.default_rng(2)
    w0 = np.zeros(D)
    updates = secret_updates(rng)
    w1, _ = one_round(strategy, 1, w0, updates)
    true_sum = clipped_sum(updates)
    for name, guess in seed_streams(SEED, 1):
        replay = noise_stream(f, lambda t, g=guess: g, D).next()  # row 0 of G z, guessed
        recovered = (w1 - w0) * M - sigma * replay
        residual = np.sqrt(np.mean((recovered - true_sum) ** 2))
        assert residual > 0.5 * sigma / f.encoder[0, 0], f"{name} strips the noise"
    own = noise_stream(f, strategy.stream.noise, D).next()  # the server can, with its secret
    np.testing.assert_allclose((w1 - w0) * M - sigma * own, true_sum, atol=1e-9)


RUN = {
    "name": "private",
    "seed": 3,
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": 12},
    "model": {"kind": "logreg"},
    "client": {"lr": 0.2, "batch_size": 16},
    "evaluation": {"clients": 2, "every": 1, "central_rows": 100},
    "engine": {"backend": "local"},
}
STRATEGIES = {
    "dp-fedavg": {"clipping_norm": 0.5, "noise_multiplier": 0.8},
    "matrix-mechanism": {"clipping_norm": 0.5, "noise_multiplier": 0.8},
}


def private_run(tmp_path, name, **privacy):
    raw = {
        **RUN,
        "strategy": {"name": name, "clients_per_round": 4, "options": STRATEGIES[name]},
        "privacy": privacy,
    }
    out = tmp_path / name
    run_experiment(ExperimentConfig.from_dict(raw), out, progress=False, secrets=ROOT)
    return read_rounds(out / "rounds.jsonl"), json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_run_directory_holds_no_un_noised_client_metrics(tmp_path, name):
    rounds, summary = private_run(tmp_path, name)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        assert r["train"]["clients"] == 4 and r["evaluate"]["clients"] == 2
        assert "metrics" not in r["train"] and "metrics" not in r["evaluate"]
        assert "aggregated_evaluate" not in r and "metrics_in_clear" not in r
        assert not {"train_loss", "steps", "dp-clipped-fraction"} & set(r["aggregated"])
        assert r["aggregated"]["dp-noise-std"] > 0 and "accuracy" in r["central"]  # kept
    assert summary["final"]["train"] is None and summary["final"]["evaluate"] is None
    assert summary["final"]["central"]["accuracy"] > 0


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_metrics_in_clear_releases_them_and_marks_every_line_that_holds_them(tmp_path, name):
    rounds, summary = private_run(tmp_path, name, metrics_in_clear=True)
    assert "metrics_in_clear" not in rounds[0]  # round 0: the server's central evaluation only
    for r in rounds[1:]:
        assert r["metrics_in_clear"] is True
        assert "train_loss" in r["train"]["metrics"] and "loss" in r["evaluate"]["metrics"]
        assert "train_loss" in r["aggregated"] and "dp-clipped-fraction" in r["aggregated"]
        assert "loss" in r["aggregated_evaluate"]
    assert "train_loss" in summary["final"]["train"]


def test_metrics_in_clear_is_a_checked_config_key():
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({**RUN, "privacy": {"metrics_in_clear": "yes"}})
    assert err.value.key == "privacy.metrics_in_clear"
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({**RUN, "privacy": {"metrics": True}})
    assert err.value.key == "privacy.metrics"
