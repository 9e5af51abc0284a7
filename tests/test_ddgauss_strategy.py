"""DDGauss over SecAgg+ as a Flower strategy: ideal == full bit for bit, dropouts cost epsilon."""

import math

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine import FaultConfig
from fedsim.engine.rounds import run_rounds
from fedsim.models import ModelSpec, initial_arrays
from fedsim.records import to_numpy, to_record
from fedsim.workloads.supervised import LocalTraining, make_client_app
from protocols.field import DEFAULT_FIELD
from protocols.secagg import Stage, TooManyDropoutsError
from strategies.ddgauss import DDGauss, ddgauss_client_app

CLIENTS, ROUNDS = 30, 3


@pytest.fixture(scope="module")
def digits():
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    return data, dataset, model, ddgauss_client_app(inner)


def run(engine, digits, mode, dropout, noise_multiplier=1.0, committee=None):
    data, dataset, model, app = digits
    strategy = DDGauss(
        FedAvg(min_available_nodes=0),
        clipping_norm=1.0,
        noise_multiplier=noise_multiplier,
        expected_clients=CLIENTS,
        seed=7,
        mode=mode,
        committee=committee,
    )
    grid = engine.open_run(
        app,
        CLIENTS,
        run_config={"seed": 0},
        faults=FaultConfig(dropout=dropout, seed=3),
        datasets=((data, dataset),),
    )
    sums, survivors = [], []

    class Recording:
        def __getattr__(self, name):
            return getattr(strategy, name)

        def aggregate_train(self, server_round, replies):
            out = strategy.aggregate_train(server_round, replies)
            sums.append(strategy.last_sum.copy())
            survivors.append(strategy.last_survivors)
            return out

    final = run_rounds(Recording(), grid, to_record(initial_arrays(model, 0)), ROUNDS)
    grid.wait_idle()
    return strategy, to_numpy(final), sums, survivors


def test_full_secagg_equals_ideal_bit_for_bit_and_dropouts_cost_epsilon(local_engine, digits):
    full, final_full, sums_full, survivors_full = run(local_engine, digits, "full", 0.1)
    ideal, final_ideal, sums_ideal, survivors_ideal = run(local_engine, digits, "ideal", 0.1)
    assert survivors_full == survivors_ideal
    assert any(len(s) < CLIENTS for s in survivors_full)  # some clients dropped out
    for a, b in zip(sums_full, sums_ideal):
        np.testing.assert_array_equal(a, b)
    for key in final_full:
        np.testing.assert_array_equal(final_full[key], final_ideal[key])
    assert len(full.ledger) == ROUNDS
    eps_dropout = full.epsilon()
    nodrop, _, _, survivors = run(local_engine, digits, "ideal", 0.0)
    assert all(len(s) == CLIENTS for s in survivors)
    assert math.isfinite(eps_dropout) and eps_dropout > nodrop.epsilon() > 0
    assert full.privacy_report()["rounds_accounted"] == ROUNDS


@pytest.mark.ray
def test_committee_on_ray_actors_with_clients_on_ray_workers(
    ray_session, ray_engine, local_engine, digits
):
    from fedsim.engine.committee import Committee

    committee = Committee(8, 3, 2, shards=2, ray_module=ray_session)
    try:
        ray_run, final_ray, sums_ray, survivors_ray = run(
            ray_engine, digits, "committee", 0.1, committee=committee
        )
    finally:
        committee.close()
    ideal, final_ideal, sums_ideal, survivors_ideal = run(local_engine, digits, "ideal", 0.1)
    assert survivors_ray == survivors_ideal
    for a, b in zip(sums_ray, sums_ideal):
        np.testing.assert_array_equal(a, b)
    for key in final_ideal:
        np.testing.assert_array_equal(final_ray[key], final_ideal[key])
    assert ray_run.epsilon() == ideal.epsilon() > 0
    assert sorted(committee.history) == list(range(1, ROUNDS + 1))


def test_decoded_sum_matches_the_clients_updates_without_noise():
    from protocols.encoding import DDGaussEncoder

    rng = np.random.default_rng(0)
    strategy = DDGauss(
        FedAvg(), clipping_norm=1.0, noise_multiplier=1.0, expected_clients=5, seed=1
    )
    encoder = strategy.encoder_for(50)
    quiet = DDGaussEncoder(50, encoder.clip, encoder.gamma, 0.0, encoder.beta)
    updates = [rng.normal(size=50) * 0.05 for _ in range(5)]
    seed = strategy.rotation_seed(1)
    inputs = {10 + i: quiet.encode(u, seed, rng).elements for i, u in enumerate(updates)}
    total = strategy.secure_sum(1, inputs)
    np.testing.assert_array_equal(total, DEFAULT_FIELD.sum(np.stack(list(inputs.values())), 0))
    ring = DDGauss(
        FedAvg(),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=5,
        seed=1,
        ring_bits=32,
    )
    ring.encoder_for(50)
    np.testing.assert_array_equal(ring.secure_sum(1, inputs), total)
    decoded = encoder.decode(total, seed)
    np.testing.assert_allclose(decoded, np.sum(updates, axis=0), atol=5 * encoder.gamma * 3)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="mode"):
        DDGauss(
            FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=4, seed=0, mode="fast"
        )
    with pytest.raises(ValueError, match="expected_clients"):
        DDGauss(FedAvg(), clipping_norm=1, noise_multiplier=1, expected_clients=1, seed=0)
    with pytest.raises(ValueError, match="ring_bits"):
        DDGauss(
            FedAvg(),
            clipping_norm=1,
            noise_multiplier=1,
            expected_clients=4,
            seed=0,
            bits=20,
            ring_bits=16,
        )


