"""The worker socket against a party on the network (after ../shared/attacks/channel_dos.py).

The attacker can connect to the worker's port, listen on an address the driver dials, and
sit between the two relaying, dropping, replaying, reordering or altering bytes. It does
not know the channel key. The claims: a silent peer blocks neither side; neither an
impostor worker nor an impostor driver is accepted, and nothing they send is unpickled;
every frame after the handshake that is not the next one the key holder sent is refused
before it is unpickled, and the connection ends (its pending batches are reported lost).
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from fedsim.engine.channel import ChannelLost, DriverChannel, WorkerChannel, wait_any
from fedsim.engine.channel_frames import (
    NONCE_BYTES,
    PROOF_BYTES,
    PROTOCOL,
    TAG_BYTES,
    ChannelAuthError,
    new_key,
)
from fedsim.engine.worker import Content

HELLO = len(PROTOCOL) + NONCE_BYTES
FRAME_HEAD = 16 + TAG_BYTES
#: what attacker-controlled pickles managed to execute, and where
EXECUTED: list[str] = []


def _executed(where: str) -> str:
    EXECUTED.append(where)
    return where


class Evil:
    """A pickle that runs code wherever it is unpickled."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self):
        return (_executed, (self.where,))


@pytest.fixture(autouse=True)
def _clean():
    EXECUTED.clear()
    yield
    assert EXECUTED == [], f"attacker code ran in: {EXECUTED}"


class RecordingWorker:
    """Stands in for a ClientWorker: records each batch it runs and echoes it."""

    def __init__(self) -> None:
        self.ran: list[object] = []

    def run_batch(self, batch):
        self.ran.append(batch)
        return ("done", batch)


def read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed the connection without sending anything more."""
    try:
        return sock.recv(TAG_BYTES) == b""
    except ConnectionResetError:  # it closed with our unread bytes in its buffer
        return True


def finish(channel: DriverChannel, futures, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.done for f in futures) and time.monotonic() < deadline:
        wait_any([channel], 0.2)
    assert all(f.done for f in futures), "a reply neither came nor was reported lost"


# -- silent peers -------------------------------------------------------------------------


def test_silent_squatters_do_not_block_the_legitimate_driver():
    key = new_key()
    worker = RecordingWorker()
    # the worker would wait two minutes for each squatter's handshake
    server = WorkerChannel(worker, "127.0.0.1", key, handshake_timeout=120.0)
    squatters = [socket.create_connection(server.address) for _ in range(5)]
    time.sleep(0.2)
    channel = DriverChannel(0, server.address, key, timeout=5.0)  # TimeoutError if blocked
    future = channel.send("batch")
    finish(channel, [future])
    assert future.value() == ("done", "batch") and worker.ran == ["batch"]
    for squatter in squatters:
        squatter.close()
    server.close()


def test_a_silent_peer_is_dropped_when_its_handshake_times_out():
    server = WorkerChannel(RecordingWorker(), "127.0.0.1", new_key(), handshake_timeout=0.3)
    squatter = socket.create_connection(server.address, timeout=30.0)
    assert read_exact(squatter, HELLO)[: len(PROTOCOL)] == PROTOCOL
    assert hung_up(squatter)
    server.close()


def test_a_silent_impostor_worker_does_not_block_the_driver():
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    with pytest.raises(TimeoutError):
        DriverChannel(0, listener.getsockname(), new_key(), timeout=0.3)
    listener.close()


# -- impostor workers ---------------------------------------------------------------------


def impostor_worker(script) -> tuple[str, int]:
    """Listen where the driver will dial and play ``script(sock)`` on the connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = listener.accept()
        try:
            script(sock)
        except (OSError, EOFError):
            pass
        finally:
            listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()


def test_an_impostor_worker_that_sends_a_pickle_at_once_is_refused():
    # the attack of channel_dos.py: answer anything, then send a reply that runs code
    address = impostor_worker(lambda s: s.sendall(pickle.dumps((True, Evil("driver"))) * 4))
    with pytest.raises(ChannelAuthError, match="does not speak"):
        DriverChannel(0, address, new_key(), timeout=5.0)


def test_an_impostor_worker_that_guesses_the_proof_is_refused():
    def script(sock):
        sock.sendall(PROTOCOL + bytes(NONCE_BYTES))
        read_exact(sock, NONCE_BYTES + PROOF_BYTES)  # the driver's proof: useless elsewhere
        sock.sendall(bytes(PROOF_BYTES))  # no key, no proof
        sock.sendall(pickle.dumps((True, Evil("driver"))))
        time.sleep(1.0)

    with pytest.raises(ChannelAuthError, match="worker's proof"):
        DriverChannel(0, impostor_worker(script), new_key(), timeout=5.0)


