"""A direct socket between the driver and each worker actor, for client batches.

Ray starts, places, pins, restarts and supervises the worker actors; the
batches themselves travel over one TCP connection per worker. A Ray actor call
costs about 1.3 ms of round trip here (task submission, scheduling, result
object), a message on an open socket about 0.2 ms; a round runs about a dozen
batches per worker, and its start and end wait on those round trips.

The worker side (:class:`WorkerChannel`) listens on its node's address and
serves one connection in a thread of the actor, running each received batch on
the actor's :class:`~fedsim.engine.worker.ClientWorker` in order. The driver
side (:class:`DriverChannel`) sends pickled batches and reads the pickled
``(ok, value)`` replies in the same order. A closed connection means the worker
is gone: every batch still pending on it is reported lost.

Only the driver that created a worker can use its channel: the driver makes a
random key (from the OS) per worker and hands it over through Ray, and each
connection must pass the HMAC challenge of :mod:`multiprocessing.connection`
with that key before the worker reads anything from it.
"""

from __future__ import annotations

import pickle
import secrets
import socket
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from fedsim.engine.worker import ClientWorker


def dumps(value: Any) -> bytes:
    """Pickle ``value``; cloudpickle for what plain pickle cannot (local classes)."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # noqa: PLC0415  (ships with Ray)

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def new_key() -> bytes:
    """A channel key, from the operating system's randomness."""
    return secrets.token_bytes(32)


class WorkerChannel:
    """Serves batches sent by the driver on ``worker``, one connection at a time."""

    def __init__(self, worker: ClientWorker, host: str, key: bytes) -> None:
        self._worker = worker
        self._key = key
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        threading.Thread(target=self._serve, name="fedsim-channel", daemon=True).start()

    def _serve(self) -> None:
        while True:
            sock, _ = self._server.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, self._key)
            except (AuthenticationError, EOFError, OSError):
                conn.close()
                continue
            while True:
                try:
                    batch = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    break  # the driver went away; wait for the next one
                try:
                    reply = dumps((True, self._worker.run_batch(batch)))
                except Exception as ex:  # the driver re-raises it
                    try:
                        reply = dumps((False, ex))
                    except Exception:  # an exception that cannot be pickled
                        reply = dumps((False, RuntimeError(f"{type(ex).__name__}: {ex}")))
                conn.send_bytes(reply)


class ChannelLost(ConnectionError):
    """The connection to a worker closed with batches pending."""


@dataclass(eq=False)
class ChannelFuture:
    """A batch in flight on a channel; ``payload`` is set when its reply arrives."""

    worker: int
    payload: bytes | None = None
    lost: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.payload is not None or self.lost is not None

    def value(self) -> Any:
        if self.lost is not None:
            raise self.lost
        ok, value = pickle.loads(self.payload or b"")
        if not ok:
            raise value
        return value


class DriverChannel:
    """The driver's end of one worker's channel."""

    def __init__(
        self, worker: int, address: tuple[str, int], key: bytes, timeout: float = 10.0
    ) -> None:
        sock = socket.create_connection(address, timeout=timeout)
        sock.settimeout(None)  # blocking again, as Connection expects
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.worker = worker
        self.conn = Connection(sock.detach())
        answer_challenge(self.conn, key)
        self.pending: deque[ChannelFuture] = deque()

    def send(self, batch: Any) -> ChannelFuture:
        future = ChannelFuture(self.worker)
        try:
            self.conn.send_bytes(dumps(batch))
        except OSError as err:
            future.lost = ChannelLost(f"worker {self.worker}: {err}")
            return future
        self.pending.append(future)
        return future

    def receive(self) -> None:
        """Read one reply (the connection is readable); on a closed connection,
        mark every pending batch lost."""
        try:
            payload = self.conn.recv_bytes()
        except (EOFError, OSError) as err:
            self.fail(ChannelLost(f"worker {self.worker}: connection closed ({err or 'EOF'})"))
            return
        if self.pending:
            self.pending.popleft().payload = payload

    def fail(self, error: BaseException) -> None:
        while self.pending:
            self.pending.popleft().lost = error
        self.close()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def wait_any(channels: list[DriverChannel], timeout: float | None) -> None:
    """Receive every reply that is ready, waiting up to ``timeout`` for the first."""
    busy = [c for c in channels if c.pending and not c.conn.closed]
    if not busy:
        return
    by_conn = {c.conn: c for c in busy}
    for conn in wait(list(by_conn), timeout):
        by_conn[conn].receive()
