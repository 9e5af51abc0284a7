"""A worker's reply never leaves the driver waiting for ever (fedsim.engine.channel).

The stall seen at C = 1000, d = 10^5: the driver blocked sending batch k + 1 to a worker
that was running batch k, and the worker then blocked sending its reply k (each client's
sealed state, about 0.5 MB, travels both ways) to a driver that was not reading. Both
socket buffers full, both ends in ``sendall``, the workers idle. The channel tests below
rebuild that with two 32 MiB frames; the Ray tests run the engine with states of 32 MiB
per client, and lose a reply on purpose (``ClientBatch.lose_reply``): the batch then fails
with a :class:`~fedsim.engine.backend.WorkerTimeout` naming the worker, never a hang.
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedsim.config import ConfigError
from fedsim.engine.channel import DriverChannel, ReplyLost, WorkerChannel, wait_any
from fedsim.engine.channel_frames import TAG_BYTES, new_key, worker_handshake
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.engine.worker import ClientAppSource
from fedsim.record_codec import to_numpy, to_record

MIB = 1 << 20
TOY = ClientAppSource(reference="toy_app:app", app_dir=str(Path(__file__).parents[1]))


@dataclass
class Job:
    """A batch for the channel tests: its size in MiB, and whether its reply is lost."""

    name: str
    mib: int = 0
    lose_reply: bool = False
    sleep_s: float = 0.0


class Runner:
    """Stands in for a ClientWorker: sleeps, then replies ``(name, bytes of mib MiB)``."""

    def run_batch(self, job: Job):
        if job.sleep_s:
            threading.Event().wait(job.sleep_s)  # the batch runs; the worker reads meanwhile
        return job.name, bytes(job.mib * MIB)


def pair(worker: int = 0, reply_timeout: float = 300.0, heartbeat_s: float = 5.0):
    key = new_key()
    server = WorkerChannel(Runner(), "127.0.0.1", key, heartbeat_s=heartbeat_s)
    return DriverChannel(worker, server.address, key, reply_timeout=reply_timeout), server


def finish(channel: DriverChannel, futures) -> None:
    """Wait with no timeout of our own: only the channel's reply deadline ends a wait."""
    while not all(f.done for f in futures):
        wait_any([channel], None)


# -- the stall, on the channel alone -----------------------------------------------------------
def test_large_batches_and_replies_both_ways_do_not_stall():
    """Two batches queued on a worker (depth 2), they and their replies larger than the two
    socket buffers together (8 MiB passes on main here, 32 MiB stalls): on main the driver
    blocks in sendall of the second batch while the worker blocks in sendall of the first
    reply."""
    channel, _ = pair()
    outcome: dict = {}

    def drive():
        futures = [channel.send(Job(f"b{i}", mib=32, sleep_s=0.2), f"b{i}") for i in range(2)]
        finish(channel, futures)
        outcome["replies"] = [(name, len(body)) for name, body in (f.value() for f in futures)]

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    driver.join(300)  # a guard so that a stall fails the test instead of hanging the suite
    assert not driver.is_alive(), "the driver is still blocked on the worker's socket"
    assert outcome["replies"] == [("b0", 32 * MIB), ("b1", 32 * MIB)]


def test_a_lost_reply_ends_in_reply_lost_naming_the_worker_and_the_batch():
    channel, _ = pair(worker=5, reply_timeout=1.0, heartbeat_s=0.25)
    future = channel.send(Job("x", lose_reply=True), "batch 7 (3 clients, train, round 2)")
    finish(channel, [future])
    with pytest.raises(ReplyLost) as err:
        future.value()
    message = str(err.value)
    assert "worker 5" in message and "batch 7 (3 clients, train, round 2)" in message
    assert "no heartbeat" in message and "reply timeout 1 s" in message
    assert isinstance(err.value, TimeoutError)


def test_a_worker_busy_past_the_reply_timeout_is_kept_alive_by_its_heartbeats():
    channel, _ = pair(reply_timeout=2.0, heartbeat_s=0.25)
    future = channel.send(Job("slow", mib=1, sleep_s=5.0), "slow")
    finish(channel, [future])
    assert future.value() == ("slow", bytes(MIB))


def test_a_reply_to_a_later_batch_marks_the_skipped_batch_lost():
    channel, _ = pair(worker=2)
    futures = [channel.send(Job("a", lose_reply=True), "batch a"), channel.send(Job("b"), "b")]
    finish(channel, futures)
    with pytest.raises(ReplyLost, match="worker 2 sent no reply to batch a"):
        futures[0].value()
    assert futures[1].value() == ("b", b"")


def _silent_worker(behaviour):
    """A listener whose one worker completes the handshake, then does ``behaviour(conn)``."""
    key = new_key()
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        sock, _ = listener.accept()
        conn = worker_handshake(sock, key, 5.0)
        behaviour(conn)
        done.wait(60)  # keep the connection open (never read, never finish the frame)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname(), key, done


def test_a_worker_that_stops_reading_fails_the_send_in_time():
    address, key, done = _silent_worker(lambda conn: None)
    channel = DriverChannel(4, address, key, reply_timeout=1.0)
    future = channel.send(bytes(64 * MIB), "batch 9 (a large one)")
    done.set()
    with pytest.raises(ReplyLost, match="worker 4: batch 9 .* could not be sent within 1 s"):
        future.value()


