"""DMM as a Flower strategy: full == ideal for the same seeds, configuration checked up front."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine import FaultConfig
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, initial_arrays
from fedsim.privacy.matrix.tree import honaker_tree
from fedsim.records import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app
from strategies.dmm import DMM, SEALED_KEY, dmm_client_app

CLIENTS, ROUNDS = 10, 3


@pytest.fixture(scope="module")
def digits():
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, dmm_client_app(inner)


def _dmm(mode, **kwargs):
    options = dict(
        factorization=honaker_tree(4),
        committee_size=10,
        threshold=2,
        packing=3,
        fractional_bits=10,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
        seed=7,
        mode=mode,
        share_rng_seed=None,
    )
    options.update(kwargs)
    return DMM(FedAvg(min_available_nodes=0), **options)


def run(engine, digits, strategy, dropout, alter=None):
    """Run ROUNDS rounds; ``alter(server_round, replies)`` may change the replies the server
    receives. Returns the final arrays, (clients, release) per round and epsilon per round;
    ``strategy.outputs`` holds each round's :class:`protocols.dmm.RoundOutput` (None: aborted)."""
    data, dataset, model, app = digits
    grid = engine.open_run(
        app,
        CLIENTS,
        run_config={"seed": 0},
        faults=FaultConfig(dropout=dropout, seed=3),
        datasets=((data, dataset),),
    )
    releases, eps = [], []

    class Recording:
        def __getattr__(self, name):
            return getattr(strategy, name)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            if strategy.mode == "full":  # the server receives ciphertexts only
                for reply in replies:
                    if not reply.has_error():
                        assert set(reply.content.keys()) == {SEALED_KEY, "metrics"}
            if alter is not None:
                replies = alter(server_round, replies)
            out = strategy.aggregate_train(server_round, replies)
            released = strategy.last_release is not None
            strategy.outputs.append(strategy.protocol.last_output if released else None)
            release = strategy.last_release
            releases.append((strategy.last_clients, None if release is None else release.copy()))
            eps.append(out[1]["epsilon"])
            return out

    strategy.outputs = []
    final = run_rounds(Recording(), grid, to_record(initial_arrays(model, 0)), ROUNDS)
    grid.wait_idle()
    return to_numpy(final), releases, eps


def test_full_equals_ideal_for_the_same_seeds_and_dropouts_cost_epsilon(local_engine, digits):
    full = _dmm("full", member_dropout=0.05)
    final_full, releases_full, eps_full = run(local_engine, digits, full, 0.2)
    ideal = _dmm("ideal", member_dropout=0.05)
    final_ideal, releases_ideal, eps_ideal = run(local_engine, digits, ideal, 0.2)
    for (clients_a, a), (clients_b, b) in zip(releases_full, releases_ideal):
        assert clients_a == clients_b
        np.testing.assert_array_equal(a, b)
    for key in final_full:
        np.testing.assert_array_equal(final_full[key], final_ideal[key])
    assert eps_full == eps_ideal and all(b >= a for a, b in zip(eps_full, eps_full[1:]))
    assert any(len(c) < CLIENTS for c, _ in releases_full)  # some clients dropped out
    # the committee's noise state was handed on by resharing between rounds
    assert max(o.reshare_attempts for o in full.outputs if o is not None) >= 1
    report = full.privacy_report()
    assert report["rounds_accounted"] == ROUNDS and report["steps"] == ROUNDS
    assert report["fewest_noise_clients"] == min(len(c) for c, _ in releases_full)
    # the same run without dropouts has more noise in every row: smaller epsilon
    nodrop = _dmm("ideal")
    run(local_engine, digits, nodrop, 0.0)
    assert nodrop.epsilon() < full.epsilon()


def test_configuration_is_validated_before_the_run():
    with pytest.raises(ValueError, match="t \\+ k <= 7"):
        _dmm("full", threshold=3, packing=5, expected_member_dropout=0.3)
    with pytest.raises(ValueError, match="mode="):
        _dmm("fast")
    with pytest.raises(ValueError, match="fractional_bits=0"):
        _dmm("full", fractional_bits=0)
    # the bit budget is checked when the model size is known, before any client trains
    strategy = _dmm("full", fractional_bits=40, bits=30)
    with pytest.raises(ValueError, match="bit budget"):
        strategy.check(650)
    assert _dmm("full").check(650).padded_dim == 1024


RUN = """
name = "dmm"
seed = 3
rounds = 4

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.2

[strategy]
name = "dmm"
clients_per_round = 10
sampling = "min-separation"

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 0.5
committee_size = 8
threshold = 2
packing = 3
mode = "ideal"

[engine]
backend = "local"
"""


def test_fedsim_run_writes_epsilon_per_round(tmp_path):
    from fedsim.cli import main
    from fedsim.results import read_rounds

    config = tmp_path / "dmm.toml"
    config.write_text(RUN)
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    eps = [r["privacy"]["epsilon"] for r in rounds]
    assert len(eps) == 4 and eps[0] > 0 and all(b >= a for a, b in zip(eps, eps[1:]))
    assert rounds[-1]["privacy"]["factorization"] == "honaker"
    assert rounds[0]["aggregated"]["dmm-clients"] == 10