def _strategy(mode, **kwargs):
    strategy = DDGauss(
        FedAvg(),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=12,
        seed=4,
        mode=mode,
        **kwargs,
    )
    strategy.encoder_for(30)
    return strategy


def test_dropouts_inside_secagg_match_ideal_and_count_only_contributors():
    rng = np.random.default_rng(6)
    encoder = _strategy("ideal").encoder
    inputs = {
        100 + i: encoder.encode(rng.normal(size=30) * 0.1, 1, rng).elements for i in range(12)
    }
    full = _strategy("full", protocol_dropout=0.3)
    ideal = _strategy("ideal", protocol_dropout=0.3)
    aborted = 0
    for server_round in range(1, 9):
        outcomes = []
        for strategy in (full, ideal):
            try:
                outcomes.append(
                    (strategy.secure_sum(server_round, inputs), strategy.last_survivors)
                )
            except TooManyDropoutsError:
                outcomes.append(None)
        if outcomes[0] is None:
            assert outcomes[1] is None
            aborted += 1
            continue
        (a, survivors_a), (b, survivors_b) = outcomes
        np.testing.assert_array_equal(a, b)
        assert survivors_a == survivors_b
        expected = DEFAULT_FIELD.sum(np.stack([inputs[i] for i in survivors_a]), axis=0)
        np.testing.assert_array_equal(a, expected)
        lost = full.protocol_dropouts(server_round, sorted(inputs))
        unmask_only = lost.get(Stage.UNMASK, set())
        assert set(inputs) - set(survivors_a) == set().union(*lost.values()) - unmask_only
    assert aborted < 8


def test_an_aborted_round_releases_nothing_and_accounts_nothing():
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.ddgauss import ENCODED_KEY

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    strategy = _strategy("full", protocol_dropout=1.0)
    model = {"w": np.zeros(30, dtype=np.float32)}

    class Grid:
        def get_node_ids(self):
            return list(range(1, 13))

    strategy.strategy.min_available_nodes = 0
    strategy.configure_train(1, to_record(model), ConfigRecord(), Grid())
    rng = np.random.default_rng(0)
    replies = []
    for node in range(1, 13):
        encoded = strategy.encoder.encode(np.zeros(30), 1, rng).elements
        content = RecordDict(
            {
                ENCODED_KEY: to_record({ENCODED_KEY: encoded}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        replies.append(Message(content, reply_to=Message(RecordDict(), node, "train")))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["ddgauss-aborted"] == 1
    assert len(strategy.ledger) == 0 and "needed" in strategy.last_abort


def test_committee_mode_gives_the_ideal_sum_and_excludes_corrupted_clients():
    from fedsim.engine.committee import Committee, CommitteeFaults

    rng = np.random.default_rng(8)
    encoder = _strategy("ideal").encoder
    inputs = {100 + i: encoder.encode(rng.normal(size=30) * 0.1, 1, rng).elements for i in range(6)}
    committee = Committee(7, 2, 2, shards=2)
    strategy = _strategy("committee", committee=committee)
    ideal = _strategy("ideal")
    np.testing.assert_array_equal(strategy.secure_sum(1, inputs), ideal.secure_sum(1, inputs))
    assert strategy.last_survivors == tuple(sorted(inputs))
    original = committee.run_round

    def corrupted(round_, vectors, rng, faults=None):
        return original(round_, vectors, rng, CommitteeFaults(corrupt_in_transit={(102, 0)}))

    committee.run_round = corrupted
    total = strategy.secure_sum(2, inputs)
    assert 102 not in strategy.last_survivors  # its noise is not in the sum: not counted
    kept = [inputs[i] for i in strategy.last_survivors]
    np.testing.assert_array_equal(total, DEFAULT_FIELD.sum(np.stack(kept), axis=0))
    with pytest.raises(ValueError, match="committee"):
        _strategy("committee")


RUN = """
seed = 4
rounds = 3

[data]
source = "digits"
partition = "iid"
num_clients = 30

[model]
kind = "logreg"

[client]
lr = 0.2

[strategy]
name = "ddgauss"
clients_per_round = 10

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 0.5
mode = "{mode}"
ring_bits = 32

[faults]
dropout = {dropout}

[engine]
backend = "local"
"""


def test_fedsim_run_with_client_dropouts_accounts_the_noise_present(tmp_path):
    from fedsim.cli import main
    from fedsim.results import read_rounds

    def epsilons(mode, dropout):
        config = tmp_path / f"{mode}-{dropout}.toml"
        config.write_text(RUN.format(mode=mode, dropout=dropout))
        out = tmp_path / f"{mode}-{dropout}"
        assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
        rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
        assert len(rounds) == 3
        return [r["privacy"]["epsilon"] for r in rounds], [r["train"]["clients"] for r in rounds]

    full, replied = epsilons("full", 0.3)
    assert min(replied) < 10  # some clients dropped out
    ideal, _ = epsilons("ideal", 0.3)
    none, everyone = epsilons("ideal", 0.0)
    assert everyone == [10, 10, 10]
    assert full == ideal and all(a > b for a, b in zip(full, none))  # less noise: larger ε
