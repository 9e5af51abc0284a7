"""One host for every protocol's committee members: in this process or on Ray actors.

A protocol declares its member side (:class:`protocols.kit.MemberSide`: the call enums its
members answer, what a gone or refusing member answers, which errors are refusals) and each of
its member groups answers ``answer(call, args)`` (:class:`protocols.kit.Member`). The host
knows nothing more of a protocol: :meth:`MemberHost.open` builds one group per host process
from a picklable factory (called there, with that process's context: e.g. the run's root,
opened in the actor's own process), :meth:`HostedGroups.call` sends a typed call to every group
at once and collects the replies in group order. The host's own fault is silence
(:attr:`protocols.kit.Fault.DROP`): for a call the side lists in ``side.silent``, a group whose
process died, or which refuses (``side.refusals``), answers ``side.silent[call]`` and a dead
group stays silent; any other error reaches the server. The per-member, per-stage faults
(drop, late, tamper) are the protocol's: they travel in its calls' arguments and its members
apply them (a tamper offset is added to what a member holds, a late answer is flagged in its
reply), so the same plan gives the same bytes on every backend.

On Ray each host process is an actor that reserves no CPU (members are light and must not
starve the client workers) and is never restarted: a later committee gets a fresh actor in
place of one that died. In process (``ray_module`` None) each
committee gets fresh host objects: no isolation, the members' secrets lie beside the server.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

from fedsim.engine.allocator import keep_freed_memory
from protocols.kit import LocalMembers, Member, MemberSide

__all__ = ["HostProcess", "HostedGroups", "MemberFactory", "MemberHost"]

MemberFactory = Callable[[Any], Member]
"""Builds one group's members where it runs, from that process's context (picklable)."""


class HostProcess:
    """One host process (a Ray actor, or an object in this process): the member groups of every
    committee it hosts, by key. ``context``: a picklable callable run once here, whose result
    every factory gets (None: factories get None); ``own_process``: an actor's process, whose
    heap keeps its members' freed blocks (:func:`fedsim.engine.allocator.keep_freed_memory`)."""

    def __init__(self, context: Callable[[], Any] | None = None, own_process: bool = False) -> None:
        if own_process:
            keep_freed_memory()
        self.context = None if context is None else context()
        self.hosted: dict[str, Member] = {}

    def __reduce__(self):
        raise TypeError("a committee host process is never pickled: its members' keys are theirs")

    def open(self, key: str, factory: MemberFactory) -> None:
        """Host the group ``factory`` builds as committee ``key``."""
        self.hosted[key] = factory(self.context)

    def answer(self, key: str, call: StrEnum, args: tuple) -> Any:
        return self.hosted[key].answer(call, args)

    def close(self, key: str) -> None:
        self.hosted.pop(key, None)

    def cpu_seconds(self) -> float:
        """CPU seconds this host process has used (its members' work, when it is an actor)."""
        return time.process_time()


class HostedGroups(LocalMembers):
    """One committee's groups on the host: ``groups[g]`` answered by group g on ``handles[g]``
    (an actor handle, or a :class:`HostProcess` in process), under committee ``key``: the pool
    interface every protocol server reaches its members by."""

    def __init__(
        self, host: MemberHost, key: str, groups: Sequence[Sequence[int]], handles: Sequence[Any]
    ) -> None:
        super().__init__(host.side, groups, handles)
        self.host, self.key = host, key
        self.closed = False

    @property
    def handles(self) -> list[Any]:
        return self.objects

    @property
    def shards(self) -> list[Any]:
        """The groups' members: the objects in process, the actor handles on Ray."""
        if self.host.actors:
            return list(self.objects)
        return [handle.hosted[self.key] for handle in self.objects]

    def _submit(self, g: int, call: StrEnum, args: tuple) -> Any:
        handle = self.objects[g]
        if self.host.actors:
            return handle.answer.remote(self.key, call, args)
        return functools.partial(handle.answer, self.key, call, args)

    def _wait(self, pending: Any) -> Any:
        return self.host.ray.get(pending) if self.host.actors else pending()

    def _died(self, g: int, error: BaseException) -> bool:
        if not self.host.is_actor_death(error):
            return False
        self.host.note_dead(self.objects[g])
        return True

    def call(self, call: StrEnum, args_per_group: Sequence[tuple]) -> list[Any]:
        if self.closed:
            raise RuntimeError(f"{call}: committee {self.key} was closed")
        return super().call(call, args_per_group)

    def close(self) -> None:
        """The members forget this committee (its shares go with them)."""
        if self.closed:
            return
        self.closed = True
        if self.host.actors:
            for g, handle in enumerate(self.objects):
                if g not in self.dead:
                    handle.close.remote(self.key)

    def __getstate__(self):
        raise TypeError("a hosted committee is never pickled: its members' shares are theirs")


