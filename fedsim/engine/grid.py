"""fedsim's implementation of Flower's ``Grid`` on a pool of workers.

A Flower strategy (or any ServerApp ``main``) talks to clients only through a
:class:`flwr.serverapp.Grid`: it asks for node ids, pushes messages and pulls
replies. :class:`SimulationGrid` answers those calls by running the ClientApp
for the addressed virtual clients on the backend's workers:

* ``push_messages`` sorts the messages by node id, puts each distinct content
  into the backend's object store once, cuts the messages into batches
  (:func:`~fedsim.engine.dispatch.batch_sizes`) and hands them to the
  dispatcher, which keeps every worker busy;
* ``pull_messages`` returns the replies of finished batches;
* ``send_and_receive`` pushes, waits until every batch is done (or ``timeout``
  seconds have passed: batches still running then are dropped, as Flower drops
  late replies) and returns the replies ordered by node id, so a run's result
  does not depend on which worker finished first.

A timeout means what it means in Flower's simulation (``InMemoryGrid.send_and_receive``
over an actor pool fed from one queue): each message is one client's work, a client starts
when a worker is free, and every reply that arrives within ``timeout`` seconds of the call is
returned, whatever the other clients do. Under a timeout the grid sends each client as a
batch of its own, a *solo* batch, which never waits behind a slow client: the dispatcher
takes it back unstarted and gives it to a free worker
(:class:`~fedsim.engine.dispatch.Dispatcher`). Where workers fold the replies (a reducer),
the unit is one fold chunk (:func:`~fedsim.worker_reduce.fold_chunk_size`: one client while
the cohort has at most :data:`~fedsim.worker_reduce.FOLD_CHUNKS` clients), so in larger
cohorts a slow client's chunk-mates miss the timeout with it. A late reply becomes what it
becomes in Flower: the ServerApp never gets it (it is not among the replies returned); the
client ran, and its state is kept, as Flower's context store keeps it; the phase counts it
``timed_out``, and one warning line says how many replies arrived within the timeout. The
replies, their order and their folds do not depend on the batches, so a timeout that does
not fire changes no bit of a run.

When the instructions carry a reducer (:mod:`fedsim.worker_reduce`) whose fold is not
exact (floating point), the messages of one content are cut into fixed fold chunks
(:func:`~fedsim.worker_reduce.fold_chunk_size`, a function of their number alone), batches
hold whole chunks, each batch returns one partial reply per chunk in place of its clients'
replies, and the grid folds the partials in chunk order into one reply
(``reply_to_message_id``: that of the first chunk's first replying message). The
floating-point operations of the fold are then the same whatever the number of workers or
the backend: a run gives the same bits on each. An exact fold
(:attr:`~fedsim.worker_reduce.Reducer.exact`: integer or field sums) folds whole batches.

The messages the grid runs are those Flower's ClientApps execute
(:func:`runnable_message_type`): ``train``, ``evaluate`` and ``query``, each optionally
followed by ``.<action>``, and the legacy ``get_parameters`` and ``get_properties`` of
``flwr.server.compat`` and ``DefaultWorkflow``. Flower's ``system`` messages (its runtime's
own) and the deprecated ``reconnect`` reach no ClientApp handler: a push holding one is
refused whole with :class:`UnsupportedMessage`, which names it, before any client runs. A
reply is Flower's: ``src_node_id`` the node, ``reply_to_message_id`` the instruction's id, a
client's failure an error reply; every content-carrying reply, whatever its type, passes the
release boundary. The grid may be called from several threads (``start_grid`` sends one
message per node from a thread pool, ``DefaultWorkflow`` polls ``get_node_ids`` from its
own): a lock orders the calls, and a waiting ``send_and_receive`` lets the others push.

Each push is one *phase*. A :class:`~fedsim.engine.participation.CohortModel`
model decides which node ids ``get_node_ids`` reports in each phase; every
finished phase is reported to an observer as a :class:`PhaseReport`.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import uuid4

from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.app.metadata import validate_message_type
from flwr.common.constant import ErrorCode, MessageTypeLegacy
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedsim.engine.backend import Backend
from fedsim.engine.boundary import ReleaseBoundary
from fedsim.engine.client_registry import ClientRegistry
from fedsim.engine.dispatch import Dispatcher, batch_sizes
from fedsim.engine.faults import FaultConfig, client_faults, crash_point
from fedsim.engine.participation import CohortModel
from fedsim.engine.state import ClientStateStore
from fedsim.engine.worker import BatchResult, ClientBatch, Content
from fedsim.record_codec import content_nbytes, records_of
from fedsim.worker_reduce import (
    Accumulator,
    MetricSums,
    Reducer,
    ReductionError,
    fold_chunk_size,
    reducer_of,
)

log = logging.getLogger(__name__)

#: the legacy message types a ClientApp built from a ``client_fn`` executes
LEGACY_MESSAGE_TYPES = (MessageTypeLegacy.GET_PARAMETERS, MessageTypeLegacy.GET_PROPERTIES)
#: the categories of Flower's Message API a ClientApp executes (each optionally ``.<action>``)
MESSAGE_CATEGORIES = ("train", "evaluate", "query")
#: seconds a waiting ``send_and_receive`` holds the grid's lock at most before others may push
_WAIT_SLICE_S = 0.05


class UnsupportedMessage(ValueError):
    """A ServerApp pushed a message type that no ClientApp executes (``system``, ``reconnect``,
    or one outside Flower's format); nothing of the push was sent."""


def runnable_message_type(message_type: str) -> bool:
    """Whether a ClientApp executes ``message_type``: ``train``, ``evaluate`` or ``query``,
    optionally followed by ``.<action>`` (a Python identifier), as Flower's
    ``validate_message_type`` has it but without its runtime's own ``system``; or a legacy
    ``get_parameters`` / ``get_properties``."""
    if message_type in LEGACY_MESSAGE_TYPES:
        return True
    category, _, action = message_type.partition(".")
    return (
        category in MESSAGE_CATEGORIES
        and (not action or action.isidentifier())
        and validate_message_type(message_type)
    )


def unsupported(message_type: str, node_id: int) -> UnsupportedMessage:
    """The error for a message of ``message_type`` to ``node_id``."""
    why = {
        "system": "Flower's runtime keeps 'system' messages to itself; no ClientApp handles one",
        "reconnect": "Flower's deprecated 'reconnect' has no ClientApp handler",
    }.get(message_type, "not a type Flower's ClientApps execute")
    return UnsupportedMessage(
        f"message type {message_type!r} (to node {node_id}) cannot run on fedsim's grid: {why}; "
        "allowed: 'train', 'evaluate' or 'query', each optionally followed by '.<action>', "
        f"or the legacy {' or '.join(repr(t) for t in LEGACY_MESSAGE_TYPES)}"
    )


@dataclass(frozen=True)
class PhaseReport:
    """What happened in one phase (one push of messages)."""

    phase: int
    server_round: int | None
    message_type: str
    messages: int
    succeeded: int
    failed: int
    timed_out: int
    dropped: int
    bytes_down: int
    bytes_up: int
    wall_s: float
    compute_s: float
    client_metrics: dict[str, float]
    #: the node ids the phase's messages went to (empty: not given)
    nodes: frozenset[int] = frozenset()
    #: the ``send_and_receive`` timeout the phase ran under (None: none)
    timeout_s: float | None = None


class PhaseObserver(Protocol):
    """Receives a report after each phase."""

    def phase_finished(self, report: PhaseReport) -> None: ...


class RoundLog(Protocol):
    """Where a strategy that runs its own round loop inside a ServerApp (``Strategy.start``)
    reports each round it finished, so the run's records hold what the strategy returned.

    ``open_rounds`` comes first: from then on the strategy closes every round itself
    (``end_round``, with its sections: aggregated metrics, privacy, ...), ``private`` says
    that the clients' own metrics stay out of the records unless ``metrics_in_clear``.
    ``end_run`` gives what the run's summary adds (the final privacy report, why it stopped).
    The values are the strategy's own (MetricRecords, dicts); the log makes them JSON.
    """

    def open_rounds(self, *, private: bool, metrics_in_clear: bool) -> None: ...

    def end_round(self, server_round: int, **sections: Any) -> None: ...

    def end_run(self, **summary: Any) -> None: ...


def server_round_of(content: RecordDict, group_id: str) -> int | None:
    """The FL round a message belongs to: a ConfigRecord's ``server-round`` (as
    Flower's strategies set it), else a numeric ``group_id``."""
    for _, record in records_of(content, ConfigRecord):
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return int(group_id) if group_id.isdigit() else None


class OrderedFold:
    """Folds the partial replies of a content group's batches in batch order.

    Batches finish in any order; folding them in batch order (each batch's chunk partials
    in chunk order) folds the chunk partials in chunk order, which makes the result
    independent of scheduling and of how chunks were spread over batches, so a run is
    reproducible to the bit on any backend. The strategy
    receives one reply for the whole group. If a reducer cannot fold (it raised
    :class:`ReductionError`), the replies are passed on unfolded.
    """

    def __init__(self, reducer: Reducer, instruction: RecordDict) -> None:
        self.accumulator: Accumulator | None = reducer.accumulator(instruction)
        self.order: list[int] = []
        self._next = 0
        self._ready: dict[int, list[Message]] = {}
        self._seen: list[Message] = []

    def add(self, batch_id: int, replies: list[Message]) -> None:
        """The successful replies of one batch (a partial reply, normally)."""
        self._ready[batch_id] = replies
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._fold(self._ready.pop(self.order[self._next]))
            self._next += 1

    def _fold(self, replies: list[Message]) -> None:
        self._seen.extend(replies)
        if self.accumulator is None:
            return
        try:
            for reply in replies:
                self.accumulator.add(reply)
        except ReductionError:
            self.accumulator = None

    def result(self) -> list[Message]:
        """The folded reply (batches that never finished are left out)."""
        for batch_id in self.order[self._next :]:
            if batch_id in self._ready:
                self._fold(self._ready.pop(batch_id))
        self._next = len(self.order)
        if not self._seen:
            return []
        if self.accumulator is None:
            return self._seen
        return [self.accumulator.result()]


@dataclass
class _Phase:
    """Book-keeping for one push of messages."""

    index: int
    round: int  # the round its writes to the state store are filed under
    message_type: str
    server_round: int | None
    message_ids: list[str]
    nodes: frozenset[int]
    started: float
    bytes_down: int
    batch_ids: list[int] = field(default_factory=list)
    results: dict[int, list[Message]] = field(default_factory=dict)
    batch_messages: dict[int, set[str]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    folds: dict[int, OrderedFold] = field(default_factory=dict)
    succeeded: int = 0
    failed: int = 0
    late: int = 0
    dropped: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    metrics: MetricSums = field(default_factory=MetricSums)
    closed: bool = False
    timeout_s: float | None = None


class SimulationGrid(Grid):
    """A :class:`flwr.serverapp.Grid` whose nodes are virtual clients on a backend.

    Args:
        backend: a backend on which ``start_run`` was called for this run.
        registry: the population (node ids and partition ids).
        run: the Flower ``Run`` (its ``run_id`` must match the backend's run).
        participation: which clients ``get_node_ids`` reports per phase; None
            reports the whole population.
        state_store: where clients' ``context.state`` persists.
        observer: receives a :class:`PhaseReport` after each phase.
        round_log: where a strategy running its own loop reports its rounds (None: nowhere).
        faults: dropouts, stragglers and crashes to inject (:mod:`fedsim.engine.faults`).
        depth: batches queued per worker.
    """

    def __init__(
        self,
        backend: Backend,
        registry: ClientRegistry,
        run: Run,
        *,
        participation: CohortModel | None = None,
        state_store: ClientStateStore | None = None,
        observer: PhaseObserver | None = None,
        round_log: RoundLog | None = None,
        faults: FaultConfig | None = None,
        depth: int = 2,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.participation = participation
        self.faults = faults if faults is not None and faults.active else None
        self.state_store = state_store if state_store is not None else ClientStateStore()
        self.observer = observer
        self.round_log = round_log
        self._run = run
        self._dispatcher = Dispatcher(backend, depth=depth)
        self._phase_counter = 0
        self._declared: tuple[int, int] | None = None
        self._cohort: tuple[tuple[int, int], list[int]] | None = None
        self._phases: dict[int, _Phase] = {}
        self._phase_of_message: dict[str, int] = {}
        self._next_batch = 0
        self._next_content = 0
        self._lock = threading.RLock()
        #: every instruction sent and reply delivered, and what consumed each reply
        self.boundary = ReleaseBoundary()
        for sink in (observer, round_log):
            getattr(sink, "attach_boundary", lambda boundary: None)(self.boundary)

    # -- Grid: run and messages -------------------------------------------------
    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run

    @property
    def run(self) -> Run:
        return Run(**vars(self._run))

    @property
    def phase(self) -> int:
        """The index of the next phase (number of pushes so far)."""
        return self._phase_counter

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def begin_phase(self, server_round: int, kind: int) -> None:
        """Declare the next phase (round, and 0 for training or 1 for evaluation),
        so the participation model draws its cohort for that round."""
        self._declared = (server_round, kind)

    def _phase_key(self) -> tuple[int, int]:
        return self._declared if self._declared is not None else (self._phase_counter, 0)

    def get_node_ids(self) -> Iterable[int]:
        if self.participation is None:
            return self.registry.node_ids()
        with self._lock:
            key = self._phase_key()
            if self._cohort is None or self._cohort[0] != key:
                cohort = self.participation.cohort(*key)
                self._cohort = (key, self.registry.node_ids_of(cohort))
            return list(self._cohort[1])

    # -- Grid: push / pull ------------------------------------------------------
    def _check(self, message: Message) -> None:
        meta = message.metadata
        if not message.has_content():
            raise ValueError(f"message to node {meta.dst_node_id} has no content")
        if meta.reply_to_message_id:
            raise ValueError("a reply cannot be pushed as an instruction message")
        if meta.ttl <= 0:
            raise ValueError(
                f"message to node {meta.dst_node_id} has ttl={meta.ttl}; it must be > 0"
            )
        if not runnable_message_type(meta.message_type):
            raise unsupported(meta.message_type, meta.dst_node_id)
        self.registry.partition_id(meta.dst_node_id)  # raises for unknown nodes

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        phase = self._push(messages)
        return [] if phase is None else list(phase.message_ids)

    def _push(self, messages: Iterable[Message], timeout: float | None = None) -> _Phase | None:
        """Start a phase; ``timeout`` (that of ``send_and_receive``): its messages go out as
        solo batches of one client (one fold chunk) each."""
        messages = list(messages)
        for message in messages:
            self._check(message)
        with self._lock:
            return self._push_checked(messages, timeout)

    def _push_checked(self, messages: list[Message], timeout: float | None = None) -> _Phase | None:
        index = self._phase_counter
        phase_round, phase_kind = self._phase_key()
        self._phase_counter += 1
        self._declared = None
        if not messages:
            return None
        messages.sort(key=lambda m: m.metadata.dst_node_id)
        # Each distinct content is serialised and shared once.
        shared: dict[int, tuple[Content, int, Reducer | None]] = {}
        folds: dict[int, OrderedFold] = {}
        bytes_down = 0
        for message in messages:
            content = message.content
            key = id(content)
            if key not in shared:
                blob = pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL)
                reducer = reducer_of(content)
                self._next_content += 1
                handle = Content(self._next_content, blob)
                shared[key] = (handle, content_nbytes(content), reducer)
                if reducer is not None:
                    folds[key] = OrderedFold(reducer, content)
            bytes_down += shared[key][1]
            message.metadata.__dict__["_message_id"] = str(uuid4())
        first = messages[0]
        phase = _Phase(
            index=index,
            round=phase_round,
            message_type=first.metadata.message_type,
            server_round=server_round_of(first.content, first.metadata.group_id),
            message_ids=[m.metadata.message_id for m in messages],
            nodes=frozenset(int(m.metadata.dst_node_id) for m in messages),
            started=time.perf_counter(),
            bytes_down=bytes_down,
            timeout_s=timeout,
        )
        self._phases[index] = phase
        self.boundary.sent(messages, phase.server_round)
        for message_id in phase.message_ids:
            self._phase_of_message[message_id] = index
        late: set[str] = set()
        if self.faults is not None:
            drawn = client_faults(self.faults, phase_round, phase_kind, len(messages))
            late = {m.metadata.message_id for m, x in zip(messages, drawn.late) if x}
            messages = [m for m, x in zip(messages, drawn.dropped) if not x]
            phase.dropped = int(drawn.dropped.sum())
        for group in self._batch_groups(messages, shared):
            reducer = shared[id(group[0].content)][2]
            chunked = reducer is not None and not reducer.exact
            fold_chunk = fold_chunk_size(len(group)) if chunked else None
            if timeout is None:
                sizes = batch_sizes(len(group), self.backend.num_workers, fold_chunk or 1)
            else:  # a client (a fold chunk under a reducer) per batch, started by a free worker
                unit = 1 if reducer is None else fold_chunk_size(len(group))
                sizes = [min(unit, len(group) - start) for start in range(0, len(group), unit)]
            for size in sizes:
                chunk, group = group[:size], group[size:]
                self._submit(
                    phase, chunk, shared, folds, late, phase_kind, fold_chunk, timeout is not None
                )
        if not phase.pending:
            self._finish(phase)  # every client dropped out
        return phase

    def _batch_groups(
        self, messages: list[Message], shared: dict[int, tuple[Content, int, Reducer | None]]
    ) -> list[list[Message]]:
        """Messages that may share a batch: all of them, unless a reducer asks for
        batches whose messages share one content."""
        if all(entry[2] is None for entry in shared.values()):
            return [messages]
        groups: dict[int, list[Message]] = {}
        for message in messages:
            groups.setdefault(id(message.content), []).append(message)
        return list(groups.values())

    def _submit(
        self,
        phase: _Phase,
        chunk: list[Message],
        shared: dict[int, tuple[Content, int, Reducer | None]],
        folds: dict[int, OrderedFold],
        late: set[str],
        kind: int,
        fold_chunk: int | None = None,
        solo: bool = False,
    ) -> None:
        handles: list[Content] = []
        position: dict[int, int] = {}
        content_index = []
        for message in chunk:
            key = id(message.content)
            if key not in position:
                position[key] = len(handles)
                handles.append(shared[key][0])
            content_index.append(position[key])
        batch_id = self._next_batch
        self._next_batch += 1
        node_ids = [m.metadata.dst_node_id for m in chunk]
        batch = ClientBatch(
            batch_id=batch_id,
            metadata=[m.metadata for m in chunk],
            content_index=content_index,
            contents=handles,
            states=self.state_store.get_many(node_ids),
            reducer=shared[id(chunk[0].content)][2],
            late=frozenset(i for i, m in enumerate(chunk) if m.metadata.message_id in late),
            crash_after=None
            if self.faults is None
            else crash_point(self.faults, phase.round, kind, len(phase.batch_ids), len(chunk)),
            server_round=phase.server_round,
            fold_chunk=fold_chunk,
            solo=solo,
        )
        phase.batch_ids.append(batch_id)
        phase.pending.add(batch_id)
        fold = folds.get(id(chunk[0].content))
        if fold is not None:
            fold.order.append(batch_id)
            phase.folds[batch_id] = fold
        phase.batch_messages[batch_id] = {m.metadata.message_id for m in chunk}
        self._dispatcher.enqueue(
            batch,
            on_result=lambda result, p=phase: self._on_result(p, result),
            on_give_up=lambda b, reason, p=phase: self._on_give_up(p, b, reason),
            solo=solo,
        )

    def _on_result(self, phase: _Phase, result: BatchResult) -> None:
        # the clients ran, even if late: their states count
        self.state_store.put_many(result.states, version=phase.round)
        if phase.closed:
            return
        phase.pending.discard(result.batch_id)
        fold = phase.folds.get(result.batch_id)
        if fold is None:
            phase.results[result.batch_id] = result.replies
        else:
            fold.add(result.batch_id, [r for r in result.replies if not r.has_error()])
            phase.results[result.batch_id] = [r for r in result.replies if r.has_error()]
        phase.succeeded += result.succeeded
        phase.failed += result.failed
        phase.late += result.late
        phase.bytes_up += result.bytes_up
        phase.compute_s += result.compute_s
        phase.metrics.merge(result.metrics)
        if not phase.pending:
            self._finish(phase)

    def _on_give_up(self, phase: _Phase, batch: ClientBatch, reason: str) -> None:
        if phase.closed:
            return
        phase.pending.discard(batch.batch_id)
        phase.failed += len(batch.metadata)
        phase.results[batch.batch_id] = [
            Message(
                Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason),
                reply_to=Message(content=RecordDict(), metadata=meta),
            )
            for meta in batch.metadata
        ]
        if not phase.pending:
            self._finish(phase)

    def _finish(self, phase: _Phase) -> None:
        if phase.closed:
            return
        phase.closed = True
        timed_out = phase.late + sum(len(phase.batch_messages[b]) for b in phase.pending)
        phase.pending.clear()
        if self.observer is not None:
            self.observer.phase_finished(
                PhaseReport(
                    phase=phase.index,
                    server_round=phase.server_round,
                    message_type=phase.message_type,
                    messages=len(phase.message_ids),
                    succeeded=phase.succeeded,
                    failed=phase.failed,
                    timed_out=timed_out,
                    dropped=phase.dropped,
                    bytes_down=phase.bytes_down,
                    bytes_up=phase.bytes_up,
                    wall_s=time.perf_counter() - phase.started,
                    compute_s=phase.compute_s,
                    client_metrics=phase.metrics.means(),
                    nodes=phase.nodes,
                    timeout_s=phase.timeout_s,
                )
            )

    def _take(self, phase: _Phase, wanted: set[str] | None) -> list[Message]:
        """Remove and return finished replies of ``phase``: folded replies once the
        phase is over, then the others in node-id order."""
        out: list[Message] = []
        if phase.closed and phase.folds:
            for fold in dict.fromkeys(phase.folds.values()):
                folded = fold.result()
                covers = None if fold.accumulator is None else [
                    m for b in fold.order for m in phase.batch_messages[b]
                ]
                for reply in folded:
                    self.boundary.delivered(reply, covers)
                out.extend(folded)
            phase.folds.clear()
        for batch_id in phase.batch_ids:
            replies = phase.results.get(batch_id)
            if replies is None:
                continue
            if wanted is not None and not (phase.batch_messages[batch_id] & wanted):
                continue
            for reply in replies:
                self.boundary.delivered(reply)
            out.extend(replies)
            del phase.results[batch_id]
        if phase.closed and not phase.results and not phase.folds:
            self._forget(phase)
        return out

    def _forget(self, phase: _Phase) -> None:
        for message_id in phase.message_ids:
            self._phase_of_message.pop(message_id, None)
        self._phases.pop(phase.index, None)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        with self._lock:
            self._dispatcher.poll()
            phases = {self._phase_of_message[m] for m in wanted if m in self._phase_of_message}
            replies: list[Message] = []
            for index in sorted(phases):
                replies.extend(self._take(self._phases[index], wanted))
            return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        # the clock starts before the push: an in-process worker runs a client inside it
        deadline = None if timeout is None else time.monotonic() + timeout
        phase = self._push(messages, timeout)
        if phase is None:
            return []
        while True:
            with self._lock:
                if not phase.pending:
                    return self._take(phase, None)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._missed(phase)
                    self._finish(phase)  # late replies are dropped, as Flower drops them
                    return self._take(phase, None)
                # other threads' pushes wait at most one slice for the lock
                wait = _WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S)
                self._dispatcher.progress(wait)

    def _missed(self, phase: _Phase) -> None:
        """Say in one line how many replies of ``phase`` arrived within its timeout."""
        arrived = phase.succeeded + phase.failed
        where = "" if phase.server_round is None else f"round {phase.server_round}, "
        log.warning(
            "%s%s: %d of %d replies arrived within the timeout of %g s; as in Flower, the "
            "ServerApp gets only those",
            where,
            phase.message_type,
            arrived,
            len(phase.message_ids),
            phase.timeout_s,
        )

    @property
    def workers_replaced(self) -> int:
        """How many workers died and were replaced during this run."""
        return self._dispatcher.replaced

    def wait_idle(self) -> None:
        """Block until every dispatched batch has finished (late ones included)."""
        with self._lock:
            self._dispatcher.drain(None)
