"""A send_and_receive timeout is per client, as in Flower: a slow client never makes another
miss it (issue 29).

Before, the grid cut a phase into guided self-scheduling batches and a worker ran its batch's
clients one after another, so the slow client's batch-mates, queued behind it on its worker,
missed the timeout with it. Under a timeout each client is now a solo batch, started by a
free worker (:mod:`fedsim.engine.dispatch`), as Flower's simulation feeds one queue of
messages to its actor pool.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.dispatch import Dispatcher, batch_sizes
from fedsim.engine.worker import BatchResult, ClientAppSource, ClientBatch
from fedsim.worker_reduce import MetricSums

ROOT = Path(__file__).resolve().parents[2]
APP_DIR = Path(__file__).parents[1] / "apps" / "timeout"
sys.path.insert(0, str(APP_DIR))

import slow_app  # noqa: E402

SLOW = ClientAppSource(reference="slow_app:app", app_dir=str(APP_DIR))


class Reports:
    def __init__(self) -> None:
        self.items: list = []

    def phase_finished(self, report) -> None:
        self.items.append(report)


def timed_messages(nodes: int, slow_s: float) -> list[Message]:
    body = RecordDict(
        {"config": ConfigRecord({"slow-partition": slow_app.SLOW, "slow-seconds": slow_s})}
    )
    return [Message(body, NODE_ID_OFFSET + p, "train", group_id="1") for p in range(nodes)]


def test_the_slow_clients_batch_mates_shared_its_worker_before():
    """The premise: without the change, partitions 0 and 1 form the first batch of this
    phase on two workers, so partition 1 ran after the slow partition 0 on its worker."""
    assert batch_sizes(slow_app.NODES, 2)[0] >= 2


def test_every_client_but_the_slow_one_replies_within_the_timeout(ray_engine, caplog):
    reports = Reports()
    grid = ray_engine.open_run(SLOW, slow_app.NODES, observer=reports)
    assert ray_engine.backend.num_workers == 2
    grid.send_and_receive(timed_messages(slow_app.NODES, 0.0))  # workers up and warm
    with caplog.at_level(logging.WARNING, logger="fedsim.engine.grid"):
        replies = grid.send_and_receive(
            timed_messages(slow_app.NODES, slow_app.SLOW_S), timeout=slow_app.TIMEOUT_S
        )
    pids = sorted(int(r.content["metrics"]["pid"]) for r in replies)
    assert pids == [p for p in range(slow_app.NODES) if p != slow_app.SLOW]
    assert not any(r.has_error() for r in replies)
    report = reports.items[-1]
    assert (report.succeeded, report.timed_out, report.timeout_s) == (
        slow_app.NODES - 1,
        1,
        slow_app.TIMEOUT_S,
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "fedsim.engine.grid"]
    assert lines == [
        f"round 1, train: {slow_app.NODES - 1} of {slow_app.NODES} replies arrived within the "
        f"timeout of {slow_app.TIMEOUT_S:g} s; as in Flower, the ServerApp gets only those"
    ]
    # the client queued behind the slow one on its worker was asked back and ran elsewhere
    assert grid._dispatcher.released >= 1
    grid.wait_idle()  # the slow client still ran to its end (its worker is free again)


def test_no_warning_and_the_same_replies_when_no_timeout_fires(ray_engine, caplog):
    """A timeout that does not fire changes nothing the ServerApp sees: the same replies, in
    node order, as without one."""
    grid = ray_engine.open_run(SLOW, slow_app.NODES)
    with caplog.at_level(logging.WARNING, logger="fedsim.engine.grid"):
        untimed = grid.send_and_receive(timed_messages(slow_app.NODES, 0.0))
        timed = grid.send_and_receive(timed_messages(slow_app.NODES, 0.0), timeout=600.0)
    assert [r.metadata.src_node_id for r in timed] == [r.metadata.src_node_id for r in untimed]
    assert [r.content["metrics"]["pid"] for r in timed] == list(range(slow_app.NODES))
    assert not [r for r in caplog.records if r.name == "fedsim.engine.grid"]


def test_a_serverapp_polling_pull_messages_gets_every_reply_on_ray_workers(ray_engine):
    """Flower's push-then-poll loop: ``pull_messages`` alone (no ``send_and_receive`` waiting)
    receives the workers' replies. Before, a poll never read the workers' channels, so the
    loop waited forever."""
    grid = ray_engine.open_run(SLOW, slow_app.NODES)
    ids = set(grid.push_messages(timed_messages(slow_app.NODES, 0.0)))
    replies, deadline = [], time.monotonic() + 60.0
    while len(replies) < len(ids) and time.monotonic() < deadline:
        replies += grid.pull_messages(ids)
        time.sleep(0.05)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted(ids)


def test_a_late_reply_waits_for_pull_messages_until_its_ttl(ray_engine):
    """A reply late for ``send_and_receive`` is pulled later by its message id, once; with
    its TTL run out it is gone, as in Flower's LinkState."""
    grid = ray_engine.open_run(SLOW, slow_app.NODES)
    for ttl in (600.0, 1.0):
        timed = timed_messages(slow_app.NODES, 2.0)
        for message in timed:
            message.metadata.ttl = ttl
        replies = grid.send_and_receive(timed, timeout=1.0)
        assert len(replies) == slow_app.NODES - 1
        late = [timed[slow_app.SLOW].metadata.message_id]
        grid.wait_idle()
        time.sleep(max(0.0, ttl - 1.0) if ttl < 2 else 0.0)
        pulled = grid.pull_messages(late)
        if ttl > 2:
            assert [r.content["metrics"]["pid"] for r in pulled] == [slow_app.SLOW]
            assert grid.pull_messages(late) == []  # pulled once
        else:
            assert pulled == [] and not grid._phases  # expired: nothing kept


