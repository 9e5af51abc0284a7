"""A cohort against the participation the accountant assumes.

The matrix mechanism's and DMM's sensitivity, and DP-FedAvg's min-separation ledger, assume
each client trains at most k times, b rounds apart (or once). A caller who declares that
schema and then samples every client every round would get an optimistic epsilon. The
strategies enforce the schema on the instructions they send: the attack (train everyone
every round) must leave no instruction outside the schema, and name the refused nodes.
"""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import make_dmm
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine import ClientRegistry
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.participation import Participation
from fedsim.record_codec import to_record
from strategies.methods.matrix_mechanism import MatrixMechanism
from strategies.plumbing.participation_guard import ParticipationGuard
from strategies.registry import build_strategy

CLIENTS = 12
NODES = ClientRegistry(CLIENTS).node_ids()


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1


class _EveryoneEveryRound:
    """The attack: a grid whose every node is sampled in every round."""

    def get_node_ids(self):
        return NODES


def instructed(strategy, rounds: int) -> list[list[int]]:
    """The nodes that got a train instruction in each of ``rounds`` rounds."""
    arrays = to_record({"w": np.zeros(16)})
    out = []
    for server_round in range(1, rounds + 1):
        grid = _EveryoneEveryRound()
        messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
        out.append(sorted(int(m.metadata.dst_node_id) for m in messages))
    return out


def test_single_participation_matrix_mechanism_instructs_each_client_once():
    strategy = MatrixMechanism(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0),
        factorization=banded(3, 1),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=CLIENTS,
    )
    assert strategy.participation == Participation.single()  # the default
    sent = instructed(strategy, 3)
    assert sent == [sorted(NODES), [], []]
    assert strategy.participation_refused == sorted(NODES)


def test_min_separation_matrix_mechanism_keeps_b_rounds_apart_and_at_most_k():
    strategy = build_strategy(
        "matrix-mechanism",
        {"clipping_norm": 1.0, "noise_multiplier": 1.0, "kind": "banded", "bands": 2},
        expected_clients=CLIENTS, evaluate_fraction=0.0, seed=0, rounds=6,
        sampling=Participation.separated(2, 2),
    )
    assert instructed(strategy, 6) == [sorted(NODES), [], sorted(NODES), [], [], []]


def test_dp_fedavg_enforces_its_min_separation_ledger():
    strategy = build_strategy(
        "dp-fedavg", {"clipping_norm": 1.0, "noise_multiplier": 1.0},
        expected_clients=CLIENTS, evaluate_fraction=0.0, seed=0, rounds=5,
        sampling=Participation.separated(3, 2),
    )
    assert instructed(strategy, 5) == [sorted(NODES), [], [], sorted(NODES), []]


def test_dmm_declared_single_participation_instructs_each_client_once():
    strategy = make_dmm("ideal", CLIENTS, 3, participation=Participation.single())
    sent = instructed(strategy, 2)
    assert sent == [sorted(NODES), []]
    assert strategy.participation_refused == sorted(NODES)


@pytest.mark.parametrize(
    ("schema", "rows", "admitted"),
    [
        (Participation.single(), [0, 1, 2], [True, False, False]),
        (Participation.separated(2, 2), [0, 1, 2, 4], [True, False, True, False]),
        (Participation.separated(2), [0, 2, 4, 5], [True, True, True, False]),
        (Participation.fixed(2), [1, 3, 4, 5], [True, False, False, True]),
    ],
)
def test_the_guard_admits_exactly_the_schemas_patterns(schema, rows, admitted):
    guard = ParticipationGuard(schema, rounds=8)
    assert [guard.take(7, row) is None for row in rows] == admitted


def test_an_open_ended_guard_needs_a_bound():
    with pytest.raises(ValueError, match="max_participations"):
        ParticipationGuard(Participation.separated(2))
