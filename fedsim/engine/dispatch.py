"""Scheduling batches of client messages onto workers.

A phase's messages (sorted by node id) are cut into batches by guided
self-scheduling: each batch takes ``ceil(remaining / (2 * workers))`` messages,
so early batches are large (few calls, few partial replies) and the last ones
hold single clients (workers finish within about one client of each other).
The dispatcher keeps ``depth`` batches queued on every worker so no worker waits
for the driver between batches, and gives each batch to the worker expected to
run out of work first (list scheduling with a measured seconds-per-client). A
batch whose worker dies is run again on a fresh worker from the same inputs.

A *solo* batch (the one client, or fold chunk, of a phase under a timeout) never waits
behind a slow one: a client starts when a worker is free, as in Flower's simulation (an
actor pool fed from one queue). Where the backend can take back a batch its worker has not
started (:meth:`Backend.release`, the workers' channels), solo batches queue ``depth`` deep
as any (no worker waits for the driver between clients), and whenever a worker has nothing
to do while another holds a solo batch queued behind the one it runs, that batch is asked
back and given to the idle worker. Elsewhere a solo batch goes only to a worker with nothing
in flight, and nothing is queued behind it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fedsim.engine.backend import Backend, WorkerLost
from fedsim.engine.channel import BatchReleased
from fedsim.engine.worker import BatchResult, ClientBatch

log = logging.getLogger(__name__)


def batch_sizes(num_messages: int, num_workers: int, chunk: int = 1) -> list[int]:
    """Guided self-scheduling batch sizes (Polychronopoulos & Kuck 1987), halved
    so two batches per worker are in flight, in whole ``chunk`` s of messages (the last
    chunk may be short): batches never split a fold chunk
    (:func:`fedsim.worker_reduce.fold_chunk_size`)."""
    if chunk < 1:
        raise ValueError(f"chunk = {chunk!r}; it must be >= 1")
    sizes: list[int] = []
    remaining = math.ceil(num_messages / chunk)
    while remaining > 0:
        size = max(1, math.ceil(remaining / (2 * num_workers)))
        sizes.append(size * chunk)
        remaining -= size
    if sizes:
        sizes[-1] -= sum(sizes) - num_messages
    return sizes


@dataclass
class _Task:
    batch: ClientBatch
    on_result: Callable[[BatchResult], None]
    on_give_up: Callable[[ClientBatch, str], None]
    attempts: int = 0
    solo: bool = False  # never waits behind a running batch (module docstring)


@dataclass
class Dispatcher:
    """Feeds batches to a backend's workers and routes results back."""

    backend: Backend
    depth: int = 2
    max_attempts: int = 3
    queue: deque[_Task] = field(default_factory=deque)
    in_flight: dict[Any, tuple[_Task, int, int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        workers = self.backend.num_workers
        self._load = [0] * workers  # batches in flight per worker
        self._busy_until = [0.0] * workers  # predicted time each worker runs dry
        self._generation = [0] * workers
        self._per_client = 0.0  # seconds per client, a running mean of batch results
        self.replaced = 0  # workers replaced after they died
        self.released = 0  # solo batches taken back unstarted and run elsewhere
        self._asked: set[Any] = set()  # futures asked back, not yet resolved

    def enqueue(
        self,
        batch: ClientBatch,
        on_result: Callable[[BatchResult], None],
        on_give_up: Callable[[ClientBatch, str], None],
        *,
        solo: bool = False,
    ) -> None:
        """Queue ``batch`` (batches are submitted in the order queued); ``solo``: it never waits
        behind another batch on a worker (module docstring)."""
        self.queue.append(_Task(batch, on_result, on_give_up, solo=solo))
        self._fill()

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight

    def _fill(self) -> None:
        # List scheduling: each batch goes to the worker predicted to run out of
        # work first (its queued clients times the measured seconds per client),
        # among those with fewer than ``depth`` batches in flight (a solo batch goes to the
        # least loaded, and fills all ``depth`` slots of a worker that cannot hand it back).
        while self.queue:
            head = self.queue[0]
            open_workers = [
                w for w, load in enumerate(self._load) if load + self._weight(head, w) <= self.depth
            ]
            if not open_workers:
                break
            now = time.monotonic()
            if head.solo:  # an idle worker first: never behind a client that overran
                worker = min(open_workers, key=lambda w: (self._load[w], self._busy_until[w], w))
            else:
                worker = min(open_workers, key=lambda w: (max(self._busy_until[w], now), w))
            task = self.queue.popleft()
            task.attempts += 1
            weight = self._weight(task, worker)
            future = self.backend.submit(worker, task.batch)
            self.in_flight[future] = (task, worker, self._generation[worker], weight)
            self._load[worker] += weight
            cost = len(task.batch.metadata) * (self._per_client or 1.0)
            self._busy_until[worker] = max(self._busy_until[worker], now) + cost

        if not self.queue:
            self._rebalance()

    def _weight(self, task: _Task, worker: int) -> int:
        """The slots of ``worker``'s ``depth`` a task takes: one, or all of them for a solo
        task on a worker that cannot hand batches back."""
        return self.depth if task.solo and not self.backend.releases(worker) else 1

    def _rebalance(self) -> None:
        """Ask back solo batches queued behind a running batch, one per idle worker: each
        comes back unstarted (then the idle worker takes it) or has started meanwhile."""
        idle = sum(1 for load in self._load if not load) - len(self._asked)
        if idle <= 0:
            return
        seen: set[int] = set()
        for future, (task, worker, _, _) in self.in_flight.items():
            if worker not in seen:
                seen.add(worker)  # the first in flight on its worker: it runs
                continue
            if task.solo and future not in self._asked and self.backend.release(future):
                self._asked.add(future)
                idle -= 1
                if not idle:
                    return

    def poll(self) -> None:
        """Deliver every batch that is already finished, without waiting."""
        while self.progress(0):
            pass

    def progress(self, timeout: float | None) -> int:
        """Wait up to ``timeout`` seconds for batches to finish; deliver them and
        return how many finished."""
        self._fill()
        if not self.in_flight:
            return 0
        done = self.backend.wait(list(self.in_flight), timeout)
        for future in done:
            task, worker, generation, weight = self.in_flight.pop(future)
            self._asked.discard(future)
            self._load[worker] -= weight
            if not self._load[worker]:
                self._busy_until[worker] = time.monotonic()
            try:
                result = self.backend.result(future)
            except BatchReleased:  # handed back unstarted: the next free worker runs it
                task.attempts -= 1
                self.released += 1
                self.queue.appendleft(task)
                continue
            except WorkerLost as lost:
                self._recover(task, worker, generation, lost)
                continue
            self._learn(result)
            task.on_result(result)
        self._fill()
        return len(done)

    def _learn(self, result: BatchResult) -> None:
        """Update the seconds-per-client estimate from a finished batch."""
        clients = result.succeeded + result.failed
        if clients and result.compute_s > 0:
            sample = result.compute_s / clients
            self._per_client = (
                sample if not self._per_client else 0.8 * self._per_client + 0.2 * sample
            )

    def _recover(self, task: _Task, worker: int, generation: int, lost: WorkerLost) -> None:
        # Every batch queued on the dead worker fails the same way: replace the
        # worker once, and re-run each of its batches.
        if generation == self._generation[worker]:
            self.backend.restart(worker)
            self._generation[worker] += 1
            self.replaced += 1
        if task.attempts >= self.max_attempts:
            task.on_give_up(task.batch, f"{lost} ({task.attempts} attempts)")
            return
        log.warning("%s; re-running its batch of %d clients", lost, len(task.batch.metadata))
        # injected crashes and lost replies strike once
        task.batch = replace(task.batch, crash_after=None, lose_reply=False)
        self.queue.appendleft(task)

    def drain(self, deadline: float | None) -> bool:
        """Run until idle or ``deadline`` (time.monotonic()); True if idle."""
        while not self.idle:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.progress(remaining)
        return True