def test_a_worker_proof_from_another_session_is_refused():
    """The impostor relays a real worker's hello, keeps the real worker's proof from
    that session, and offers it to the driver in a second session with the same hello."""
    key = new_key()
    real = WorkerChannel(RecordingWorker(), "127.0.0.1", key)
    recorded = {}

    def first(sock):
        upstream = socket.create_connection(real.address)
        recorded["hello"] = read_exact(upstream, HELLO)
        sock.sendall(recorded["hello"])
        upstream.sendall(read_exact(sock, NONCE_BYTES + PROOF_BYTES))
        recorded["proof"] = read_exact(upstream, PROOF_BYTES)
        sock.sendall(recorded["proof"])
        time.sleep(0.5)

    DriverChannel(0, impostor_worker(first), key, timeout=5.0)  # a relay is only a hop

    def second(sock):
        sock.sendall(recorded["hello"])  # same hello, but the driver's nonce is fresh
        read_exact(sock, NONCE_BYTES + PROOF_BYTES)
        sock.sendall(recorded["proof"])
        time.sleep(1.0)

    with pytest.raises(ChannelAuthError, match="worker's proof"):
        DriverChannel(0, impostor_worker(second), key, timeout=5.0)
    real.close()


# -- impostor drivers ---------------------------------------------------------------------


def test_an_impostor_driver_is_refused_before_anything_is_read_or_run():
    worker = RecordingWorker()
    server = WorkerChannel(worker, "127.0.0.1", new_key())
    sock = socket.create_connection(server.address, timeout=10.0)
    hello = read_exact(sock, HELLO)
    assert hello[: len(PROTOCOL)] == PROTOCOL
    sock.sendall(bytes(NONCE_BYTES) + bytes(PROOF_BYTES))  # a guessed proof
    sock.sendall(pickle.dumps(Evil("worker")))  # and a batch right behind it
    assert hung_up(sock)  # no worker proof: the worker hung up
    assert worker.ran == []


def test_an_impostor_driver_that_skips_the_handshake_gets_nothing_run():
    worker = RecordingWorker()
    server = WorkerChannel(worker, "127.0.0.1", new_key())
    sock = socket.create_connection(server.address, timeout=10.0)
    sock.sendall(pickle.dumps(Evil("worker")) * 8)  # old style: a bare pickled batch
    read_exact(sock, HELLO)
    assert hung_up(sock)
    assert worker.ran == []


# -- a party in the middle ----------------------------------------------------------------


class FrameProxy:
    """Sits between the driver and the worker: relays the handshake unchanged, then hands
    each frame of each direction to a rule that returns the frames to forward."""

    def __init__(self, target, to_worker=None, to_driver=None) -> None:
        self.target = target
        self.rules = {"to_worker": to_worker, "to_driver": to_driver}
        self.seen: dict[str, list[bytes]] = {"to_worker": [], "to_driver": []}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        down, _ = self.listener.accept()
        up = socket.create_connection(self.target)
        down.sendall(read_exact(up, HELLO))
        up.sendall(read_exact(down, NONCE_BYTES + PROOF_BYTES))
        down.sendall(read_exact(up, PROOF_BYTES))
        threading.Thread(target=self._pump, args=(down, up, "to_worker"), daemon=True).start()
        self._pump(up, down, "to_driver")

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        rule = self.rules[name]
        try:
            while True:
                head = read_exact(src, FRAME_HEAD)
                frame = head + read_exact(src, int.from_bytes(head[8:16], "big"))
                self.seen[name].append(frame)
                index = len(self.seen[name]) - 1
                for out in rule(index, frame, self.seen) if rule else [frame]:
                    dst.sendall(out)
        except (OSError, EOFError):
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def flip_last_byte(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 1])


def through_proxy(**rules):
    key = new_key()
    worker = RecordingWorker()
    server = WorkerChannel(worker, "127.0.0.1", key)
    proxy = FrameProxy(server.address, **rules)
    return DriverChannel(0, proxy.address, key, timeout=5.0), worker, proxy


def test_an_untouched_relay_changes_nothing():
    channel, worker, _ = through_proxy()
    futures = [channel.send(i) for i in range(3)]
    finish(channel, futures)
    assert [f.value() for f in futures] == [("done", i) for i in range(3)]
    assert worker.ran == [0, 1, 2]


def held_back(frames_to_send):
    """A rule that holds frame 0 and sends ``frames_to_send(frame0, frame1)`` on frame 1."""
    held = {}

    def rule(index, frame, seen):
        if index == 0:
            held[0] = frame
            return []
        return frames_to_send(held[0], frame) if index == 1 else [frame]

    return rule


