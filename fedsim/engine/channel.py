"""A direct socket between the driver and each worker actor, for client batches.

Ray starts, places, pins, restarts and supervises the worker actors; the
batches themselves travel over one TCP connection per worker. A Ray actor call
costs about 1.3 ms of round trip here (task submission, scheduling, result
object), a message on an open socket about 0.2 ms; a round runs about a dozen
batches per worker, and its start and end wait on those round trips.

The worker side (:class:`WorkerChannel`) listens on its node's address and
runs each batch received on an authenticated connection on the actor's
:class:`~fedsim.engine.worker.ClientWorker`, in order. The driver side
(:class:`DriverChannel`) sends pickled batches and reads the pickled
``(ok, value)`` replies in the same order. A closed connection, or a frame that
fails its check, means the worker is gone: every batch still pending on it is
reported lost.

Liveness. Neither side ever waits on the other without a deadline, and neither
stops reading while it writes. The worker reads every frame as it arrives (a
reader thread queues the batches; one runner answers them in order): a worker
that only read between batches stalled the driver for good once a batch and a
reply both outgrew the two socket buffers (the driver blocked sending batch
``k + 1`` to a worker that was running batch ``k``, the worker then blocked
sending reply ``k`` to a driver that was not reading; seen at C = 1000,
d = 10^5, where each client's sealed state is about 0.5 MB). While a batch
runs, the worker sends an empty frame (a heartbeat) every
:func:`heartbeat_interval` seconds; each reply starts with the number of the
batch it answers. The driver declares a batch's reply lost
(:class:`ReplyLost`, naming the worker and the batch) when the worker sends
nothing for ``reply_timeout`` seconds while batches are pending on it, when a
reply comes for a later batch first, or when a frame stops halfway or a batch
cannot be sent within ``reply_timeout`` (the socket's own timeout).

Release. The driver may ask for a batch back that the worker has not started (a frame
``RELEASE || index``): the worker's reader takes it out of the queue, if the runner has not
taken it yet, and answers ``index || RELEASED`` at once, ahead of the batch it is running;
a batch already started is not answered (its reply comes as usual). The driver then runs the
batch elsewhere (:class:`BatchReleased`): a client under a timeout never waits behind a
slow one (:mod:`fedsim.engine.dispatch`).

Contents. A batch's large instruction contents (a phase's model) cross each connection
once, in frames of their own ahead of the first batch that names them; the worker's reader
files them and gives each batch its contents on arrival, as the driver's mirror records
(:mod:`fedsim.engine.channel_contents`), so a batch released or queued keeps them.

Security: the handshake and the authenticated frames are
:mod:`fedsim.engine.channel_frames`.
"""


from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Protocol

from fedsim.engine.channel_contents import BATCH, CONTENT, ContentMirror, ContentStore
from fedsim.engine.channel_frames import (
    HANDSHAKE_TIMEOUT_S,
    MAX_HANDSHAKES,
    FramedSocket,
    FrameError,
    driver_handshake,
    dumps,
    worker_handshake,
)

log = logging.getLogger(__name__)


#: seconds a worker may stay silent with a batch pending before its reply is declared lost
#: (the default of ``engine.reply_timeout_s``)
REPLY_TIMEOUT_S = 300.0
#: the most seconds between two heartbeats of a worker running a batch
HEARTBEAT_S = 5.0
_INDEX = 8  # a reply's first bytes: the number of the batch it answers, big-endian
#: a driver's frame asking for batch ``index`` back (followed by the index, big-endian); a
#: batch is a pickle, which never starts with this byte
RELEASE = b"R"
#: a worker's answer to a release: the batch was not started and will not be
RELEASED = b"R"


class BatchRunner(Protocol):
    """What a worker channel serves: a :class:`~fedsim.engine.worker.ClientWorker`. A batch
    sent with shared contents (:mod:`fedsim.engine.channel_contents`) has a
    ``with_contents(blobs)`` that puts them back."""

    def run_batch(self, batch: Any) -> Any: ...


def heartbeat_interval(reply_timeout: float) -> float:
    """Seconds between a busy worker's heartbeats: four fit in ``reply_timeout``, at most
    :data:`HEARTBEAT_S`."""
    return min(HEARTBEAT_S, reply_timeout / 4)


