"""Injected faults: dropouts, late stragglers, worker crashes (in-process and on Ray)."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedsim.config import ConfigError
from fedsim.engine import NODE_ID_OFFSET, ClientAppSource, FaultConfig
from fedsim.engine.faults import client_faults, crash_point
from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import WeightedMean, attach_reducer

TOY = ClientAppSource(reference="toy_app:app", app_dir=str(Path(__file__).parents[1]))


class Reports:
    def __init__(self):
        self.items = []

    def phase_finished(self, report):
        self.items.append(report)


def body():
    return RecordDict(
        {"arrays": to_record({"w": np.zeros(2, np.float32)}), "config": ConfigRecord()}
    )


def train(grid, n, reduce=False):
    shared = body()  # one instruction for all, as Flower's strategies send
    messages = [Message(shared, NODE_ID_OFFSET + p, "train") for p in range(n)]
    if reduce:
        attach_reducer(messages, WeightedMean())
    return grid.send_and_receive(messages)


def outcome(replies):
    return sorted((r.content["metrics"]["pid"], r.content["metrics"]["calls"]) for r in replies)


def test_fault_draws_are_seeded_and_have_the_configured_rates():
    config = FaultConfig(
        dropout=0.2, straggler_fraction=0.5, straggler_delay_s=2.0, deadline_s=3.0, seed=4
    )
    a, b = client_faults(config, 3, 0, 20_000), client_faults(config, 3, 0, 20_000)
    assert np.array_equal(a.dropped, b.dropped) and np.array_equal(a.late, b.late)
    assert not np.array_equal(a.dropped, client_faults(config, 4, 0, 20_000).dropped)
    assert a.dropped.mean() == pytest.approx(0.2, abs=0.01)
    # late: a straggler (0.5) whose Exp(mean 2 s) delay exceeds 3 s, among those not dropped
    assert a.late.mean() == pytest.approx(0.8 * 0.5 * np.exp(-1.5), abs=0.01)
    assert not np.any(a.late & a.dropped)
    crashes = [crash_point(FaultConfig(crash_probability=0.3), 1, 0, b, 10) for b in range(2000)]
    assert np.mean([c is not None for c in crashes]) == pytest.approx(0.3, abs=0.04)
    assert all(0 <= c < 10 for c in crashes if c is not None)


def test_bad_fault_settings_are_named():
    with pytest.raises(ConfigError, match="faults.dropout"):
        FaultConfig(dropout=1.5)
    with pytest.raises(ConfigError, match="faults.deadline_s"):
        FaultConfig(deadline_s=-1)


def test_dropped_clients_neither_run_nor_reply(local_engine):
    reports = Reports()
    faults = FaultConfig(dropout=0.4, seed=1)
    grid = local_engine.open_run(TOY, 30, observer=reports, faults=faults)
    first = train(grid, 30)
    dropped = client_faults(faults, 0, 0, 30).dropped
    assert [pid for pid, _ in outcome(first)] == [p for p in range(30) if not dropped[p]]
    assert reports.items[-1].dropped == int(dropped.sum()) > 0
    assert len(grid.state_store) == 30 - int(dropped.sum())  # dropped clients never ran


def test_late_stragglers_ran_but_their_replies_are_dropped(local_engine):
    reports = Reports()
    faults = FaultConfig(straggler_fraction=0.5, straggler_delay_s=1.0, deadline_s=0.5, seed=2)
    grid = local_engine.open_run(TOY, 40, observer=reports, faults=faults)
    replies = train(grid, 40, reduce=True)
    late = client_faults(faults, 0, 0, 40).late
    report = reports.items[-1]
    assert report.timed_out == int(late.sum()) > 0 and report.succeeded == 40 - int(late.sum())
    assert replies[0].content["metrics"]["num-examples"] == sum(
        p + 1 for p in range(40) if not late[p]
    )
    assert len(grid.state_store) == 40  # the late ones trained: their state counts


@pytest.mark.parametrize(
    "engine_name", ["local_engine", pytest.param("ray_engine", marks=pytest.mark.ray)]
)
def test_crashed_workers_do_not_change_the_result(engine_name, request):
    engine = request.getfixturevalue(engine_name)

    def run(crash_probability):
        faults = FaultConfig(crash_probability=crash_probability, seed=3)
        grid = engine.open_run(TOY, 24, faults=faults)
        rounds = [train(grid, 24, reduce=True) for _ in range(2)]
        outcome = [
            (to_numpy(r[0].content["arrays"])["w"].tolist(), dict(r[0].content["metrics"]))
            for r in rounds
        ]
        return outcome, grid.workers_replaced

    crashed, replaced = run(0.3)
    assert replaced >= 1
    assert crashed == run(0.0)[0]
