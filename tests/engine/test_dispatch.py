"""Batch sizes and the dispatcher: balance, depth, crash re-runs."""

from dataclasses import dataclass, field

import pytest

from fedsim.engine.backend import Backend, WorkerLost
from fedsim.engine.dispatch import Dispatcher, batch_sizes
from fedsim.engine.worker import BatchResult, ClientBatch
from fedsim.worker_reduce import MetricSums


@pytest.mark.parametrize("n,w", [(1, 1), (50, 2), (1000, 2), (7, 8), (333, 5)])
def test_guided_batch_sizes(n, w):
    sizes = batch_sizes(n, w)
    assert sum(sizes) == n
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # non-increasing
    assert sizes[0] == -(-n // (2 * w))
    assert sizes[-1] == 1  # the last batches are single clients


@dataclass(eq=False)
class _Future:
    worker: int
    batch: ClientBatch


@dataclass
class FakeBackend(Backend):
    """Completes futures in submission order; batches listed in ``kill`` as
    (batch id, worker, worker generation) lose their worker."""

    workers: int = 2
    kill: set = field(default_factory=set)
    submitted: list = field(default_factory=list)
    restarts: list = field(default_factory=list)
    generation: list = field(default_factory=lambda: [0, 0, 0, 0])

    @property
    def num_workers(self):
        return self.workers

    def start_run(self, run):
        pass

    def share(self, value):
        return value

    def submit(self, worker, batch):
        self.submitted.append((worker, batch.batch_id))
        return _Future(worker, batch)

    def wait(self, futures, timeout):
        return futures[:1]

    def result(self, future):
        key = (future.batch.batch_id, future.worker, self.generation[future.worker])
        if key in self.kill:
            raise WorkerLost(future.worker, RuntimeError("killed"))
        return BatchResult(future.batch.batch_id, [], {}, 1, 0, 0, 0, 0.0, MetricSums(), 0)

    def restart(self, worker):
        self.restarts.append(worker)
        self.generation[worker] += 1

    def close(self):
        pass


def batch(i, clients=1):
    return ClientBatch(batch_id=i, metadata=[None] * clients, content_index=[], contents=[])


def test_depth_and_balance():
    backend = FakeBackend(workers=2)
    dispatcher = Dispatcher(backend, depth=2)
    done = []
    for i in range(6):
        dispatcher.enqueue(batch(i), done.append, lambda b, r: None)
    # two per worker are queued at once, each to the worker with the least work ahead
    assert backend.submitted == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert dispatcher.drain(None)
    assert [r.batch_id for r in done] == list(range(6))


def test_lost_worker_is_replaced_once_and_its_batches_rerun():
    backend = FakeBackend(workers=2, kill={(0, 0, 0), (2, 0, 0)})  # worker 0's two batches
    dispatcher = Dispatcher(backend, depth=2)
    done = []
    for i in range(4):
        dispatcher.enqueue(batch(i), done.append, lambda b, r: None)
    assert dispatcher.drain(None)
    assert sorted(r.batch_id for r in done) == [0, 1, 2, 3]
    assert backend.restarts == [0]  # one replacement for two lost batches


def test_batches_that_keep_killing_workers_are_given_up():
    backend = FakeBackend(workers=1, kill={(0, 0, g) for g in range(10)})
    dispatcher = Dispatcher(backend, depth=1, max_attempts=3)
    given_up = []
    dispatcher.enqueue(batch(0), lambda r: None, lambda b, reason: given_up.append(reason))
    assert dispatcher.drain(None)
    assert len(given_up) == 1 and "3 attempts" in given_up[0]
    assert backend.restarts == [0, 0, 0]


def test_batches_go_to_the_worker_that_runs_dry_first():
    backend = FakeBackend(workers=2)
    dispatcher = Dispatcher(backend, depth=3)
    for i, clients in enumerate([10, 1, 1, 1, 10]):
        dispatcher.enqueue(batch(i, clients), lambda r: None, lambda b, r: None)
    assert backend.submitted == [(0, 0), (1, 1), (1, 2), (1, 3), (0, 4)]
