"""The Ray backend on a warm pool's workers (:mod:`fedsim.engine.warm_pool`).

It leases its workers from the pool's keeper instead of spawning them, resets each before
the run (:meth:`~fedsim.engine.worker_reset.ResettableWorker.reset`: one whose reset fails is
killed and replaced by a fresh worker), and on close resets them again and gives the clean
ones back, so that no idle worker holds a run's modules, state or secrets.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from fedsim.engine.backend import RayBackend
from fedsim.engine.channel import REPLY_TIMEOUT_S
from fedsim.engine.warm_pool import NAMESPACE


class PooledRayBackend(RayBackend):
    """A :class:`RayBackend` whose workers are leased from ``keeper``."""

    _warm_on_spawn = False

    def __init__(
        self,
        keeper: Any,
        num_workers: int | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self._keeper = keeper
        self._names: list[str] = []
        super().__init__(
            num_workers=num_workers,
            cpus_per_worker=cpus_per_worker,
            gpus_per_worker=gpus_per_worker,
            pin_workers=False,
            reply_timeout_s=reply_timeout_s,
        )

    def _check_free(self, num_workers: int, wait_s: float = 5.0) -> None:
        """The pool's warm workers already hold their CPUs: only missing ones need room."""

    def _handle(self, name: str) -> Any:
        return self._ray.get_actor(name, namespace=NAMESPACE)

    def _spawn(self, count: int) -> list[Any]:
        call = self._keeper.lease.remote(
            count, socket.gethostname(), os.getpid(), self.cpus_per_worker, self.gpus_per_worker
        )
        self._names = self._get([call], "lease warm workers")[0]
        actors = [self._handle(name) for name in self._names]
        # every leased worker is reset before the run, whatever its last run left
        reports = self._get([actor.reset.remote() for actor in actors], "reset")
        for index, report in enumerate(reports):
            if not report["ok"]:
                self._names[index] = self._get(
                    [self._keeper.replace.remote(self._names[index])], "replace a worker"
                )[0]
                actors[index] = self._handle(self._names[index])
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        self._get([actor.add_paths.remote(paths) for actor in actors], "add import paths")
        return actors

    def ready(self) -> None:
        # the leased workers are warm already: ``warm_up`` would retake their baseline
        if self._warming is not None:
            self._warming = None
            nodes = self._get([a.ray_node.remote() for a in self._actors], "report its node")
            self.nodes = len(set(nodes))
            self._channels = [self._connect(i) for i in range(len(self._actors))]

    def _replace_actor(self, worker: int) -> Any:
        fresh = self._get([self._keeper.replace.remote(self._names[worker])], "replace")[0]
        self._names[worker] = fresh
        self._actors[worker] = actor = self._handle(fresh)
        return actor

    def restart(self, worker: int, run: bool = True) -> None:
        # the keeper's fresh worker is warm (its baseline taken): no second warm_up
        self.ready()
        channel = self._channels[worker]
        if channel is not None:
            from fedsim.engine.channel import ChannelLost  # noqa: PLC0415

            channel.fail(ChannelLost(f"worker {worker} was replaced"))
        actor = self._replace_actor(worker)
        from collections import OrderedDict  # noqa: PLC0415

        self._sent[worker] = OrderedDict()
        self._finished[worker] = 0.0
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        self._get([actor.add_paths.remote(paths)], "add import paths", [worker])
        if run and self._run is not None:
            self._get([actor.start_run.remote(self._run)], "start the run", [worker])
        self._channels[worker] = self._connect(worker)

    def _reset_workers(self) -> list[bool]:
        clean = super()._reset_workers()
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        self._get([a.add_paths.remote(paths) for a in self._actors], "add import paths")
        return clean

    def _release_actors(self, clean: list[bool]) -> None:
        if not self._names:
            return
        try:
            clean = RayBackend._reset_workers(self)
        except Exception:  # a worker that cannot answer is not given back
            clean = [False] * len(self._names)
        self._get([self._keeper.release.remote(self._names, clean)], "give workers back")
        self._names = []

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        described["warm_pool"] = True
        return described