class InOrder:
    """A backend stand-in: records (worker, batch id) of each submit; finishes the oldest;
    cannot take batches back (as the in-process backend and Ray calls)."""

    num_workers = 2

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int]] = []

    def releases(self, worker):
        return False

    def release(self, future):
        return False

    def submit(self, worker, batch):
        self.submitted.append((worker, batch.batch_id))
        return (worker, batch.batch_id)

    def wait(self, futures, timeout):
        return futures[:1]

    def result(self, future):
        return BatchResult(future[1], [], {}, 1, 0, 0, 0, 0.0, MetricSums(), 0)


def batch(i: int) -> ClientBatch:
    return ClientBatch(batch_id=i, metadata=[None], content_index=[], contents=[])


def test_without_release_a_solo_batch_waits_for_an_idle_worker_and_nothing_queues_behind_it():
    backend = InOrder()
    dispatcher = Dispatcher(backend, depth=2)  # type: ignore[arg-type]
    for i in range(5):
        dispatcher.enqueue(batch(i), lambda r: None, lambda b, r: None, solo=True)
    # one solo batch per worker; the rest wait in the driver's queue
    assert backend.submitted == [(0, 0), (1, 1)]
    dispatcher.progress(None)  # batch 0 finishes: its worker takes the next one
    assert backend.submitted[2:] == [(0, 2)]
    assert [t.batch.batch_id for t in dispatcher.queue] == [3, 4]
    # an ordinary batch queues behind a busy worker's batch again, up to depth
    dispatcher.queue.clear()
    dispatcher.enqueue(batch(9), lambda r: None, lambda b, r: None)
    assert backend.submitted[3:] == []  # both workers hold a solo batch
    dispatcher.progress(None)
    assert backend.submitted[3:] == [(1, 9)]


FLOWER_RUN = """
import json, sys
sys.path.insert(0, sys.argv[2])
import slow_app
from flwr.simulation import run_simulation

run_simulation(server_app=slow_app.server, client_app=slow_app.app,
               num_supernodes=slow_app.NODES,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"address": "local", "num_cpus": 2,
                                             "logging_level": "WARNING"}})
json.dump({"warmed": slow_app.WARMED, "replied": slow_app.REPLIED, "late": slow_app.LATE},
          open(sys.argv[1], "w"))
"""


