"""The worker: runs a Flower ClientApp for a batch of virtual clients in turn.

One worker lives in each worker process (a Ray actor, or the driver itself for
the in-process backend). It loads the ClientApp once per run and then executes
batches: for every message it deserialises the batch's shared content anew
(so clients never see each other's mutations; this is cheaper than copying
Flower's records), builds the client's :class:`flwr.app.Context` from its persistent
state, calls the app, and collects the reply. Models, data and buffers that the
app caches at module level stay alive across clients and rounds, because the
process does. When the instruction opts into a :class:`~fedsim.worker_reduce.Reducer`,
the successful replies of each fold chunk of the batch are folded into one partial reply
(:class:`~fedsim.worker_reduce.ChunkedFold`).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass, field, replace
from typing import Any

from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.app.metadata import Metadata
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, ErrorCode
from flwr.supercore.object_ref import load_app
from flwr.supercore.task_identity import TaskIdentity

from fedsim.engine.client_registry import NODE_ID_OFFSET, Enrolment
from fedsim.randomness import NODE_SECRET_KEY, RootSource, RunSecret
from fedsim.record_codec import content_nbytes, records_of
from fedsim.worker_reduce import (
    FOLDS_KEY,
    ChunkedFold,
    MetricSums,
    Reducer,
    ReductionError,
    is_partial,
)


@dataclass(frozen=True)
class ClientAppSource:
    """Where workers get the ClientApp: an object, or a ``module:attr`` reference.

    A reference is imported in each worker (with ``app_dir`` on ``sys.path``),
    exactly as Flower loads ``[tool.flwr.app.components] clientapp``.
    """

    reference: str | None = None
    app_dir: str | None = None
    app: ClientApp | None = None

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.app is None):
            raise ValueError("give exactly one of a ClientApp object or a 'module:attr' reference")

    def load(self) -> ClientApp:
        if self.app is not None:
            loaded: Any = self.app
        else:
            loaded = load_app(str(self.reference), LoadClientAppError, self.app_dir)
        if not isinstance(loaded, ClientApp):
            raise LoadClientAppError(
                f"clientapp {self.reference or loaded!r} is a {type(loaded).__name__}, "
                "not a flwr.clientapp.ClientApp"
            )
        return loaded


@dataclass(frozen=True)
class SharedDataset:
    """A federated dataset shipped once to every worker (arrays or object refs)."""

    spec: Any
    arrays: dict[str, Any]
    num_classes: int
    name: str


@dataclass(frozen=True)
class RunSpec:
    """What every worker needs to know about a run, sent once per run.

    ``secret`` says where the run's root lies (:class:`fedsim.randomness.RootSource`: a file and
    the public run nonce); each worker opens the file itself and derives each client's own secret
    for its ``node_config``. The spec holds no secret, so the driver that keeps it (to restart a
    worker) holds none either.
    """

    run_id: int
    num_clients: int
    run_config: dict[str, Any]
    app: ClientAppSource
    datasets: tuple[SharedDataset, ...] = ()
    raise_errors: bool = False
    secret: RootSource | None = None

    def node_config(
        self, node_id: int, secrets: RunSecret | None, enrolment: Enrolment | None = None
    ) -> dict[str, Any]:
        """Client ``node_id``'s ``node_config``: its partition, the number of partitions and,
        when the run has a root, its own secret (:data:`~fedsim.randomness.NODE_SECRET_KEY`)
        and its enrolment (the authority's public key and its certificate,
        :meth:`fedsim.engine.client_registry.Enrolment.node_entries`; ``enrolment``: the
        worker's, made once from the root, else made here)."""
        partition = node_id - NODE_ID_OFFSET
        config: dict[str, Any] = {PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: self.num_clients}
        if secrets is not None:
            own = secrets.client(partition)
            config[NODE_SECRET_KEY] = own.token()
            enrolment = enrolment if enrolment is not None else Enrolment(secrets)
            config.update(enrolment.node_entries(partition, own))
        config[FOLDS_KEY] = True  # replies to a confidential reducer never leave unfolded
        return config


@dataclass(frozen=True)
class Content:
    """One instruction content, pickled. ``blob`` is None when the worker already
    holds content ``key`` (see :func:`remember`)."""

    key: int
    blob: bytes | None


#: contents a worker keeps for later batches of the same phase
CONTENT_CACHE = 16


def remember(cache: OrderedDict[int, Any], key: int, value: Any, size: int = CONTENT_CACHE) -> bool:
    """Mark ``key`` as most recently used (adding ``value`` if new, dropping the
    least recently used beyond ``size``); True if it was already there.

    The worker keeps contents with this rule and the backend mirrors it with the
    same calls in the same order, so it knows which contents it can omit."""
    if key in cache:
        cache.move_to_end(key)
        return True
    cache[key] = value
    if len(cache) > size:
        cache.popitem(last=False)
    return False


@dataclass
class ClientBatch:
    """Messages for one worker call. ``contents`` holds each distinct instruction
    content once; message ``i`` uses ``contents[content_index[i]]``. ``states``
    maps node id to its stored state (pickled)."""

    batch_id: int
    metadata: list[Metadata]
    content_index: list[int]
    contents: list[Content]
    states: dict[int, bytes] = field(default_factory=dict)
    reducer: Reducer | None = None
    late: frozenset[int] = frozenset()  # positions whose reply misses the deadline
    crash_after: int | None = None  # injected fault: the worker dies before this position
    lose_reply: bool = False  # injected fault: the worker runs the batch and sends no reply
    server_round: int | None = None  # the FL round of its messages, for errors
    #: messages per fold chunk (fedsim.worker_reduce.fold_chunk_size); None: the whole batch
    fold_chunk: int | None = None
    #: a batch of a phase under a timeout: it carries its contents (over a channel, its large
    #: ones as keys into the connection's, fedsim.engine.channel_contents) and leaves the
    #: worker's content cache as it is (the driver may take it back unstarted,
    #: fedsim.engine.dispatch)
    solo: bool = False

    def sharing_contents(
        self, most: int, min_bytes: int
    ) -> tuple[ClientBatch, list[tuple[int, bytes]]]:
        """This batch without the blobs of its (at most ``most``) contents of ``min_bytes``
        or more, and those (key, blob): a channel sends each once per connection
        (:mod:`fedsim.engine.channel_contents`)."""
        shared = [
            (c.key, c.blob)
            for c in self.contents
            if c.blob is not None and len(c.blob) >= min_bytes
        ][:most]
        if not shared:
            return self, []
        keys = {key for key, _ in shared}
        contents = [Content(c.key, None) if c.key in keys else c for c in self.contents]
        return replace(self, contents=contents), shared

    def with_contents(self, blobs: dict[int, bytes]) -> ClientBatch:
        """This batch with the blobs of its contents named in ``blobs`` put back."""
        contents = [Content(c.key, blobs[c.key]) if c.key in blobs else c for c in self.contents]
        return replace(self, contents=contents)

    def describe(self) -> str:
        """The batch in words, for errors: its id, clients, message type and round."""
        kind = self.metadata[0].message_type if self.metadata else "no messages"
        round_ = "" if self.server_round is None else f", round {self.server_round}"
        return f"batch {self.batch_id} ({len(self.metadata)} clients, {kind}{round_})"


@dataclass
class BatchResult:
    """What a worker returns for a batch."""

    batch_id: int
    replies: list[Message]
    states: dict[int, bytes | None]
    succeeded: int
    failed: int
    late: int
    bytes_up: int
    compute_s: float
    metrics: MetricSums
    worker_pid: int


def _resolve(handle: Any) -> Any:
    """An object-store handle's value (zero-copy for arrays); values pass through."""
    if type(handle).__name__ == "ObjectRef":
        import ray  # noqa: PLC0415  (only workers of the Ray backend hold handles)

        return ray.get(handle)
    return handle


def _unfolded(reply: Message) -> Message:
    """The failed reply that stands for a client whose reply a confidential fold could not
    take: its content stays in the worker."""
    reason = "the worker could not fold this reply for a confidential reducer; it is withheld"
    error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
    return Message(error=error, metadata=copy(reply.metadata))


class InjectedCrash(RuntimeError):
    """A crash injected on purpose (in-process workers raise it instead of exiting)."""


class ClientWorker:
    """Executes batches of client messages with one loaded ClientApp.

    A plain class: the Ray backend wraps it in an actor, the in-process backend
    and the unit tests use it directly. The contents it receives are kept
    (:func:`remember`) for later batches that send only their key.
    """

    def __init__(
        self, torch_threads: int | None = None, exit_on_crash: bool = True, keep_root: bool = True
    ) -> None:
        self._torch_threads = torch_threads
        # a worker in its own process keeps the run's root; one in the driver's process opens
        # the root file for each client and keeps nothing (fedsim.engine.backend.LocalBackend)
        self._keep_root = keep_root
        self._exit_on_crash = exit_on_crash
        self._run: RunSpec | None = None
        self._secrets: RunSecret | None = None
        self._enrolment: Enrolment | None = None
        self._app: ClientApp | None = None
        self._content_cache: OrderedDict[int, bytes] = OrderedDict()
        if torch_threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))

    def ping(self) -> int:
        """The worker's process id (used to wait until workers are up)."""
        return os.getpid()

    def placement(self) -> tuple[str, list[int]]:
        """Which machine this worker runs on (hostname) and the cores it may use."""
        import socket  # noqa: PLC0415

        return socket.gethostname(), sorted(os.sched_getaffinity(0))

    def peak_rss_mb(self) -> float:
        """The most resident memory this worker's process has used, in MiB."""
        from fedsim.engine.metrics import peak_rss_mb  # noqa: PLC0415

        return peak_rss_mb()

    def ray_node(self) -> str:
        """The id of the Ray node this worker runs on."""
        import ray  # noqa: PLC0415

        return ray.get_runtime_context().get_node_id()

    def pin(self, cores: list[int]) -> list[int]:
        """Keep this worker's process on ``cores`` (no migrations, warm caches)."""
        os.sched_setaffinity(0, set(cores))
        return sorted(os.sched_getaffinity(0))

    def open_channel(
        self, key: bytes, host: str | None = None, heartbeat_s: float | None = None
    ) -> tuple[str, int]:
        """Also serve batches on a socket (:mod:`fedsim.engine.channel`) at
        ``host`` (default: this Ray node's address) to a driver that proves it
        holds ``key`` (and to which this worker proves the same), with a heartbeat every
        ``heartbeat_s`` seconds while a batch runs; returns the address."""
        from fedsim.engine.channel import HEARTBEAT_S, WorkerChannel  # noqa: PLC0415

        if host is None:
            import ray  # noqa: PLC0415

            host = ray.util.get_node_ip_address()
        beat = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self._channel = WorkerChannel(self, host, key, heartbeat_s=beat)
        return self._channel.address

    def warm_up(self, modules: tuple[str, ...] = ("torch", "torch._dynamo")) -> int:
        """Import heavy modules ahead of the first batch; set torch's thread count.

        The backend calls it as the worker starts, while the driver sets up its run, so the
        imports leave the first round: torch, and ``torch._dynamo``, which torch imports the
        first time any process builds an optimiser (about as long as torch itself)."""
        import importlib  # noqa: PLC0415

        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
        self._set_torch_threads()
        return os.getpid()

    def _set_torch_threads(self) -> None:
        if self._torch_threads:
            import sys  # noqa: PLC0415

            torch = sys.modules.get("torch")
            if torch is not None and torch.get_num_threads() != self._torch_threads:
                torch.set_num_threads(self._torch_threads)

    def start_run(self, run: RunSpec) -> int:
        """Load the run's ClientApp and datasets; must precede :meth:`run_batch`."""
        if run.datasets:
            from fedsim.data import FederatedDataset, register_dataset  # noqa: PLC0415

            for shared in run.datasets:
                arrays = {k: _resolve(v) for k, v in shared.arrays.items()}
                register_dataset(
                    shared.spec,
                    FederatedDataset.from_arrays(arrays, shared.num_classes, shared.name),
                )
        self._app = run.app.load()
        self._run = run
        self._secrets = None
        self._enrolment = None
        if run.secret is not None:
            opened = run.secret.open()  # an unreadable root fails the run here, not per client
            self._secrets = opened if self._keep_root else None
            # the registry's authority, from the root: it certifies each client this worker runs
            self._enrolment = Enrolment(opened)
        self._content_cache.clear()
        TaskIdentity.run_id = run.run_id
        TaskIdentity.task_id = run.run_id
        self._set_torch_threads()
        return os.getpid()

    def _root(self) -> RunSecret | None:
        """The run's root: kept, or (``keep_root=False``) opened again for this one client."""
        if self._secrets is not None or self._run is None or self._run.secret is None:
            return self._secrets
        return self._run.secret.open()

    def server_secret_token(self, source: RootSource) -> str:
        """The server's own secret under ``source`` (hex): the one secret the driver gets,
        derived here so that the driver never reads the root."""
        return source.open().server().token()

    def create_root(self, directory: str | None = None) -> RootSource:
        """A fresh root written by this worker (:meth:`RootSource.fresh`): the driver gets
        only where it lies."""
        return RootSource.fresh(directory)

    def _content(self, content: Content) -> bytes:
        """A batch's pickled content: sent with it, or kept from an earlier batch."""
        if not remember(self._content_cache, content.key, content.blob) and content.blob is None:
            raise RuntimeError(f"content {content.key} was neither sent nor kept")
        return self._content_cache[content.key]

    def _run_client(
        self, message: Message, stored: bytes | None
    ) -> tuple[Message, Context, float]:
        """One client's reply to ``message`` (its failure as an Error reply, as in Flower), its
        context after the call (``stored``: its pickled state, if any) and the call's seconds."""
        run, app = self._run, self._app
        node_id = message.metadata.dst_node_id
        context = Context(
            run_id=run.run_id,
            node_id=node_id,
            node_config=run.node_config(node_id, self._root(), self._enrolment),
            state=pickle.loads(stored) if stored is not None else RecordDict(),
            run_config=run.run_config,
        )
        TaskIdentity.node_id = node_id
        start = time.perf_counter()
        try:
            reply = app(message, context)
            if not isinstance(reply, Message) or is_partial(reply):
                raise TypeError(
                    f"the ClientApp returned a {type(reply).__name__}, not a flwr Message"
                )
        except Exception as ex:  # a client's failure is its reply, as in Flower
            if run.raise_errors:
                raise
            reason = f"{type(ex).__name__}: {ex}\n{traceback.format_exc(limit=8)}"
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )
        return reply, context, time.perf_counter() - start

    def run_batch(self, batch: ClientBatch) -> BatchResult:
        """Run every message of ``batch`` through the ClientApp, in order."""
        if self._run is None or self._app is None:
            raise RuntimeError("start_run must be called before run_batch")
        blobs = [
            c.blob if batch.solo and c.blob is not None else self._content(c)
            for c in batch.contents
        ]
        replies: list[Message] = []
        failures: list[Message] = []
        states: dict[int, bytes | None] = {}
        metrics = MetricSums()
        accumulator = None
        if batch.reducer is not None:
            instruction = pickle.loads(blobs[batch.content_index[0]])
            accumulator = ChunkedFold(batch.reducer, instruction, batch.fold_chunk)
        bytes_up, compute, late = 0, 0.0, 0
        for position, (metadata, index) in enumerate(
            zip(batch.metadata, batch.content_index, strict=True)
        ):
            if position == batch.crash_after:
                if self._exit_on_crash:
                    os._exit(70)  # an injected worker crash: the process dies here
                raise InjectedCrash(f"worker crash injected before client {position} of the batch")
            node_id = metadata.dst_node_id
            message = Message(content=pickle.loads(blobs[index]), metadata=metadata)
            reply, context, seconds = self._run_client(message, batch.states.get(node_id))
            compute += seconds
            if reply.has_error():
                failures.append(reply)  # as in Flower, a failed client's state is not kept
                continue
            _keep_state(states, batch, node_id, context)
            if position in batch.late:
                late += 1  # it ran, but its reply misses the deadline
                continue
            bytes_up += content_nbytes(reply.content)
            for _, record in records_of(reply.content, MetricRecord):
                metrics.add(record)
            replies.append(reply)
            if accumulator is not None:
                try:
                    accumulator.add(position, reply)
                except ReductionError:
                    accumulator = None  # the strategy gets raw replies and reports the problem
        replies, succeeded, bytes_up = _folded(
            batch, accumulator, replies, failures, states, (len(replies), bytes_up)
        )
        return BatchResult(
            batch_id=batch.batch_id,
            replies=replies + failures,
            states=states,
            succeeded=succeeded,
            failed=len(failures),
            late=late,
            bytes_up=bytes_up,
            compute_s=compute,
            metrics=metrics,
            worker_pid=os.getpid(),
        )


