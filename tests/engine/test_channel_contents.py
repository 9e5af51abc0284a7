"""Large instruction contents cross each driver-worker connection once
(fedsim.engine.channel_contents): the driver's mirror and the worker's store agree frame by
frame, whatever happens to the batches that name them (run, released, queued)."""

import random
import threading
import time
from dataclasses import dataclass, replace

import pytest

from fedsim.engine.channel import BatchReleased, DriverChannel, WorkerChannel, wait_any
from fedsim.engine.channel_contents import (
    BATCH,
    CHANNEL_CONTENTS,
    ContentMirror,
    ContentStore,
)
from fedsim.engine.channel_frames import FramedSocket, new_key
from fedsim.engine.worker import Content


@dataclass
class Batch:
    """The part of a ClientBatch a channel sees: a name, contents, a sleep."""

    name: str
    contents: list[Content]
    seconds: float = 0.0

    def with_contents(self, blobs):
        contents = [Content(c.key, blobs[c.key]) if c.key in blobs else c for c in self.contents]
        return replace(self, contents=contents)


class Recorder:
    """Stands in for a ClientWorker: answers with the blobs each batch arrived with."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run_batch(self, batch):
        self.ran.append(batch.name)
        threading.Event().wait(batch.seconds)
        return [c.blob for c in batch.contents]


def send(channel, name, contents, seconds=0.0):
    """Send a batch whose contents travel as the backend sends them: keys plus blobs."""
    stripped = [Content(key, None) for key, _ in contents]
    return channel.send(Batch(name, stripped, seconds), name, contents)


def finish(channel, futures, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not all(f.done for f in futures) and time.monotonic() < deadline:
        wait_any([channel], 0.5)
    assert all(f.done for f in futures)


@pytest.fixture
def pair(monkeypatch):
    """A channel whose driver side counts the bytes of every frame it sends."""
    sent: list[int] = []
    original = FramedSocket.send

    def counting(self, payload, prefix=b""):
        if self is channel.conn:
            sent.append(len(prefix) + len(payload))
        return original(self, payload, prefix)

    monkeypatch.setattr(FramedSocket, "send", counting)
    key = new_key()
    runner = Recorder()
    server = WorkerChannel(runner, "127.0.0.1", key)
    channel = DriverChannel(0, server.address, key)
    yield channel, runner, sent
    channel.close()
    server.close()


def test_a_shared_content_crosses_the_connection_once_and_every_batch_gets_it(pair):
    channel, _, sent = pair
    model = random.randbytes(400_000)
    futures = [send(channel, f"client {i}", [(7, model)]) for i in range(50)]
    finish(channel, futures)
    assert all(f.value() == [model] for f in futures)
    assert sum(sent) < len(model) + 50 * 2_000  # the model once, then 50 small batches


def test_a_released_batch_leaves_its_contents_where_the_driver_counts_them(pair):
    channel, runner, _ = pair
    model = random.randbytes(100_000)
    slow = send(channel, "slow", [], seconds=1.0)
    queued = send(channel, "queued", [(3, model)])  # the model's only copy goes with it
    assert channel.release(queued)
    finish(channel, [queued])
    with pytest.raises(BatchReleased):
        queued.value()
    after = send(channel, "after", [(3, model)])  # sent as a key alone
    finish(channel, [slow, after])
    assert after.value() == [model] and runner.ran == ["slow", "after"]


def test_a_new_run_numbers_its_contents_afresh(pair):
    channel, _, _ = pair
    old, new = random.randbytes(70_000), random.randbytes(70_000)
    first = send(channel, "run 1", [(1, old)])
    finish(channel, [first])
    channel.forget_contents()
    second = send(channel, "run 2", [(1, new)])  # key 1 again, another content
    finish(channel, [second])
    assert (first.value(), second.value()) == ([old], [new])


def test_mirror_and_store_agree_under_eviction_pressure():
    rng = random.Random(0)
    mirror, store = ContentMirror(capacity=4), ContentStore()
    blobs = {k: f"content {k}".encode() for k in range(12)}
    for _ in range(500):
        keys = rng.sample(range(12), rng.randint(0, 4))
        frames, prefix = mirror.frames([(k, blobs[k]) for k in keys])
        for frame in frames:
            store.take(bytearray(frame))
        pickle_part, got = store.resolve(bytearray(prefix + b"pickle"))
        assert bytes(pickle_part) == b"pickle" and got == {k: blobs[k] for k in keys}
        assert len(store) <= 4  # the worker keeps no more than the mirror allows
    with pytest.raises(ValueError, match="5 shared contents; a connection keeps 4"):
        mirror.frames([(k, blobs[k]) for k in range(5)])
    assert ContentMirror(capacity=CHANNEL_CONTENTS).forget() is None  # nothing to drop
    with pytest.raises(ValueError, match="capacity = 0"):
        ContentMirror(capacity=0)


def test_forget_drops_everything_the_worker_holds():
    mirror, store = ContentMirror(capacity=3), ContentStore()
    for frame in mirror.frames([(k, bytes([k]) * 10) for k in range(3)])[0]:
        store.take(bytearray(frame))
    assert len(store) == 3
    store.take(bytearray(mirror.forget()))
    assert len(store) == 0
    with pytest.raises(LookupError, match=r"contents \[1\]"):
        store.resolve(bytearray(BATCH + (1).to_bytes(4, "big") + (1).to_bytes(8, "big")))


def test_a_batch_naming_a_content_never_sent_is_answered_with_an_error_that_names_it(pair):
    channel, runner, _ = pair
    future = channel.send(Batch("orphan", [Content(9, None)]), "orphan")
    channel._contents._held[9] = None  # the mirror wrongly believes the worker holds 9
    stray = channel.send(Batch("stray", [Content(9, None)]), "stray", [(9, b"x" * 70_000)])
    finish(channel, [future, stray])
    assert future.value() == [None]  # no shared contents named: it runs as it came
    with pytest.raises(LookupError, match=r"contents \[9\]"):
        stray.value()
    assert runner.ran == ["orphan"]
    later = send(channel, "later", [(5, b"y" * 70_000)])  # the connection still serves
    finish(channel, [later])
    assert later.value() == [b"y" * 70_000]


def test_a_client_batch_sends_only_its_large_contents_apart_and_gets_them_back():
    from fedsim.engine.worker import ClientBatch

    big, small = random.randbytes(80_000), b"small"
    contents = [Content(1, big), Content(2, small), Content(3, None), Content(4, big + b"!")]
    batch = ClientBatch(batch_id=0, metadata=[], content_index=[], contents=contents)
    stripped, shared = batch.sharing_contents(most=1, min_bytes=1 << 16)
    assert shared == [(1, big)]  # at most one; the small and the kept ones stay as they are
    assert stripped.contents == [Content(1, None), *contents[1:]]
    assert stripped.with_contents(dict(shared)) == batch
    assert batch.sharing_contents(most=16, min_bytes=1 << 20) == (batch, [])
