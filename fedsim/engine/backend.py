"""Backends execute client batches on workers: Ray actors, or in-process.

Both implement :class:`Backend`, so the grid schedules batches the same way on a
laptop, in a unit test and on a Ray cluster. The in-process backend runs batches
synchronously in the driver (tracebacks point straight into the ClientApp),
which makes it the debugging and fast-test backend.

Neither keeps a secret in the driver: a run's :class:`~fedsim.engine.worker.RunSpec` names
where the root lies (:class:`~fedsim.randomness.RootSource`), the workers open it, and the
driver gets only the server's own secret (:meth:`Backend.server_secret`). Only Ray workers
isolate the clients from the server, by process; the in-process backend cannot (see its
docstring).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from fedsim.config import ConfigError
from fedsim.engine.channel import (
    REPLY_TIMEOUT_S,
    ChannelFuture,
    ChannelLost,
    DriverChannel,
    ReplyLost,
    heartbeat_interval,
    wait_any,
)
from fedsim.engine.channel_contents import CHANNEL_CONTENTS, SHARED_CONTENT_BYTES
from fedsim.engine.channel_frames import new_key
from fedsim.engine.worker import (
    BatchResult,
    ClientBatch,
    ClientWorker,
    Content,
    InjectedCrash,
    RunSpec,
    remember,
)
from fedsim.engine.worker_reset import ResettableWorker
from fedsim.randomness import PartySecret, RootSource

log = logging.getLogger(__name__)

#: the least seconds the driver waits for a Ray call that sets a worker up (its start and
#: imports, a run's datasets): ``max(reply_timeout_s, SETUP_TIMEOUT_S)``
SETUP_TIMEOUT_S = 600.0


class WorkerLost(RuntimeError):
    """A worker process died while running a batch."""

    def __init__(self, worker: int, cause: BaseException) -> None:
        self.worker = worker
        super().__init__(f"worker {worker} died: {type(cause).__name__}: {cause}")


class WorkerTimeout(WorkerLost):
    """A worker's reply did not arrive in time (``engine.reply_timeout_s``): the message
    names the worker (its index and Ray actor), what it was doing and the round."""

    def __init__(self, worker: int, actor: str, cause: BaseException | str) -> None:
        self.worker = worker
        self.actor = actor
        RuntimeError.__init__(self, f"worker {worker} (Ray actor {actor}) timed out: {cause}")


class Backend(ABC):
    """A pool of workers that run :class:`ClientBatch` es."""

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """How many batches can run at once."""

    def ready(self) -> None:  # noqa: B027 - a no-op for backends whose workers start synchronously
        """Block until the workers are up (backends that start them asynchronously)."""

    @abstractmethod
    def start_run(self, run: RunSpec) -> None:
        """Load the run on every worker (blocks until all are ready)."""

    @abstractmethod
    def share(self, value: Any) -> Any:
        """A handle through which every worker can read ``value`` (put once)."""

    @abstractmethod
    def submit(self, worker: int, batch: ClientBatch) -> Any:
        """Start ``batch`` on ``worker``; returns a future."""

    @abstractmethod
    def wait(self, futures: list[Any], timeout: float | None) -> list[Any]:
        """Futures among ``futures`` that are done; waits for at least one unless
        ``timeout`` (seconds) runs out first."""

    @abstractmethod
    def result(self, future: Any) -> BatchResult:
        """The batch result of a done future; raises :class:`WorkerLost` if its
        worker died."""

    @abstractmethod
    def restart(self, worker: int) -> None:
        """Replace a dead worker by a fresh one running the current run."""

    def release(self, future: Any) -> bool:
        """Ask for a submitted batch back if its worker has not started it: its future then
        resolves with :class:`~fedsim.engine.channel.BatchReleased` from :meth:`result`, or
        as usual if it had started. False where the backend cannot ask (the default)."""
        return False

    def releases(self, worker: int) -> bool:
        """Whether :meth:`release` can ask ``worker`` for its batches back."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the workers."""

    def server_secret(self, source: RootSource) -> PartySecret:
        """The server's own secret under ``source``, derived by a worker (the driver does not
        read the root)."""
        raise NotImplementedError(f"{type(self).__name__} derives no secrets")

    def fresh_root(self) -> RootSource:
        """A new root of OS randomness, written by a worker; the driver learns only its path."""
        raise NotImplementedError(f"{type(self).__name__} writes no roots")

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description for run summaries."""
        return {"backend": type(self).__name__, "workers": self.num_workers}


@dataclass(eq=False)
class _Done:
    """A future that is already resolved (in-process backend)."""

    worker: int
    value: BatchResult | None = None
    error: BaseException | None = None


class LocalBackend(Backend):
    """Runs every batch synchronously in the calling process, on one worker.

    **No isolation.** The clients run in the driver's process, beside the ServerApp: the worker
    keeps no root (it opens the root file for each client call and drops it), so nothing the
    server's objects reach holds a client's secret between calls, but code in the process can
    open the root file or read a client's ``node_config`` while it runs. Use it for debugging
    and tests; every claim that the server cannot learn a client's secret needs the Ray backend
    (or a deployment), where clients are other processes.
    """

    def __init__(self, torch_threads: int | None = None) -> None:
        self._threads = torch_threads
        self._worker = self._new_worker()
        self._run: RunSpec | None = None

    def _new_worker(self) -> ClientWorker:
        return ClientWorker(torch_threads=self._threads, exit_on_crash=False, keep_root=False)

    @property
    def num_workers(self) -> int:
        return 1

    def start_run(self, run: RunSpec) -> None:
        self._run = run
        self._worker.start_run(run)

    def share(self, value: Any) -> Any:
        return value

    def submit(self, worker: int, batch: ClientBatch) -> _Done:
        try:
            return _Done(worker, value=self._worker.run_batch(batch))
        except InjectedCrash as crash:
            return _Done(worker, error=WorkerLost(worker, crash))
        except Exception as ex:  # re-raised by result(), where the grid expects it
            return _Done(worker, error=ex)

    def wait(self, futures: list[Any], timeout: float | None) -> list[Any]:
        return list(futures)

    def result(self, future: _Done) -> BatchResult:
        if future.error is not None:
            raise future.error
        assert future.value is not None
        return future.value

    def restart(self, worker: int) -> None:
        self._worker = self._new_worker()
        if self._run is not None:
            self._worker.start_run(self._run)

    def close(self) -> None:
        self._run = None

    def server_secret(self, source: RootSource) -> PartySecret:
        return PartySecret.from_token(self._worker.server_secret_token(source), "server")

    def fresh_root(self) -> RootSource:
        return self._worker.create_root()


class RayBackend(Backend):
    """One Ray actor per worker, each holding a :class:`ClientWorker`.

    Args:
        num_workers: actors to start; default: as many as the cluster's CPUs
            allow at ``cpus_per_worker`` each.
        cpus_per_worker: Ray ``num_cpus`` of each actor (and torch's thread count).
        gpus_per_worker: Ray ``num_gpus`` of each actor (fractions share a GPU).
        pin_workers: give each worker its own cores (``sched_setaffinity``) when
            its machine has enough for all the workers on it. On two cores this
            is worth about 5% of run time: an unpinned worker that Ray's
            background threads preempt is moved to the other core and loses its
            cache. Pinning needs the machine to itself, so it suits a local Ray
            rather than a shared cluster.
        reply_timeout_s: seconds a worker may stay silent with batches pending on its
            channel (it sends heartbeats while it runs one) before they fail with
            :class:`WorkerTimeout`; without a channel (batches by Ray calls, no
            heartbeats) the most one batch may run. Calls that set workers up wait
            ``max(reply_timeout_s, SETUP_TIMEOUT_S)``.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        pin_workers: bool = False,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        import ray  # noqa: PLC0415

        if not ray.is_initialized():
            raise RuntimeError("RayBackend needs ray.init() first (fedsim.engine.Engine does it)")
        if not reply_timeout_s > 0:
            raise ConfigError("engine.reply_timeout_s", reply_timeout_s, "a number of seconds > 0")
        self.reply_timeout_s = float(reply_timeout_s)
        self._setup_s = max(self.reply_timeout_s, SETUP_TIMEOUT_S)
        self._ray = ray
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        if num_workers is None:
            cpus = ray.cluster_resources().get("CPU", 0.0)
            num_workers = max(1, int(cpus // cpus_per_worker)) if cpus_per_worker > 0 else 1
        self._check_free(num_workers)
        self._threads = max(1, int(cpus_per_worker)) if cpus_per_worker >= 1 else 1
        self._actor_cls = ray.remote(ResettableWorker).options(
            num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0
        )
        # Spawn the workers and let them import without waiting: the driver goes on with
        # its own set-up and meets them in ready() (start_run calls it).
        self._actors = self._spawn(num_workers)
        self._warming = [actor.warm_up.remote() for actor in self._actors if self._warm_on_spawn]
        self._pin_workers = pin_workers
        self._owner: dict[Any, int] = {}
        # batches sent by Ray calls: (worker, what, when sent); their deadlines; the last
        # time each worker finished one
        self._calls: dict[Any, tuple[int, str, float]] = {}
        self._expired: dict[Any, WorkerTimeout] = {}
        self._finished = [0.0] * num_workers
        self._sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in self._actors]
        self._run: RunSpec | None = None
        self._channels: list[DriverChannel | None] = [None] * num_workers
        self.pinned = False
        self.nodes = 0

    #: spawned actors import torch first (a warm pool's leased ones have)
    _warm_on_spawn = True

    def _spawn(self, count: int) -> list[Any]:
        """``count`` new worker actors (a warm pool leases them instead)."""
        return [self._actor_cls.remote(self._threads) for _ in range(count)]

    def _replace_actor(self, worker: int) -> Any:
        """Kill ``worker``'s actor and put a new one in its place (not yet warm)."""
        self._ray.kill(self._actors[worker], no_restart=True)
        self._actors[worker] = actor = self._actor_cls.remote(self._threads)
        return actor

    def _release_actors(self, clean: list[bool]) -> None:
        """The run is over: kill the actors (a warm pool keeps the ``clean`` ones)."""
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)

    def _reset_workers(self) -> list[bool]:
        """Reset every worker to its warm baseline (:mod:`fedsim.engine.worker_reset`), so
        nothing of an earlier run reaches the next; True per worker whose reset succeeded."""
        reports = self._get([actor.reset.remote() for actor in self._actors], "reset")
        for index, report in enumerate(reports):
            if not report["ok"]:
                log.warning(
                    "worker %d is replaced: its reset failed: %s",
                    index,
                    "; ".join(report["problems"]),
                )
        return [bool(report["ok"]) for report in reports]

    def ready(self) -> None:
        """Wait until every worker has started and imported, pin them, open the channels."""
        if self._warming is None:
            return
        self.pinned = self._pin(self._actors) if self._pin_workers else False
        self._get(self._warming, "start and import")
        self._warming = None
        nodes = self._get([actor.ray_node.remote() for actor in self._actors], "report its node")
        self.nodes = len(set(nodes))
        self._channels = [self._connect(i) for i in range(len(self._actors))]

    def _actor_id(self, worker: int) -> str:
        try:
            return self._actors[worker]._actor_id.hex()
        except (AttributeError, IndexError):
            return "?"

    def _get(self, refs: list[Any], what: str, workers: list[int] | None = None) -> list[Any]:
        """``ray.get(refs)``, one call per worker (``workers``: whose, default all in
        order), within the set-up timeout; :class:`WorkerTimeout` naming the first worker
        that did not answer."""
        workers = list(range(len(refs))) if workers is None else workers
        _, pending = self._ray.wait(refs, num_returns=len(refs), timeout=self._setup_s)
        if pending:
            late = [workers[refs.index(ref)] for ref in pending]
            raise WorkerTimeout(
                late[0],
                self._actor_id(late[0]),
                f"no answer to {what!r} within {self._setup_s:g} s (workers {late} were late)",
            )
        return self._ray.get(refs)

    def _check_free(self, num_workers: int, wait_s: float = 5.0) -> None:
        """Refuse (instead of waiting forever for actors that cannot be placed)
        when the cluster lacks the CPUs or GPUs for ``num_workers`` workers;
        resources released a moment ago get ``wait_s`` to come back."""
        need = {
            "CPU": num_workers * self.cpus_per_worker,
            "GPU": num_workers * self.gpus_per_worker,
        }
        deadline = time.monotonic() + wait_s
        while True:
            free = self._ray.available_resources()
            short = [k for k, v in need.items() if v > 0 and free.get(k, 0.0) + 1e-9 < v]
            if not short:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        total = self._ray.cluster_resources()
        kind = short[0]
        per = self.cpus_per_worker if kind == "CPU" else self.gpus_per_worker
        have = free.get(kind, 0.0)
        raise ConfigError(
            "engine.workers",
            num_workers,
            f"at most {int(have // per)} workers of {per:g} {kind} each: the Ray cluster "
            f"has {have:g} of {total.get(kind, 0.0):g} {kind}s free",
        )

    def _pin(self, actors: list[Any]) -> bool:
        """Give the workers on each machine disjoint sets of its allowed cores."""
        places = self._get([actor.placement.remote() for actor in actors], "report its cores")
        by_host: dict[str, list[int]] = {}
        for index, (host, _) in enumerate(places):
            by_host.setdefault(host, []).append(index)
        per_worker = max(1, int(self.cpus_per_worker))
        calls = []
        for host, indices in by_host.items():
            cores = places[indices[0]][1]
            if len(indices) * per_worker > len(cores):
                log.warning(
                    "not pinning workers on %s: %d cores for %d workers",
                    host,
                    len(cores),
                    len(indices),
                )
                return False
            for slot, index in enumerate(indices):
                chosen = cores[slot * per_worker : (slot + 1) * per_worker]
                calls.append(actors[index].pin.remote(chosen))
        self._get(calls, "pin", [i for indices in by_host.values() for i in indices])
        return True

    def _connect(self, worker: int) -> DriverChannel | None:
        """A direct channel to ``worker``, or None (batches then go by Ray calls)."""
        key = new_key()
        beat = heartbeat_interval(self.reply_timeout_s)
        try:
            ref = self._actors[worker].open_channel.remote(key, None, beat)
            address = self._get([ref], "open its channel", [worker])[0]
            return DriverChannel(worker, tuple(address), key, reply_timeout=self.reply_timeout_s)
        except (OSError, EOFError) as err:
            log.warning("worker %d: no direct channel (%s); using Ray calls", worker, err)
            return None

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    def start_run(self, run: RunSpec) -> None:
        self.ready()
        if self._run is not None:  # the workers ran another run: nothing of it may stay
            for worker, ok in enumerate(self._reset_workers()):
                if not ok:  # a worker the reset cannot vouch for is replaced by a fresh one
                    self.restart(worker, run=False)
        self._run = run
        self._sent = [OrderedDict() for _ in self._actors]
        for channel in self._channels:
            if channel is not None:
                channel.forget_contents()
        self._get([actor.start_run.remote(run) for actor in self._actors], "start the run")

    def share(self, value: Any) -> Any:
        return self._ray.put(value)

    def submit(self, worker: int, batch: ClientBatch) -> Any:
        # Send each content to each worker once; later batches name it by key. A solo batch
        # (one that may be released unstarted) carries its contents and leaves the cache be;
        # on a channel its large contents still cross the connection once (its own mirror).
        if not batch.solo:
            sent = self._sent[worker]
            contents = [
                Content(c.key, None) if remember(sent, c.key, None) else c
                for c in batch.contents
            ]
            batch = replace(batch, contents=contents)
        channel = self._channels[worker]
        if channel is not None:
            batch, shared = batch.sharing_contents(CHANNEL_CONTENTS, SHARED_CONTENT_BYTES)
            return channel.send(batch, batch.describe(), shared)
        future = self._actors[worker].run_batch.remote(batch)
        self._owner[future] = worker
        self._calls[future] = (worker, batch.describe(), time.monotonic())
        return future

    def wait(self, futures: list[Any], timeout: float | None) -> list[Any]:
        if not futures:
            return []
        direct = [f for f in futures if isinstance(f, ChannelFuture)]
        refs = [f for f in futures if not isinstance(f, ChannelFuture)]
        deadline = None if timeout is None else time.monotonic() + timeout
        if direct:  # the frames already here (a poll, timeout 0, must see them too)
            wait_any([c for c in self._channels if c is not None], 0.0)
        while True:
            ready = [f for f in direct if f.done]
            if refs:
                ready += self._ray.wait(refs, num_returns=len(refs), timeout=0)[0]
                ready += self._expire([r for r in refs if r not in ready])
            remaining = None if deadline is None else deadline - time.monotonic()
            if ready or (remaining is not None and remaining <= 0):
                return ready
            # Block on the transport that has work; poll both briefly when both do; never
            # past the first batch's reply deadline (wait_any keeps its channels' own).
            step = remaining if not (direct and refs) else min(0.002, remaining or 0.002)
            if direct:
                wait_any([c for c in self._channels if c is not None], step)
            else:
                due = min(self._due(r) for r in refs) - time.monotonic()
                step = max(0.0, due if step is None else min(step, due))
                self._ray.wait(refs, num_returns=1, timeout=step)

    def release(self, future: Any) -> bool:
        channel = self._channels[future.worker] if isinstance(future, ChannelFuture) else None
        return channel is not None and channel.release(future)

    def releases(self, worker: int) -> bool:
        return self._channels[worker] is not None

    def _due(self, ref: Any) -> float:
        """When a batch sent by a Ray call times out: ``reply_timeout_s`` after it could
        start (it was sent, and its worker had finished the batch before it)."""
        worker, _, sent = self._calls[ref]
        return max(sent, self._finished[worker]) + self.reply_timeout_s

    def _expire(self, refs: list[Any]) -> list[Any]:
        """The batches among ``refs`` (sent by Ray calls, not finished) past their
        deadline, each with its :class:`WorkerTimeout`."""
        now = time.monotonic()
        late = []
        for ref in refs:
            if ref not in self._expired and ref in self._calls and now > self._due(ref):
                worker, what, _ = self._calls[ref]
                self._expired[ref] = WorkerTimeout(
                    worker,
                    self._actor_id(worker),
                    f"no reply to {what} within {self.reply_timeout_s:g} s",
                )
            if ref in self._expired:
                late.append(ref)
        return late

    def result(self, future: Any) -> BatchResult:
        if isinstance(future, ChannelFuture):
            try:
                return future.value()
            except ReplyLost as err:
                raise WorkerTimeout(future.worker, self._actor_id(future.worker), err) from err
            except ChannelLost as err:
                raise WorkerLost(future.worker, err) from err
        worker = self._owner.pop(future, -1)
        self._calls.pop(future, None)
        expired = self._expired.pop(future, None)
        if expired is not None:
            raise expired
        if 0 <= worker < len(self._finished):
            self._finished[worker] = time.monotonic()
        try:
            return self._ray.get(future, timeout=self._setup_s)
        except self._ray.exceptions.GetTimeoutError as err:  # wait() said it was done
            raise WorkerTimeout(worker, self._actor_id(worker), err) from err
        except self._ray.exceptions.RayActorError as err:
            raise WorkerLost(worker, err) from err

    def restart(self, worker: int, run: bool = True) -> None:
        """Replace ``worker`` by a fresh one, loaded with the current run unless ``run`` is
        False (a worker replaced between runs)."""
        self.ready()
        channel = self._channels[worker]
        if channel is not None:
            channel.fail(ChannelLost(f"worker {worker} was replaced"))
        actor = self._replace_actor(worker)
        self._sent[worker] = OrderedDict()
        if self.pinned:  # the new worker takes the cores its predecessor held
            self.pinned = self._pin(self._actors)
        self._finished[worker] = 0.0
        self._get([actor.warm_up.remote()], "start and import", [worker])
        if run and self._run is not None:
            self._get([actor.start_run.remote(self._run)], "start the run", [worker])
        self._channels[worker] = self._connect(worker)
        log.warning("worker %d was replaced", worker)

    def close(self) -> None:
        for channel in self._channels:
            if channel is not None:
                channel.close()
        self._release_actors([False] * len(self._actors))
        self._actors = []
        self._warming = None
        self._owner.clear()
        self._calls.clear()
        self._expired.clear()

    def server_secret(self, source: RootSource) -> PartySecret:
        self.ready()
        token = self._get([self._actors[0].server_secret_token.remote(source)], "derive")[0]
        return PartySecret.from_token(token, "server")

    def fresh_root(self) -> RootSource:
        """A fresh root, written by worker 0 on its machine (on a cluster whose workers span
        machines, give ``--secrets`` a file readable on every one of them instead)."""
        self.ready()
        return self._get([self._actors[0].create_root.remote()], "write a root")[0]

    def worker_peak_rss_mb(self) -> list[float]:
        """Each worker process's peak resident memory so far, in MiB."""
        return self._get([actor.peak_rss_mb.remote() for actor in self._actors], "peak_rss_mb")

    def describe(self) -> dict[str, Any]:
        self.ready()
        return {
            "backend": "ray",
            "workers": self.num_workers,
            "nodes": self.nodes,
            "cpus_per_worker": self.cpus_per_worker,
            "gpus_per_worker": self.gpus_per_worker,
            "pinned": self.pinned,
            "direct_channels": sum(c is not None for c in self._channels),
        }
