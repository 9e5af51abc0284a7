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
  seconds have passed) and returns the replies ordered by node id, so a run's result
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
becomes in Flower: that call does not return it; the client ran, and its state is kept, as
Flower's context store keeps it; the reply waits, like a reply in Flower's LinkState, until
``pull_messages`` asks for its message id or the message's TTL runs out (a late fold chunk's
partial reply is not kept: its clients are folded with nobody); the phase counts it
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
from uuid import uuid4

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedsim.engine.backend import Backend
from fedsim.engine.boundary import ReleaseBoundary
from fedsim.engine.client_registry import ClientRegistry
from fedsim.engine.dispatch import Dispatcher, batch_sizes
from fedsim.engine.faults import FaultConfig, client_faults, crash_point
from fedsim.engine.message_types import runnable_message_type, unsupported
from fedsim.engine.participation import CohortModel
from fedsim.engine.phase_report import PhaseObserver, PhaseReport, RoundLog
from fedsim.engine.phases import OrderedFold, Phase, server_round_of
from fedsim.engine.state import ClientStateStore
from fedsim.engine.worker import BatchResult, ClientBatch, Content
from fedsim.record_codec import content_nbytes
from fedsim.worker_reduce import (
    Reducer,
    fold_chunk_size,
    reducer_of,
)

log = logging.getLogger(__name__)

#: seconds a waiting ``send_and_receive`` holds the grid's lock at most before others may push
_WAIT_SLICE_S = 0.05


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
        self._phases: dict[int, Phase] = {}
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

    def _push(self, messages: Iterable[Message], timeout: float | None = None) -> Phase | None:
        """Start a phase; ``timeout`` (that of ``send_and_receive``): its messages go out as
        solo batches of one client (one fold chunk) each."""
        messages = list(messages)
        for message in messages:
            self._check(message)
        with self._lock:
            return self._push_checked(messages, timeout)

    def _push_checked(self, messages: list[Message], timeout: float | None = None) -> Phase | None:
        self._expire()
        index = self._phase_counter
        phase_round, phase_kind = self._phase_key()
        self._phase_counter += 1
        self._declared = None
        if not messages:
            return None
        messages.sort(key=lambda m: m.metadata.dst_node_id)
        shared, folds, bytes_down = self._share_contents(messages)
        first = messages[0]
        phase = Phase(
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
        phase.expires = phase.started + max(float(m.metadata.ttl) for m in messages)
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

    def _share_contents(
        self, messages: list[Message]
    ) -> tuple[dict[int, tuple[Content, int, Reducer | None]], dict[int, OrderedFold], int]:
        """Each distinct content serialised once (its handle, bytes and reducer), the folds of
        the contents that carry a reducer, and the bytes sent; gives each message its id."""
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
        return shared, folds, bytes_down

    def _batch_groups(
        self, messages: list[Message], shared: dict[int, tuple[Content, int, Reducer | None]]
    ) -> list[list[Message]]:
        """Messages that may share a batch: all of them, unless a reducer asks for
        batches whose messages share one content."""
        if not messages:  # every client dropped out
            return []
        if all(entry[2] is None for entry in shared.values()):
            return [messages]
        groups: dict[int, list[Message]] = {}
        for message in messages:
            groups.setdefault(id(message.content), []).append(message)
        return list(groups.values())

    def _submit(
        self,
        phase: Phase,
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

    def _on_result(self, phase: Phase, result: BatchResult) -> None:
        # the clients ran, even if late: their states count
        self.state_store.put_many(result.states, version=phase.round)
        if phase.closed:
            if result.batch_id in phase.overdue:  # late: kept for pull_messages
                phase.overdue.discard(result.batch_id)
                phase.results[result.batch_id] = result.replies
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

    def _on_give_up(self, phase: Phase, batch: ClientBatch, reason: str) -> None:
        if phase.closed:
            phase.overdue.discard(batch.batch_id)
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

    def _finish(self, phase: Phase) -> None:
        if phase.closed:
            return
        phase.closed = True
        timed_out = phase.late + sum(len(phase.batch_messages[b]) for b in phase.pending)
        phase.overdue = {b for b in phase.pending if b not in phase.folds}
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

    def _take(self, phase: Phase, wanted: set[str] | None) -> list[Message]:
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
        if phase.closed and not (phase.results or phase.folds or phase.overdue):
            self._forget(phase)
        return out

    def _forget(self, phase: Phase) -> None:
        for message_id in phase.message_ids:
            self._phase_of_message.pop(message_id, None)
        self._phases.pop(phase.index, None)

    def _expire(self) -> None:
        """Forget the closed phases whose replies outlived their messages' TTL unpulled."""
        now = time.perf_counter()
        for phase in [p for p in self._phases.values() if p.closed and p.expires < now]:
            self._forget(phase)

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        with self._lock:
            self._dispatcher.poll()
            self._expire()
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
                    self._finish(phase)  # late replies wait for pull_messages, as in Flower
                    return self._take(phase, None)
                # other threads' pushes wait at most one slice for the lock
                wait = _WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S)
                self._dispatcher.progress(wait)

    def _missed(self, phase: Phase) -> None:
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
