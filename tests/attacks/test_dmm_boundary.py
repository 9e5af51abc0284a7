"""DMM at the release boundary when an app drives it outside fedsim's round loop.

The ServerApp's author drives DMM through the grid a ServerApp gets (:class:`AppGrid`) with
Flower's own ``Strategy.start`` (not the recorded loop fedsim's wrappers start) or a loop of
its own. DMM claims the replies it consumes by
the instructions they answer, so the run's epsilon (the boundary's report) is the DMM ledger's,
finite -- before, nothing claimed them outside fedsim's loop and it was infinite. It is never
optimistic: a reply the app keeps from DMM is an unaccounted release (epsilon infinite), and
round 1's replies handed again as round 2's are refused at the boundary, never summed twice.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dmm_support import SECRETS, digits_setup, make_dmm, with_secrets
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import Strategy

from fedsim.engine.app_grid import AppGrid
from fedsim.engine.dmm_committee import CommitteeHost
from fedsim.models import initial_arrays
from fedsim.record_codec import to_record
from strategies.methods.dmm import dmm_client_app

CLIENTS, ROUNDS = 12, 2


@pytest.fixture(scope="module")
def digits():
    return digits_setup(CLIENTS)


def app_grid(engine, setup) -> tuple[AppGrid, object]:
    """A ServerApp's grid over a fresh run of DMM clients, and the engine grid's boundary."""
    data, dataset, _, inner = setup
    grid = engine.open_run(
        with_secrets(dmm_client_app(inner)),
        data.num_clients,
        run_config={"seed": 0},
        datasets=((data, dataset),),
    )
    return AppGrid(grid), grid.boundary


def dmm(mode: str):
    strategy = make_dmm(mode, CLIENTS, ROUNDS)
    strategy.bind_committee_host(CommitteeHost(SECRETS, None))
    return strategy


def one_round(strategy, grid, arrays, server_round, hand=None):
    """The app's own round: instructions out, replies in, ``hand(replies)`` to DMM."""
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages))
    handed = replies if hand is None else hand(replies)
    new, metrics = strategy.aggregate_train(server_round, handed)
    return replies, (arrays if new is None else new), dict(metrics or {})


@pytest.mark.parametrize(
    ("mode", "loop"), [("full", "flower"), ("ideal", "flower"), ("ideal", "fedsim")]
)
def test_flowers_own_loop_gets_the_dmm_ledgers_finite_epsilon(local_engine, digits, mode, loop):
    """``flower``: Flower's own ``Strategy.start`` (what a subclass overriding ``start``, or
    an app's loop, runs); ``fedsim``: DMM's ``start``, fedsim's recorded loop."""
    grid, boundary = app_grid(local_engine, digits)
    strategy = dmm(mode)
    arrays = to_record(initial_arrays(digits[2], 0))
    start = Strategy.start if loop == "flower" else type(strategy).start
    start(strategy, grid=grid, initial_arrays=arrays, num_rounds=ROUNDS)
    report = boundary.report()
    assert report["unaccounted_releases"] == 0, report
    assert len(strategy.ledger) == ROUNDS
    assert math.isfinite(strategy.epsilon()) and strategy.epsilon() > 0
    assert report["epsilon"] == pytest.approx(strategy.epsilon(), rel=1e-12)
    print(f"{mode}: epsilon {report['epsilon']:.3f} after {ROUNDS} rounds outside the loop")


def test_a_reply_the_app_keeps_from_dmm_makes_epsilon_infinite(local_engine, digits):
    grid, boundary = app_grid(local_engine, digits)
    strategy = dmm("full")
    arrays = to_record(initial_arrays(digits[2], 0))
    replies, _, _ = one_round(strategy, grid, arrays, 1, hand=lambda got: got[1:])
    assert len(replies) == CLIENTS and math.isfinite(strategy.epsilon())
    report = boundary.report()
    assert report["unaccounted_releases"] == 1 and report["unaccounted"] == {"train": 1}
    assert report["epsilon"] == math.inf


def test_round_one_replies_handed_again_in_round_two_are_refused(local_engine, digits):
    """Ideal mode, where DMM's own checks would take round 1's plaintext integers as round
    2's (the nodes were sampled again): the boundary knows they were consumed."""
    grid, boundary = app_grid(local_engine, digits)
    strategy = dmm("ideal")
    arrays = to_record(initial_arrays(digits[2], 0))
    first, arrays, metrics = one_round(strategy, grid, arrays, 1)
    assert metrics["rejected"] == [] and metrics["dmm-clients"] == CLIENTS
    second, _, metrics = one_round(strategy, grid, arrays, 2, hand=lambda got: first)
    nodes = sorted(int(r.metadata.src_node_id) for r in first)
    assert metrics["rejected"] == nodes  # none summed again
    assert metrics.get("dmm-clients", 0) == 0
    assert len(strategy.ledger) == 1  # nothing released in round 2
    report = boundary.report()  # round 2's own replies reached the app, never DMM
    assert report["unaccounted"] == {"train": len(second)} and report["epsilon"] == math.inf
    assert np.isfinite(strategy.epsilon())
