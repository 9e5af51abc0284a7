"""A Flower app's own sampling against the amplification DP-FedAvg claims for it.

Inside a plain Flower ServerApp, DPFedAvg (``sampling=None``) accounts the sampling that
happens: Flower's FedAvg draws ``m`` of the ``N`` nodes uniformly without replacement, so
each round is ``FixedSizeSampling(m, N)``. The promise: the epsilon it reports is never
below the epsilon of the sampling that actually took place. The adversary is the app's
author (or anything that can change the wrapped strategy): it samples with a bias, or
changes how many nodes it samples after the plan was made. We count every node's
participations in the instructions the grid received and check what the accountant assumed
against them; a sampling the accountant cannot model must be refused before its round
releases anything.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from scipy.stats import chisquare

from fedsim.config import ConfigError
from fedsim.engine import ClientRegistry
from fedsim.privacy.epsilon import epsilon
from fedsim.privacy.sampling import FixedSizeSampling, NeighbouringRelation
from fedsim.randomness import RunSecret
from fedsim.record_codec import to_numpy, to_record
from strategies.methods.dp_fedavg.strategy import DPFedAvg

N, M, ROUNDS, Z, DELTA = 20, 5, 40, 1.0, 1e-5


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1


class RecordingGrid:
    """Offers ``N`` nodes; every addressed node replies at once with the global model plus
    0.01; keeps the node ids of every round's instructions."""

    def __init__(self) -> None:
        self.registry = ClientRegistry(N)
        self.rounds: list[list[int]] = []

    def get_node_ids(self):
        return self.registry.node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.rounds.append([int(m.metadata.dst_node_id) for m in messages])
        replies = []
        for message in messages:
            moved = {k: v + 0.01 for k, v in to_numpy(message.content["arrays"]).items()}
            content = RecordDict(
                {"arrays": to_record(moved), "metrics": MetricRecord({"num-examples": 1})}
            )
            replies.append(Message(content, reply_to=message))
        return replies


def dp_fedavg(inner) -> DPFedAvg:
    strategy = DPFedAvg(
        inner, clipping_norm=1.0, noise_multiplier=Z, expected_clients=M, delta=DELTA
    )
    strategy.bind_server_secret(RunSecret.from_passphrase("flwr").server())
    return strategy


def start(strategy, grid, rounds=ROUNDS):
    return strategy.start(grid, to_record({"w": np.zeros(4, dtype=np.float32)}), rounds)


def test_the_epsilon_reported_is_never_below_the_sampling_that_happened():
    random.seed(11)  # Flower's sample_nodes draws from Python's random
    grid = RecordingGrid()
    inner = FedAvg(fraction_train=M / N, fraction_evaluate=0.0, min_available_nodes=0)
    strategy = dp_fedavg(inner)
    start(strategy, grid)
    assert len(grid.rounds) == ROUNDS == len(strategy.ledger)
    # what happened: every round m distinct nodes of the N the grid offered ...
    sizes = {len(set(nodes)) for nodes in grid.rounds}
    assert sizes == {len(nodes) for nodes in grid.rounds} == {M}
    offered = set(grid.get_node_ids())
    assert all(set(nodes) <= offered for nodes in grid.rounds)
    # ... and each node's participations are those of a uniform draw (rate m / N each)
    counts = np.zeros(N)
    index = {node: i for i, node in enumerate(sorted(offered))}
    for nodes in grid.rounds:
        counts[[index[n] for n in nodes]] += 1
    assert chisquare(counts).pvalue > 1e-3
    # what was accounted: that sampling, and an epsilon no smaller than its own
    report = strategy.privacy_report()
    observed = FixedSizeSampling(max(len(nodes) for nodes in grid.rounds), N)
    assert report["sampling"] == {
        "model": "FixedSizeSampling", "sample_size": M, "population": N
    }
    happened = epsilon(
        Z, observed, ROUNDS, DELTA, "rdp", NeighbouringRelation.REPLACE_ONE
    )
    assert report["epsilon"] >= happened * (1 - 1e-9)
    # under the only relation dp_accounting amplifies fixed-size sampling for
    assert report["relation"] == NeighbouringRelation.REPLACE_ONE.value


class FavouriteNodes(FedAvg):
    """The attack: always the same m nodes (the accountant would assume a uniform draw)."""

    def configure_train(self, server_round, arrays, config, grid):
        nodes = sorted(grid.get_node_ids())[:M]
        record = RecordDict({"arrays": arrays, "config": config})
        return self._construct_messages(record, nodes, MessageType.TRAIN)


def test_a_biased_sampler_is_refused_before_anything_is_released():
    grid = RecordingGrid()
    strategy = dp_fedavg(FavouriteNodes(fraction_train=M / N, min_available_nodes=0))
    with pytest.raises(ConfigError, match="FavouriteNodes's configure_train is not Flower's"):
        start(strategy, grid)
    assert grid.rounds == [] and len(strategy.ledger) == 0


class GrowsAfterRoundOne(FedAvg):
    """The attack: Flower's uniform draw, but of every node once the plan (m of N) is made."""

    def aggregate_train(self, server_round, replies):
        self.fraction_train = 1.0
        return super().aggregate_train(server_round, replies)


def test_sampling_more_than_the_plan_is_refused_in_that_round():
    random.seed(3)
    grid = RecordingGrid()
    inner = GrowsAfterRoundOne(fraction_train=M / N, fraction_evaluate=0.0, min_available_nodes=0)
    strategy = dp_fedavg(inner)
    with pytest.raises(ConfigError, match=r"sampling \(round 2\)") as err:
        start(strategy, grid)
    assert f"{M} nodes, the accounted" in str(err.value)
    # round 1 was released and accounted as m of N; round 2's N instructions never left
    assert [len(nodes) for nodes in grid.rounds] == [M]
    assert len(strategy.ledger) == 1