def _keep_state(
    states: dict[int, bytes | None], batch: ClientBatch, node_id: int, context: Context
) -> None:
    """File client ``node_id``'s state after its call (None: it cleared the one it had)."""
    if context.state:
        states[node_id] = pickle.dumps(context.state, protocol=pickle.HIGHEST_PROTOCOL)
    elif node_id in batch.states:
        states[node_id] = None  # the client cleared its state


def _folded(
    batch: ClientBatch,
    accumulator: ChunkedFold | None,
    replies: list[Message],
    failures: list[Message],
    states: dict[int, bytes | None],
    counts: tuple[int, int],
) -> tuple[list[Message], int, int]:
    """The batch's replies after the worker's fold (``accumulator``; None: none, or it
    failed), with the ``counts`` (succeeded, bytes up) they leave with. A confidential
    reducer fails closed: unfolded replies become failures (into ``failures``) and their
    clients' states are dropped from ``states``."""
    succeeded, bytes_up = counts
    if accumulator is not None and replies:
        try:
            replies = accumulator.results()
        except ReductionError:
            accumulator = None
    if batch.reducer is not None and batch.reducer.confidential and replies:
        if accumulator is None:  # fail closed: nothing unfolded leaves the worker
            failures += [_unfolded(reply) for reply in replies]
            for reply in replies:  # as for any failed client, its state is not kept
                states.pop(int(reply.metadata.src_node_id), None)
            succeeded, replies = 0, []
        bytes_up = sum(content_nbytes(reply.content) for reply in replies)
    return replies, succeeded, bytes_up
