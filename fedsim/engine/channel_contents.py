"""Instruction contents sent once per connection of the driver-worker channel.

A phase's instruction content (a model of d parameters, say) is the same for every client
of the phase, and under a timeout every client is a batch of its own (a *solo* batch,
:mod:`fedsim.engine.dispatch`). Carried inside each batch, a 400 kB model crossed the
channel once per client: 1000 times a round at C = 1000. Here a large content crosses each
connection once, in a frame of its own; the batches that use it name it by key.

Frames (inside the authenticated frames of :mod:`fedsim.engine.channel_frames`)::

    CONTENT || drops (4 bytes) || drop keys (8 bytes each) || key (8 bytes) || blob
    BATCH   || count (4 bytes) || keys (8 bytes each)      || the pickled batch

The driver's :class:`ContentMirror` decides everything: which content goes out, and which
the worker drops (the least recently used beyond :data:`CHANNEL_CONTENTS`, never one the
batch being sent names). The worker's :class:`ContentStore` only obeys, and its reader
resolves a batch's keys the moment the batch arrives, in frame order. So the mirror is
exact however batches end: a batch taken back unstarted (a release) or queued behind a slow
one holds its contents from its arrival on, and what the store holds is what the mirror
says, frame by frame.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: frame kinds (a pickled batch starts with b"\x80"; a release with b"R")
CONTENT = b"C"
BATCH = b"B"
#: large contents a connection keeps at once
CHANNEL_CONTENTS = 16
#: contents of at least this many pickled bytes are sent once per connection; smaller
#: ones travel inside their batch (a frame of their own would cost more than the copy)
SHARED_CONTENT_BYTES = 1 << 16
_COUNT = 4
_KEY = 8


def _keys(keys: Sequence[int]) -> bytes:
    return len(keys).to_bytes(_COUNT, "big") + b"".join(k.to_bytes(_KEY, "big") for k in keys)


def _read_keys(view: memoryview, at: int) -> tuple[list[int], int]:
    count = int.from_bytes(view[at : at + _COUNT], "big")
    at += _COUNT
    keys = [int.from_bytes(view[at + _KEY * i : at + _KEY * (i + 1)], "big") for i in range(count)]
    return keys, at + _KEY * count


class ContentMirror:
    """The driver's record of what one connection's worker holds (:class:`ContentStore`)."""

    def __init__(self, capacity: int = CHANNEL_CONTENTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity = {capacity!r}; it must be >= 1")
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def frames(self, contents: Sequence[tuple[int, bytes]]) -> tuple[list[bytes], bytes]:
        """For a batch that uses ``contents`` (key, pickled blob): the CONTENT frames to send
        before it (one per content the worker lacks) and its BATCH prefix. Raises
        ValueError for more contents than the connection keeps."""
        keys = list(dict.fromkeys(key for key, _ in contents))
        if len(keys) > self.capacity:
            raise ValueError(
                f"a batch of {len(keys)} shared contents; a connection keeps {self.capacity}"
            )
        wanted = set(keys)
        frames: list[bytes] = []
        for key, blob in contents:
            if key in self._held:
                continue
            drops = []
            while len(self._held) >= self.capacity:
                drop = next(k for k in self._held if k not in wanted)
                del self._held[drop]
                drops.append(drop)
            self._held[key] = None
            frames.append(CONTENT + _keys(drops) + key.to_bytes(_KEY, "big") + blob)
        for key in keys:
            self._held.move_to_end(key)
        return frames, BATCH + _keys(keys)

    def forget(self) -> bytes | None:
        """A CONTENT-less frame that drops everything the worker holds (a new run numbers its
        contents afresh); None if it holds nothing."""
        if not self._held:
            return None
        frame = CONTENT + _keys(list(self._held))
        self._held.clear()
        return frame


class ContentStore:
    """A worker connection's contents, as the driver's mirror directs."""

    def __init__(self) -> None:
        self._blobs: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._blobs)

    def take(self, payload: bytearray) -> None:
        """Apply a CONTENT frame: drop what it names, then keep its content (if any)."""
        view = memoryview(payload)
        drops, at = _read_keys(view, len(CONTENT))
        for key in drops:
            self._blobs.pop(key, None)
        if at < len(view):
            self._blobs[int.from_bytes(view[at : at + _KEY], "big")] = bytes(view[at + _KEY :])

    def resolve(self, payload: bytearray) -> tuple[memoryview, dict[int, bytes]]:
        """A BATCH frame's pickled batch and the blobs its keys name. Raises LookupError
        (naming the key) for a key this connection never received or was told to drop."""
        view = memoryview(payload)
        keys, at = _read_keys(view, len(BATCH))
        missing = [k for k in keys if k not in self._blobs]
        if missing:
            raise LookupError(
                f"the batch names contents {missing} that this connection does not hold "
                f"(it holds {sorted(self._blobs)})"
            )
        return view[at:], {k: self._blobs[k] for k in keys}