@pytest.mark.parametrize(
    "name, rule, runs",
    [
        ("tampered", lambda i, f, seen: [flip_last_byte(f)] if i == 0 else [f], []),
        ("header length changed", lambda i, f, seen: [f[:15] + bytes([f[15] ^ 1]) + f[16:]], []),
        ("replayed", lambda i, f, seen: [seen["to_worker"][0]] if i == 1 else [f], [0]),
        ("reordered", held_back(lambda first, second: [second, first]), []),
        ("dropped", held_back(lambda first, second: [second]), []),
    ],
)
def test_a_batch_frame_that_is_not_the_next_one_sent_is_refused(name, rule, runs):
    channel, worker, _ = through_proxy(to_worker=rule)
    futures = [channel.send(0), channel.send(1)]
    finish(channel, futures)
    assert worker.ran == runs  # the refused frame and everything after it never ran
    if name == "replayed":  # the genuine first batch was answered, the replay refused
        assert futures[0].value() == ("done", 0)
        futures = futures[1:]
    for future in futures:
        with pytest.raises(ChannelLost):
            future.value()


def test_a_forged_reply_is_refused_without_being_unpickled():
    evil = pickle.dumps((True, Evil("driver")))

    def forge(index, frame, seen):  # keep the header and tag, swap in the attacker's pickle
        head = frame[:8] + len(evil).to_bytes(8, "big") + frame[16:FRAME_HEAD]
        return [head + evil]

    channel, worker, _ = through_proxy(to_driver=forge)
    future = channel.send("batch")
    finish(channel, [future])
    with pytest.raises(ChannelLost, match="fails its MAC"):
        future.value()


def test_the_drivers_own_frame_reflected_back_is_refused():
    """Each direction has its own key: the driver's batch 0 (a valid frame number 0) sent
    back to it in place of reply 0 does not verify."""
    channel, worker, _ = through_proxy(to_driver=lambda i, f, seen: [seen["to_worker"][0]])
    future = channel.send(("done", "forged"))  # would even unpickle to a plausible reply
    finish(channel, [future])
    with pytest.raises(ChannelLost, match="fails its MAC"):
        future.value()
    assert worker.ran == [("done", "forged")]


@pytest.mark.parametrize("how", ["tampered", "replayed"])
def test_a_reply_frame_that_is_not_the_next_one_sent_is_refused(how):
    def rule(index, frame, seen):
        if how == "tampered":
            return [flip_last_byte(frame)]
        return [seen["to_driver"][0]]  # every reply is the first one again

    channel, worker, _ = through_proxy(to_driver=rule)
    first = channel.send("a")
    finish(channel, [first])
    if how == "tampered":
        with pytest.raises(ChannelLost, match="fails its MAC"):
            first.value()
        return
    assert first.value() == ("done", "a")
    second = channel.send("b")
    finish(channel, [second])
    with pytest.raises(ChannelLost, match="replayed, reordered"):
        second.value()


def test_frames_from_an_earlier_connection_are_refused():
    """Keys are fresh per connection: a batch recorded on one connection, replayed at the
    start of the next, is refused."""
    key = new_key()
    worker = RecordingWorker()
    server = WorkerChannel(worker, "127.0.0.1", key)
    first = FrameProxy(server.address)
    channel = DriverChannel(0, first.address, key, timeout=5.0)
    future = channel.send("first session")
    finish(channel, [future])
    channel.close()
    recorded = first.seen["to_worker"][0]
    second = FrameProxy(server.address, to_worker=lambda i, f, seen: [recorded])
    channel = DriverChannel(0, second.address, key, timeout=5.0)
    future = channel.send("second session")
    finish(channel, [future])
    with pytest.raises(ChannelLost):
        future.value()
    assert worker.ran == ["first session"]


@dataclass
class SharingBatch:
    """A batch whose content travels as a shared content frame (channel_contents)."""

    name: str
    contents: list[Content]

    def with_contents(self, blobs):
        return SharingBatch(self.name, [Content(c.key, blobs[c.key]) for c in self.contents])


def send_sharing(channel, name, blob):
    return channel.send(SharingBatch(name, [Content(1, None)]), name, [(1, blob)])


@pytest.mark.parametrize(
    "name, rule, runs",
    [  # frame 0: the shared content; 1: the batch naming it; 2: a later batch naming it
        ("content tampered", lambda i, f, seen: [flip_last_byte(f)] if i == 0 else [f], []),
        ("content replayed", lambda i, f, seen: [seen["to_worker"][0]] if i == 2 else [f], ["a"]),
        ("content dropped", lambda i, f, seen: [] if i == 0 else [f], []),
    ],
)
def test_a_shared_content_frame_cannot_be_swapped_replayed_or_dropped(name, rule, runs):
    model = bytes(range(256)) * 400
    channel, worker, _ = through_proxy(to_worker=rule)
    futures = [send_sharing(channel, "a", model), send_sharing(channel, "b", model)]
    finish(channel, futures)
    assert [b.name for b in worker.ran] == runs  # nothing ran on an attacker's content
    assert all(c.blob == model for b in worker.ran for c in b.contents)
    for future in futures[len(runs):]:
        with pytest.raises(ChannelLost):
            future.value()