def test_a_frame_that_stops_halfway_ends_in_reply_lost():
    def half_frame(conn):  # a header announcing 100 bytes, then 10 of them
        header = (0).to_bytes(8, "big") + (100).to_bytes(8, "big")
        conn.sock.sendall(header + bytes(TAG_BYTES) + bytes(10))

    address, key, done = _silent_worker(half_frame)
    channel = DriverChannel(6, address, key, reply_timeout=1.0)
    future = channel.send(b"go", "batch 1")
    finish(channel, [future])
    done.set()
    with pytest.raises(ReplyLost, match="worker 6: a frame stopped halfway .* batch 1 pending"):
        future.value()


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_bad_reply_timeouts_are_refused_naming_the_key(value):
    from fedsim.engine import EngineConfig

    with pytest.raises(ConfigError) as err:
        EngineConfig(reply_timeout_s=value)
    assert err.value.key == "engine.reply_timeout_s" and "seconds > 0" in str(err.value)


def test_the_run_config_engine_table_takes_the_reply_timeout():
    from fedsim.config import from_mapping
    from fedsim.engine import EngineConfig

    assert from_mapping(EngineConfig, {"reply-timeout-s": 45}, "engine").reply_timeout_s == 45
    with pytest.raises(ConfigError) as err:
        from_mapping(EngineConfig, {"reply_timeout_s": -3}, "engine")
    assert err.value.key == "engine.reply_timeout_s"


# -- on the Ray backend -------------------------------------------------------------------------
def _messages(clients: int, server_round: int):
    body = RecordDict(
        {
            "arrays": to_record({"w": np.zeros(3, np.float32)}),
            "config": ConfigRecord({"step": 0.5, "server-round": server_round}),
        }
    )
    return [Message(body, NODE_ID_OFFSET + p, "train") for p in range(clients)]


def _outcome(replies):
    return sorted(
        (r.content["metrics"]["pid"], to_numpy(r.content["arrays"])["w"].tolist()) for r in replies
    )


@pytest.fixture
def one_worker(ray_session):
    """An engine of one Ray worker whose replies are lost after 2 s of silence."""
    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(workers=1, reply_timeout_s=2.0)).start()
    yield engine
    engine.close()


def _losing(engine, monkeypatch, batches: set[int]):
    """Make the worker lose its reply to the first attempt of the batches numbered
    ``batches``."""
    backend = engine.backend
    submit = backend.submit
    left = set(batches)

    def lossy(worker, batch):
        lose = batch.batch_id in left
        left.discard(batch.batch_id)
        return submit(worker, replace(batch, lose_reply=lose))

    monkeypatch.setattr(backend, "submit", lossy)


@pytest.mark.ray
def test_a_lost_reply_on_ray_fails_its_batch_with_a_timeout_naming_the_worker(
    one_worker, monkeypatch
):
    grid = one_worker.open_run(TOY, 1)
    grid._dispatcher.max_attempts = 1  # report the first timeout instead of re-running
    actor = one_worker.backend._actor_id(0)
    _losing(one_worker, monkeypatch, {0})
    (reply,) = grid.send_and_receive(_messages(1, server_round=3))  # no timeout of its own
    assert reply.has_error()
    reason = reply.error.reason
    assert f"worker 0 (Ray actor {actor}) timed out" in reason
    assert "no reply to batch 0 (1 clients, train, round 3)" in reason
    assert "no heartbeat" in reason and "reply timeout 2 s" in reason
    assert grid.workers_replaced == 1


@pytest.mark.ray
def test_a_lost_reply_on_ray_is_run_again_on_a_fresh_worker(one_worker, monkeypatch, caplog):
    grid = one_worker.open_run(TOY, 3)
    expected = _outcome(grid.send_and_receive(_messages(3, server_round=1)))
    lossy = one_worker.open_run(TOY, 3)
    _losing(one_worker, monkeypatch, {lossy._next_batch})  # the first batch of the next phase
    with caplog.at_level(logging.WARNING, logger="fedsim.engine.dispatch"):
        replies = lossy.send_and_receive(_messages(3, server_round=1))
    assert _outcome(replies) == expected and not any(r.has_error() for r in replies)
    assert lossy.workers_replaced == 1
    assert any("worker 0 (Ray actor" in m and "timed out" in m for m in caplog.messages)


@pytest.mark.ray
def test_states_larger_than_the_socket_buffers_travel_both_ways_on_ray(ray_session):
    """Each client keeps 32 MiB of state: from the second round on, a batch carries its
    clients' states in and its reply carries them out (as DDGauss's sealed states do). On
    main round 2 stalls: the driver blocks in ``_send_frame`` under ``Dispatcher._fill``
    (the second batch) while the worker blocks sending its reply to the first."""
    from fedsim.engine import Engine, EngineConfig

    with Engine(EngineConfig(workers=1, reply_timeout_s=60.0)) as engine:
        grid = engine.open_run(TOY, 4, run_config={"state-bytes": 32 * MIB})
        for server_round in (1, 2):
            replies = grid.send_and_receive(_messages(4, server_round))
            assert not any(r.has_error() for r in replies), [r.error for r in replies]
            assert [pid for pid, _ in _outcome(replies)] == [0, 1, 2, 3]
        assert grid.workers_replaced == 0
        stored = grid.state_store.get_many(NODE_ID_OFFSET + p for p in range(4))
        states = [pickle.loads(blob) for blob in stored.values()]
        assert [int(s["calls"]["n"]) for s in states] == [2, 2, 2, 2]
        assert {len(s["ballast"]["bytes"]) for s in states} == {32 * MIB}