class WorkerChannel:
    """Serves batches sent by the driver on ``worker``.

    The accept loop only accepts: each connection's handshake runs in its own
    thread under ``handshake_timeout`` (at most :data:`MAX_HANDSHAKES` at once),
    and authenticated connections are served one at a time.
    """

    def __init__(
        self,
        worker: BatchRunner,
        host: str,
        key: bytes,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        if len(key) < 16:
            raise ValueError(f"a channel key of {len(key)} bytes; it must have at least 16")
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s={heartbeat_s!r}; it must be a number of seconds > 0")
        self._worker = worker
        self._key = key
        self._timeout = handshake_timeout
        self._heartbeat = heartbeat_s
        self._serving = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        threading.Thread(target=self._accept, name="fedsim-channel", daemon=True).start()

    def close(self) -> None:
        """Stop accepting connections."""
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return  # the channel was closed
            if not self._handshakes.acquire(blocking=False):
                log.warning("channel: %d handshakes pending; dropping %s", MAX_HANDSHAKES, peer)
                sock.close()
                continue
            threading.Thread(
                target=self._session, args=(sock, peer), name="fedsim-channel-session", daemon=True
            ).start()

    def _session(self, sock: socket.socket, peer: Any) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = worker_handshake(sock, self._key, self._timeout)
        except OSError as err:  # ChannelAuthError and timeouts are OSErrors
            log.warning("channel: refused %s: %s", peer, err or type(err).__name__)
            sock.close()
            return
        finally:
            self._handshakes.release()
        with self._serving:
            self._serve(conn, peer)

    def _serve(self, conn: FramedSocket, peer: Any) -> None:
        """Answer the batches in order while a reader thread keeps taking the driver's
        frames off the socket (so the driver never blocks sending to a worker that is
        busy running or answering, and a release is answered while a batch runs)."""
        inbox = _Inbox()
        threading.Thread(
            target=self._read,
            args=(conn, peer, inbox, ContentStore()),
            name="fedsim-channel-reader",
            daemon=True,
        ).start()
        try:
            while (entry := inbox.get()) is not None:
                index, payload, contents = entry
                reply = self._answer(conn, payload, contents)
                if reply is not None:
                    conn.send(reply, prefix=index.to_bytes(_INDEX, "big"))
        except OSError:
            return  # the driver went away; wait for the next one
        finally:
            conn.close()

    @staticmethod
    def _read(conn: FramedSocket, peer: Any, inbox: _Inbox, store: ContentStore) -> None:
        try:
            index = 0
            while True:
                payload = conn.recv()
                kind = payload[:1]
                if kind == RELEASE and len(payload) == 1 + _INDEX:
                    wanted = int.from_bytes(payload[1:], "big")
                    if inbox.take(wanted):  # not started: it never will be here
                        conn.send(RELEASED, prefix=wanted.to_bytes(_INDEX, "big"))
                    continue
                if kind == CONTENT:
                    store.take(payload)
                    continue
                contents: dict[int, bytes] | LookupError = {}
                if kind == BATCH:  # its contents resolved on arrival, as the driver mirrors
                    try:
                        payload, contents = store.resolve(payload)
                    except LookupError as err:
                        contents = err
                inbox.put((index, payload, contents))
                index += 1
        except FrameError as err:
            log.warning("channel: dropping the connection from %s: %s", peer, err)
        except (EOFError, OSError):
            pass  # the driver went away (or the runner closed the connection)
        finally:
            inbox.put(None)

    def _answer(
        self,
        conn: FramedSocket,
        payload: bytearray | memoryview,
        contents: dict[int, bytes] | LookupError,
    ) -> bytes | None:
        """The pickled reply to one batch (``contents``: the shared contents it names, or why
        they are missing), heartbeats sent while it runs; None for a batch whose reply is to
        be lost (an injected fault, ``lose_reply``)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self._heartbeat):
                try:
                    conn.send(b"")
                except OSError:
                    return

        beating = threading.Thread(target=beat, name="fedsim-channel-heartbeat", daemon=True)
        beating.start()
        try:
            try:  # the payload verified: it is the driver's own batch
                if isinstance(contents, LookupError):
                    raise contents
                batch = pickle.loads(payload)
                if contents:
                    batch = batch.with_contents(contents)
                if getattr(batch, "lose_reply", False):
                    self._worker.run_batch(batch)
                    return None
                return dumps((True, self._worker.run_batch(batch)))
            except Exception as ex:  # the driver re-raises it
                try:
                    return dumps((False, ex))
                except Exception:  # an exception that cannot be pickled
                    return dumps((False, RuntimeError(f"{type(ex).__name__}: {ex}")))
        finally:
            stop.set()
            beating.join()


#: a received batch: its number on the connection, its pickle, its shared contents
_Entry = tuple[int, bytearray | memoryview, dict[int, bytes] | LookupError]


class _Inbox:
    """A worker's queue of received batches (:data:`_Entry`): the runner takes them in
    order; the reader may take back one the runner has not taken (a release)."""

    def __init__(self) -> None:
        self._items: deque[_Entry | None] = deque()
        self._ready = threading.Condition()

    def put(self, item: _Entry | None) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def get(self) -> _Entry | None:
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    def take(self, index: int) -> bool:
        """Remove batch ``index`` if it is still queued; True if it was."""
        with self._ready:
            for item in self._items:
                if item is not None and item[0] == index:
                    self._items.remove(item)
                    return True
            return False


class BatchReleased(RuntimeError):
    """The worker handed a batch back unstarted, as the driver asked: run it elsewhere."""


class ChannelLost(ConnectionError):
    """The connection to a worker closed (or failed a check) with batches pending."""


class ReplyLost(ChannelLost, TimeoutError):
    """A batch's reply did not come: the worker sent nothing for the reply timeout with
    batches pending, stopped halfway through a frame, stopped reading, or answered a later
    batch first. The message names the worker and the batch."""


@dataclass(eq=False)
class ChannelFuture:
    """A batch in flight on a channel; ``payload`` (verified) is set when its reply arrives.

    ``index``: the batch's number on its connection; ``what``: the batch, in words."""

    worker: int
    index: int = 0
    what: str = "a batch"
    payload: memoryview | None = None
    lost: BaseException | None = None
    released: bool = False  # handed back unstarted (:meth:`DriverChannel.release`)
    release_asked: bool = False

    @property
    def done(self) -> bool:
        return self.payload is not None or self.lost is not None or self.released

    def value(self) -> Any:
        if self.lost is not None:
            raise self.lost
        if self.released:
            raise BatchReleased(f"worker {self.worker} handed {self.what} back unstarted")
        assert self.payload is not None, "the batch is still pending"
        ok, value = pickle.loads(self.payload)
        if not ok:
            raise value
        return value


class DriverChannel:
    """The driver's end of one worker's channel.

    Raises :class:`ChannelAuthError` (an OSError) when the peer at ``address``
    does not prove the key, and a TimeoutError when it does not answer within
    ``timeout`` seconds. ``reply_timeout``: seconds the worker may stay silent with
    batches pending (it sends heartbeats while it runs one) before they are lost
    (:class:`ReplyLost`); also the most one send or one read of a frame may block.
    """

    def __init__(
        self,
        worker: int,
        address: tuple[str, int],
        key: bytes,
        timeout: float = HANDSHAKE_TIMEOUT_S,
        reply_timeout: float = REPLY_TIMEOUT_S,
    ) -> None:
        if not reply_timeout > 0:
            raise ValueError(f"reply_timeout={reply_timeout!r}; it must be seconds > 0")
        sock = socket.create_connection(address, timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = driver_handshake(sock, key, timeout)
            sock.settimeout(reply_timeout)
        except BaseException:
            sock.close()
            raise
        self.worker = worker
        self.reply_timeout = reply_timeout
        self.pending: deque[ChannelFuture] = deque()
        self.heard = time.monotonic()  # the last sign of the worker (or the first batch sent)
        self._next = 0
        self._contents = ContentMirror()

    def forget_contents(self) -> None:
        """Have the worker drop every shared content (a new run numbers its contents
        afresh); a connection already gone is left as it is."""
        frame = self._contents.forget()
        if frame is not None and not self.conn.closed:
            try:
                self.conn.send(frame)
            except OSError as err:
                self.fail(ChannelLost(f"worker {self.worker}: {err}"))

    def send(
        self, batch: Any, what: str = "a batch", contents: Sequence[tuple[int, bytes]] = ()
    ) -> ChannelFuture:
        """Send ``batch`` (``what``: the batch, in words, for errors), and before it each of
        its shared ``contents`` (key, pickled blob) the worker does not hold yet
        (:mod:`fedsim.engine.channel_contents`); a lost future if the connection is gone or
        the worker does not take the batch in time."""
        future = ChannelFuture(self.worker, self._next, what)
        if self.conn.closed:
            future.lost = ChannelLost(f"worker {self.worker}: the connection is closed")
            return future
        payload = dumps(batch)  # first: a batch that cannot be pickled leaves the mirror be
        shared, prefix = self._contents.frames(contents) if contents else ([], b"")
        if not self.pending:
            self.heard = time.monotonic()  # the silence clock starts with a pending batch
        try:
            for frame in shared:
                self.conn.send(frame)
            self.conn.send(payload, prefix=prefix)
        except TimeoutError:
            future.lost = ReplyLost(
                f"worker {self.worker}: {what} could not be sent within {self.reply_timeout:g} s "
                "(the worker stopped reading)"
            )
            self.fail(future.lost)
            return future
        except OSError as err:
            future.lost = ChannelLost(f"worker {self.worker}: {err}")
            self.fail(future.lost)
            return future
        self._next += 1
        self.pending.append(future)
        return future

    def receive(self) -> None:
        """Read one frame (the connection is readable): a heartbeat, or the reply to the
        oldest pending batch; on a closed connection, a frame that fails its check or
        stops halfway, mark every pending batch lost."""
        try:
            payload = self.conn.recv()
        except FrameError as err:
            self.fail(ChannelLost(f"worker {self.worker}: reply refused: {err}"))
            return
        except TimeoutError:
            what = self.pending[0].what if self.pending else "no batch"
            self.fail(
                ReplyLost(
                    f"worker {self.worker}: a frame stopped halfway for {self.reply_timeout:g} s "
                    f"with {what} pending"
                )
            )
            return
        except (EOFError, OSError) as err:
            self.fail(ChannelLost(f"worker {self.worker}: connection closed ({err or 'EOF'})"))
            return
        self.heard = time.monotonic()
        if not payload:
            return  # a heartbeat: the worker is running a batch
        index = int.from_bytes(payload[:_INDEX], "big")
        if len(payload) == _INDEX + len(RELEASED) and payload[_INDEX:] == RELEASED:
            asked = next((f for f in self.pending if f.index == index and f.release_asked), None)
            if asked is None:
                self.fail(ChannelLost(f"worker {self.worker}: a release nobody asked for"))
                return
            self.pending.remove(asked)
            asked.released = True
            return
        while self.pending and self.pending[0].index < index and len(payload) > _INDEX:
            skipped = self.pending.popleft()
            skipped.lost = ReplyLost(
                f"worker {self.worker} sent no reply to {skipped.what}: it answered a later "
                "batch first"
            )
        if len(payload) <= _INDEX or not self.pending or self.pending[0].index != index:
            # a reply nobody asked for: the stream is out of step
            self.fail(ChannelLost(f"worker {self.worker}: a reply with no batch pending"))
            return
        self.pending.popleft().payload = memoryview(payload)[_INDEX:]

    def release(self, future: ChannelFuture) -> bool:
        """Ask the worker for ``future``'s batch back if it has not started it (the future
        then resolves released, else with its reply as usual); False if it cannot be asked
        (done, asked before, the first pending batch, or the connection is gone)."""
        if (
            future.done
            or future.release_asked
            or self.conn.closed
            or not self.pending
            or self.pending[0] is future
            or future not in self.pending
        ):
            return False
        future.release_asked = True
        try:
            self.conn.send(RELEASE + future.index.to_bytes(_INDEX, "big"))
        except OSError as err:
            self.fail(ChannelLost(f"worker {self.worker}: {err}"))
        return True

    def expire(self, now: float) -> bool:
        """Mark every pending batch lost if the worker has been silent for longer than the
        reply timeout; True if it was."""
        silent = now - self.heard
        if not self.pending or self.conn.closed or silent <= self.reply_timeout:
            return False
        self.fail(
            ReplyLost(
                f"worker {self.worker}: no reply to {self.pending[0].what} and no heartbeat for "
                f"{silent:.1f} s (reply timeout {self.reply_timeout:g} s): the reply was lost or "
                "the worker is stuck"
            )
        )
        return True

    def fail(self, error: BaseException) -> None:
        while self.pending:
            self.pending.popleft().lost = error
        self.close()

    def close(self) -> None:
        self.conn.close()


def wait_any(channels: list[DriverChannel], timeout: float | None) -> None:
    """Receive every frame that is ready, waiting up to ``timeout`` for the first, and
    never past the first channel's reply deadline: then the silent channels' batches
    are marked lost (:meth:`DriverChannel.expire`)."""
    busy = [c for c in channels if c.pending and not c.conn.closed]
    if not busy:
        return
    by_conn = {c.conn: c for c in busy}
    due = min(c.heard + c.reply_timeout for c in busy) - time.monotonic()
    step = max(0.0, due if timeout is None else min(timeout, due))
    ready = wait(list(by_conn), step)
    for conn in ready:
        by_conn[conn].receive()
    now = time.monotonic()
    for channel in busy:
        if channel.conn not in ready:
            channel.expire(now)