class MemberHost:
    """Hosts the member groups of one protocol's committees (``side``) on up to ``processes``
    host processes: Ray actors (``ray_module`` given; Ray must be running) or, in process, fresh
    :class:`HostProcess` objects per committee. ``context``: what each host process builds once
    in its own process for the factories (picklable; e.g. opening the run's root)."""

    def __init__(
        self,
        side: MemberSide,
        *,
        processes: int,
        ray_module: Any = None,
        context: Callable[[], Any] | None = None,
    ) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes={processes!r}; allowed: an integer >= 1")
        self.side, self.processes = side, processes
        self.ray, self.context = ray_module, context
        if self.actors and not self.ray.is_initialized():
            raise RuntimeError(
                "committee actors need a running Ray: run with the Ray engine backend, or "
                "call fedsim.engine.cluster.ensure_ray() first"
            )
        self._handles: list[Any] = []
        self._dead: set[int] = set()
        self._count = 0

    @property
    def actors(self) -> bool:
        return self.ray is not None

    def __reduce__(self):
        raise TypeError("a member host is never pickled: its members' states are theirs")

    def is_actor_death(self, error: BaseException) -> bool:
        return self.actors and isinstance(error, self.ray.exceptions.RayActorError)

    def _process(self, g: int) -> Any:
        """Actor g, replaced by a fresh one if it died."""
        while len(self._handles) <= g:
            self._handles.append(self._new_actor())
        if g in self._dead:
            self._handles[g] = self._new_actor()
            self._dead.discard(g)
        return self._handles[g]

    def _new_actor(self) -> Any:
        actor = self.ray.remote(HostProcess).options(num_cpus=0, max_restarts=0)
        return actor.remote(self.context, own_process=True)

    def open(
        self,
        groups: Sequence[Sequence[int]],
        factories: Sequence[MemberFactory],
        pool: type[HostedGroups] = HostedGroups,
        **extra: Any,
    ) -> HostedGroups:
        """Host a committee: group g (``groups[g]``) built by ``factories[g]`` on process g;
        the pool reaching it (``pool`` with ``extra`` keywords)."""
        if len(factories) != len(groups) or len(groups) > self.processes:
            raise ValueError(
                f"{len(factories)} factories for {len(groups)} groups on {self.processes} "
                "processes; allowed: one factory per group, at most one group per process"
            )
        self._count += 1
        key = f"committee-{self._count}"
        handles = []
        for g, factory in enumerate(factories):
            if self.actors:
                handle = self._process(g)
                self.ray.get(handle.open.remote(key, factory))
            else:  # in process: the context is built here (no isolation)
                handle = HostProcess(self.context)
                handle.open(key, factory)
            handles.append(handle)
        return pool(self, key, groups, handles, **extra)

    def note_dead(self, handle: Any) -> None:
        """An actor found dead is replaced for later committees."""
        for g, current in enumerate(self._handles):
            if current is handle:
                self._dead.add(g)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the live actors have used so far (None in process: the members' work is
        then the caller's own)."""
        if not self.actors:
            return None
        live = [h for g, h in enumerate(self._handles) if g not in self._dead]
        return float(sum(self.ray.get([h.cpu_seconds.remote() for h in live])))

    def close(self) -> None:
        """End the actors (their members' keys and shares go with them)."""
        if self.actors and self.ray.is_initialized():  # after a Ray shutdown they are gone
            for handle in self._handles:
                self.ray.kill(handle)
        self._handles = []
