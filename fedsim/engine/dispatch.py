"""Scheduling batches of client messages onto workers.

A phase's messages (sorted by node id) are cut into batches by guided
self-scheduling: each batch takes ``ceil(remaining / (2 * workers))`` messages,
so early batches are large (few calls, few partial replies) and the last ones
hold single clients (workers finish within about one client of each other).
The dispatcher keeps ``depth`` batches queued on every worker so no worker waits
for the driver between batches, and gives each batch to the worker expected to
run out of work first (list scheduling with a measured seconds-per-client). A
batch whose worker dies is run again on a fresh worker from the same inputs.
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


@dataclass
class Dispatcher:
    """Feeds batches to a backend's workers and routes results back."""

    backend: Backend
    depth: int = 2
    max_attempts: int = 3
    queue: deque[_Task] = field(default_factory=deque)
    in_flight: dict[Any, tuple[_Task, int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        workers = self.backend.num_workers
        self._load = [0] * workers  # batches in flight per worker
        self._busy_until = [0.0] * workers  # predicted time each worker runs dry
        self._generation = [0] * workers
        self._per_client = 0.0  # seconds per client, a running mean of batch results
        self.replaced = 0  # workers replaced after they died

    def enqueue(
        self,
        batch: ClientBatch,
        on_result: Callable[[BatchResult], None],
        on_give_up: Callable[[ClientBatch, str], None],
    ) -> None:
        self.queue.append(_Task(batch, on_result, on_give_up))
        self._fill()

    @property
    def idle(self) -> bool:
        return not self.queue and not self.in_flight

    def _fill(self) -> None:
        # List scheduling: each batch goes to the worker predicted to run out of
        # work first (its queued clients times the measured seconds per client),
        # among those with fewer than ``depth`` batches in flight.
        while self.queue:
            open_workers = [w for w, load in enumerate(self._load) if load < self.depth]
            if not open_workers:
                return
            now = time.monotonic()
            worker = min(open_workers, key=lambda w: (max(self._busy_until[w], now), w))
            task = self.queue.popleft()
            task.attempts += 1
            future = self.backend.submit(worker, task.batch)
            self.in_flight[future] = (task, worker, self._generation[worker])
            self._load[worker] += 1
            cost = len(task.batch.metadata) * (self._per_client or 1.0)
            self._busy_until[worker] = max(self._busy_until[worker], now) + cost

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
            task, worker, generation = self.in_flight.pop(future)
            self._load[worker] -= 1
            if not self._load[worker]:
                self._busy_until[worker] = time.monotonic()
            try:
                result = self.backend.result(future)
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