def test_the_same_nodes_reply_as_under_flowers_own_runtime(ray_engine, tmp_path):
    """The same ServerApp and ClientApp under Flower's ``run_simulation`` (two actors, its
    own Ray) and under fedsim (two workers): the same partitions reply in the timed phase,
    and the slow client's late reply is there for ``pull_messages`` afterwards."""
    ray_engine.run_server_app(slow_app.server, SLOW, slow_app.NODES)
    fedsim_replied, fedsim_late = list(slow_app.REPLIED), list(slow_app.LATE)
    script, out = tmp_path / "flower_run.py", tmp_path / "out.json"
    script.write_text(textwrap.dedent(FLOWER_RUN))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
    env.pop("RAY_ADDRESS", None)  # Flower starts a Ray of its own, not this session's
    done = subprocess.run(
        [sys.executable, str(script), str(out), str(APP_DIR)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.exists(), done.stderr[-3000:]
    flower = json.loads(out.read_text())
    assert flower["warmed"] == list(range(slow_app.NODES))
    expected = [p for p in range(slow_app.NODES) if p != slow_app.SLOW]
    assert flower["replied"] == expected
    assert fedsim_replied == expected
    assert flower["late"] == fedsim_late == [slow_app.SLOW]


SECAGG_APP = Path(__file__).parents[1] / "apps" / "secagg_timeout"


def flwr_run(out: Path, *extra: str) -> int:
    from fedsim.cli import main

    return main(["flwr-run", str(SECAGG_APP), "--out", str(out), "--secrets", str(out) + ".hex"]
                + list(extra))  # fmt: skip


def read_rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.ray
def test_flowers_secagg_demo_completes_every_round_with_four_of_five(tmp_path, ray_session, capsys):
    """Flower's SecAgg+ demo in small (legacy DefaultWorkflow + SecAggPlusWorkflow, five
    clients, one slower than the stage timeout), on two workers: as under Flower, every
    round completes with the four others. Before, the slow client's batch-mate missed the
    timeout with it, and every round stopped at ``Insufficient available nodes.``"""
    out = tmp_path / "ray"
    assert flwr_run(out) == 0
    err = capsys.readouterr().err
    records = read_rounds(out)
    assert [r["round"] for r in records] == [1, 2]
    assert not any("incomplete" in r for r in records), records
    assert "Insufficient available nodes" not in err
    for r in (1, 2):
        line = f"round {r}, train: 4 of 5 replies arrived within the timeout of 4 s"
        assert err.count(line) == 1, err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds"], summary["rounds_incomplete"]) == (2, 0)


def test_a_round_the_serverapp_stops_is_reported_incomplete(tmp_path, capsys):
    """On one in-process worker the slow client holds up every other (as on one Flower
    actor): SecAgg+ stops each round with ``Insufficient available nodes.``; the round's line
    and the progress say it did not complete, and the console says how many replies came."""
    out = tmp_path / "local"
    assert flwr_run(out, "--backend", "local", "--run-config", "num-server-rounds=1") == 0
    err = capsys.readouterr().err
    records = read_rounds(out)
    assert [r["round"] for r in records] == [1]
    assert records[0]["incomplete"] == ["Insufficient available nodes."]
    assert records[0]["train"]["timeout_s"] == 4.0 and records[0]["train"]["timed_out"] == 5
    assert "round 1, train: 0 of 5 replies arrived within the timeout of 4 s" in err
    assert (
        "fedsim: round 1/1 did not complete (the ServerApp logged: Insufficient available "
        "nodes.)" in err
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds"], summary["rounds_incomplete"]) == (1, 1)


class Releasing(InOrder):
    """Takes batches back: ``release`` asks, and the next ``wait`` hands them back."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list = []
        self.finish: list = []  # futures that finish at the next wait

    def releases(self, worker):
        return True

    def release(self, future):
        self.asked.append(future)
        return True

    def wait(self, futures, timeout):
        done = [f for f in futures if f in self.asked or f in self.finish]
        return done

    def result(self, future):
        from fedsim.engine.channel import BatchReleased

        if future in self.asked:
            self.asked.remove(future)
            raise BatchReleased("handed back")
        self.finish.remove(future)
        return super().result(future)


def test_a_solo_batch_queued_behind_a_busy_worker_is_asked_back_for_an_idle_one():
    backend = Releasing()
    dispatcher = Dispatcher(backend, depth=2)  # type: ignore[arg-type]
    for i in range(4):
        dispatcher.enqueue(batch(i), lambda r: None, lambda b, r: None, solo=True)
    assert backend.submitted == [(0, 0), (1, 1), (0, 2), (1, 3)]  # depth 2 on each
    assert backend.asked == []  # no worker is idle
    # worker 1 finishes both of its clients while worker 0 still runs client 0
    backend.finish += [(1, 1), (1, 3)]
    dispatcher.progress(None)
    assert backend.asked == [(0, 2)]  # the one queued behind client 0
    dispatcher.progress(None)  # handed back: the idle worker 1 runs it
    assert backend.submitted[4:] == [(1, 2)]
    assert dispatcher.released == 1 and backend.asked == []


class Sleeper:
    """Stands in for a ClientWorker on a channel: each batch is (name, seconds to sleep)."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run_batch(self, batch):
        name, seconds = batch
        self.ran.append(name)
        threading.Event().wait(seconds)
        return name


def test_a_worker_hands_back_a_batch_it_has_not_started_while_it_runs_another():
    from fedsim.engine.channel import BatchReleased, DriverChannel, WorkerChannel, wait_any
    from fedsim.engine.channel_frames import new_key

    key = new_key()
    runner = Sleeper()
    server = WorkerChannel(runner, "127.0.0.1", key)
    channel = DriverChannel(0, server.address, key)
    slow = channel.send(("slow", 2.0))
    queued = channel.send(("queued", 0.0))
    after = channel.send(("after", 0.0))
    assert not channel.release(slow)  # it runs (or is about to): never asked back
    started = time.monotonic()
    assert channel.release(queued) and not channel.release(queued)  # asked once
    while not queued.done:
        wait_any([channel], 5.0)
    assert time.monotonic() - started < 1.0  # answered while "slow" still runs
    with pytest.raises(BatchReleased):
        queued.value()
    while not (slow.done and after.done):
        wait_any([channel], 5.0)
    assert (slow.value(), after.value()) == ("slow", "after")  # the others as usual
    assert runner.ran == ["slow", "after"]  # the released batch never ran
    channel.close()
    server.close()
