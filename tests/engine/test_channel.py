"""The direct driver-worker channel: batches in order, errors, loss, authentication.

The adversarial cases (impostors, squatters, tampered frames) are in
tests/attacks/test_worker_channel.py."""

import socket
import threading
import time

import pytest

from fedsim.engine.channel import ChannelLost, DriverChannel, WorkerChannel, wait_any
from fedsim.engine.channel_frames import (
    ChannelAuthError,
    driver_handshake,
    new_key,
    worker_handshake,
)


class EchoWorker:
    """Stands in for a ClientWorker: replies with the batch, fails on 'boom'."""

    def run_batch(self, batch):
        if batch == "boom":
            raise ValueError("boom")
        return ("done", batch)


def open_pair():
    key = new_key()
    server = WorkerChannel(EchoWorker(), "127.0.0.1", key)
    return DriverChannel(0, server.address, key), server


def finish(channel, futures, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not all(f.done for f in futures) and time.monotonic() < deadline:
        wait_any([channel], 0.5)


def test_replies_come_back_in_order_and_errors_are_reraised():
    channel, _ = open_pair()
    futures = [channel.send(i) for i in range(5)] + [channel.send("boom")]
    finish(channel, futures)
    assert [f.value() for f in futures[:5]] == [("done", i) for i in range(5)]
    with pytest.raises(ValueError, match="boom"):
        futures[5].value()


def test_a_closed_worker_loses_pending_batches():
    key = new_key()
    listener = socket.create_server(("127.0.0.1", 0))

    def accept_then_die():
        sock, _ = listener.accept()
        conn = worker_handshake(sock, key, 5.0)
        conn.recv()
        conn.close()  # the worker process died mid-batch

    threading.Thread(target=accept_then_die, daemon=True).start()
    channel = DriverChannel(3, listener.getsockname(), key)
    futures = [channel.send(1), channel.send(2)]
    finish(channel, futures)
    for future in futures:
        with pytest.raises(ChannelLost, match="worker 3"):
            future.value()


def test_strangers_cannot_send_batches():
    key = new_key()
    server = WorkerChannel(EchoWorker(), "127.0.0.1", key)
    sock = socket.create_connection(server.address)
    with pytest.raises(ChannelAuthError):
        driver_handshake(sock, new_key(), 5.0)  # the worker refuses, so its proof is missing
    sock.close()
    # and the worker still serves its own driver afterwards
    channel = DriverChannel(0, server.address, key)
    future = channel.send("ok")
    finish(channel, [future])
    assert future.value() == ("done", "ok")


def test_large_batches_travel_intact():
    import numpy as np

    channel, _ = open_pair()
    batches = [np.arange(n, dtype=np.float64) for n in (1, 9_000, 600_000)]  # up to 4.8 MB
    futures = [channel.send(("array", b)) for b in batches]
    finish(channel, futures, timeout=30.0)
    for batch, future in zip(batches, futures):
        tag, (_, echoed) = future.value()
        assert tag == "done" and np.array_equal(echoed, batch)
