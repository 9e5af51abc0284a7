"""DMM committees whose members are Ray actors.

The distributed matrix mechanism (Bienstock, Kumar & Polychroniadou, ICML 2025;
reference/dmm.md steps 2-6) with every committee member in its own process: each actor runs
:class:`protocols.dmm.DMMMembers` for one group of members (``shards`` groups per committee;
``shards = n``: one actor per member). An actor keeps *its own* members' shares of the noise
state (the window of past noise rows, or the tree nodes) across rounds; it receives the shares the
clients computed and sealed themselves (:func:`protocols.dmm.seal_client_shares`) as
envelopes the server relays, opens and sums them locally, seals its release shares to the
server, and deals its part of the linear resharing to the next committee's actors, which open
and accumulate their deals. The server (:class:`protocols.dmm.DMMCommitteeProtocol`) only
orchestrates the stages, relays envelopes and reconstructs the release, so results, dropout
rules and aborts are those of the in-process committee, bit for bit.

Committees change every round. The actors form two pools of ``shards`` actors that take turns:
the current committee, and the next one, which receives the handoff and then becomes current,
while the old pool is wiped (state and channel keys) and reassigned to the committee after it.
So a round spawns no process, and the outgoing and incoming committees are always different
actors. Actors reserve no CPU (:func:`fedsim.engine.committee.shard_actor`), are never
restarted (a crashed member is a dropped member) and end with :meth:`ActorPool.close`.

An actor that dies (its process crashed or was killed) answers nothing from then on: its
members count as dropped at whatever stage the server next asks them, exactly like injected
member dropouts, and the round aborts only when fewer than t + k members remain.

Checkpoints pickle an :class:`ActorPool` as each group's committed state; unpickling spawns
fresh actors (on first use) that hold that state again (dead groups stay dead).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from fedsim.engine.committee import shard_actor
from protocols.dmm import DMMCommitteeProtocol, DMMMembers, MemberPool


class ActorPool(MemberPool):
    """One committee's member groups, each a :class:`protocols.dmm.DMMMembers` Ray actor.

    ``ray_module``: the ``ray`` module (Ray must be initialised; None imports it).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        member_kwargs: Mapping[str, int],
        ray_module: Any = None,
    ) -> None:
        self.groups = [[int(m) for m in g] for g in groups]
        self.member_kwargs = dict(member_kwargs)
        self._ray = ray_module
        self._saved: list[dict] | None = None
        self.objects: list[Any] = []
        self.dead: set[int] = set()
        self._closed = False
        self._spawn()

    def _spawn(self) -> None:
        if self._ray is None:
            import ray  # noqa: PLC0415

            self._ray = ray
        if not self._ray.is_initialized():
            raise RuntimeError(
                "committee actors need a running Ray: run with the Ray engine backend, or call "
                "fedsim.engine.cluster.ensure_ray() before the first round"
            )
        actor = shard_actor(self._ray, DMMMembers)
        self.objects = [
            None if g in self.dead else actor.remote(group, **self.member_kwargs)
            for g, group in enumerate(self.groups)
        ]
        if self._saved is not None:
            self._ray.get(
                [o.load.remote(s) for o, s in zip(self.objects, self._saved) if o is not None]
            )
            self._saved = None

    def call(self, method: str, args_per_group) -> list:
        """Run ``method`` on every group's actor at once; a group whose actor has died (or died
        earlier) answers :data:`protocols.dmm.DMMMembers.SILENT`: its members are dropped."""
        if self._closed:
            raise RuntimeError(f"{method}: this committee's actors were closed")
        if not self.objects:
            self._spawn()
        futures = [
            None if g in self.dead else getattr(o, method).remote(*a)
            for g, (o, a) in enumerate(zip(self.objects, args_per_group))
        ]
        answers = []
        for g, future in enumerate(futures):
            if future is not None:
                try:
                    answers.append(self._ray.get(future))
                    continue
                except self._ray.exceptions.RayActorError:
                    self.dead.add(g)
            answers.append(DMMMembers.SILENT.get(method))
        return answers

    def close(self) -> None:
        """End the actors (their shares go with them): each exits once its queued calls are
        done, which is Ray's graceful termination."""
        for g, actor in enumerate(self.objects):
            if g not in self.dead:
                actor.__ray_terminate__.remote()
        self.objects, self._closed = [], True

    def __getstate__(self) -> dict:
        saved = self.call("snapshot", [() for _ in self.groups]) if self.objects else self._saved
        return {
            "groups": self.groups,
            "member_kwargs": self.member_kwargs,
            "saved": saved,
            "dead": self.dead,
        }

    def __setstate__(self, state: dict) -> None:
        self.groups, self.member_kwargs = state["groups"], state["member_kwargs"]
        self._saved, self._ray, self.objects = state["saved"], None, []
        self.dead, self._closed = set(state["dead"]), False


def actor_pool_factory(ray_module: Any = None):
    """The ``pool_factory`` of :class:`protocols.dmm.DMMCommitteeProtocol` for actor pools."""
    return functools.partial(ActorPool, ray_module=ray_module)


def actor_committee(
    scheme, noising, dim: int, *, shards: int | None = None, ray_module: Any = None, **kwargs
) -> DMMCommitteeProtocol:
    """A full-mode :class:`protocols.dmm.DMMCommitteeProtocol` whose members are Ray actors,
    ``shards`` per committee (None: one per member); ``kwargs`` go to the protocol."""
    if kwargs.get("mode", "full") != "full":
        raise ValueError(
            f"mode={kwargs['mode']!r} with committee actors; allowed: 'full' (ideal mode has "
            "no shares for members to hold)"
        )
    return DMMCommitteeProtocol(
        scheme,
        noising,
        dim,
        shards=scheme.n if shards is None else shards,
        pool_factory=actor_pool_factory(ray_module),
        **kwargs,
    )
