"""Committee members hosted by the engine: in this process or on Ray actors.

The committee protocol is :mod:`protocols.committee` (shared definitions), its client side
:mod:`protocols.committee.client`, its member side :mod:`protocols.committee.member` and its
server side :mod:`protocols.committee.server` (stage machine, relay, faults, reconstruction).
The engine only hosts the members: :class:`Committee` is the protocol's server with its members'
shards -- each a :class:`protocols.committee.member.CommitteeShard` -- hosted by the engine's one
member host (:class:`fedsim.engine.committee_host.MemberHost`, under the protocol's
:data:`protocols.committee.member.MEMBERS`), in this process or one Ray actor per shard, and
member m's channel key derived per session from its own secret (``member_secrets``,
:class:`fedsim.randomness.PartySecret`), or from the OS CSPRNG.

The run's front end builds the committee a strategy asks for from its :class:`CommitteeSpec`
(:func:`committee_for`) with where the run's root lies (:class:`fedsim.randomness.RootSource`):
each shard opens it where it runs (:class:`RootedShard`) and derives its members' secrets
there. Member m is enrolled as ``member/m`` by the registry's
:class:`fedsim.engine.client_registry.Enrolment` (from the same root, on the same shard): its
shard signs its channel key with its identity, and the clients check every member key before
they seal (:func:`protocols.committee.client.check_member_keys`). Only on Ray actors are the
members' secrets out of the driver's process: committees hosted in process give no isolation.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.engine.client_registry import Enrolment, identity_seed, member_name
from fedsim.engine.committee_host import MemberHost
from fedsim.engine.hooks import CommitteeBound, find
from fedsim.randomness import PartySecret, Purpose, RootSource, RunSecret
from protocols.channels import new_session_id
from protocols.committee.common import check_layout
from protocols.committee.member import MEMBERS, CommitteeShard, shard_arguments
from protocols.committee.server import CommitteeServer
from protocols.field import DEFAULT_FIELD, MersenneField

__all__ = [
    "Committee",
    "CommitteeSpec",
    "RootedShard",
    "ShardFactory",
    "committee_for",
    "member_channel_keys",
]


@dataclass(frozen=True)
class ShardFactory:
    """Builds one shard where it runs: ``shard_class(*arguments)`` (a
    :class:`fedsim.engine.committee_host.MemberFactory`; the host's context is not used)."""

    shard_class: type
    arguments: tuple

    def __call__(self, context: Any) -> CommitteeShard:
        return self.shard_class(*self.arguments)


def member_channel_keys(
    member_secrets: Mapping[int, PartySecret] | None, n: int, session_id: bytes
) -> dict[int, bytes] | None:
    """Each member's channel private key for session ``session_id``, from its own secret
    (``member_secrets[m]`` for every member 0..n-1; None: no keys, the OS CSPRNG's)."""
    if member_secrets is None:
        return None
    if not isinstance(member_secrets, Mapping):
        raise ValueError(
            f"member_secrets must map members to PartySecret, got {type(member_secrets)}"
        )
    missing = [m for m in range(n) if m not in member_secrets]
    wrong = [m for m, s in member_secrets.items() if not isinstance(s, PartySecret)]
    if missing or wrong:
        raise ValueError(
            f"member_secrets must hold a PartySecret for every member 0..{n - 1}"
            f"; missing {missing[:5]}, not a PartySecret {wrong[:5]}"
        )
    label = session_id.hex()
    return {
        m: member_secrets[m].seed_bytes(Purpose.KEYS, "committee-channel", label) for m in range(n)
    }


def member_identities(
    enrolment: Enrolment | None, member_secrets: Mapping[int, PartySecret] | None, n: int
) -> dict[int, tuple[bytes, bytes]] | None:
    """Member m -> (its identity seed, its certificate as ``member/m``), enrolled by
    ``enrolment`` from its own secret (None without an enrolment)."""
    if enrolment is None:
        return None
    if member_secrets is None:
        raise ValueError("enrolment needs member_secrets: each member's identity is its own")
    return {
        m: (
            identity_seed(member_secrets[m]),
            enrolment.identity(member_name(m), member_secrets[m]).certificate.to_bytes(),
        )
        for m in range(n)
    }


class RootedShard(CommitteeShard):
    """A :class:`~protocols.committee.member.CommitteeShard` that makes its members' secrets
    itself: it opens the run's root (``root``: a :class:`fedsim.randomness.RootSource`, or the
    root held by its caller) where it runs -- on a member actor, its own process -- derives
    member m's secret ``root.member(m)``, its channel key for the session and its enrolment
    by the run's :class:`~fedsim.engine.client_registry.Enrolment`, and keeps none but its
    members' keys. Whoever builds it sends only where the root lies."""

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int,
        session_id: bytes,
        root: RootSource | RunSecret,
    ) -> None:
        secrets = root.open() if isinstance(root, RootSource) else root
        own = {int(m): secrets.member(int(m)) for m in members}
        label = session_id.hex()
        keys = {m: s.seed_bytes(Purpose.KEYS, "committee-channel", label) for m, s in own.items()}
        enrolment = Enrolment(secrets)
        identities = {
            m: (identity_seed(s), enrolment.identity(member_name(m), s).certificate.to_bytes())
            for m, s in own.items()
        }
        del secrets, enrolment, own
        super().__init__(members, field_exponent, session_id, keys, identities)


class Committee(CommitteeServer):
    """A committee of ``n`` members with privacy threshold ``t`` and packing ``k``, split into
    ``shards`` groups, each a Ray actor (``ray_module`` given) or an in-process object; the
    protocol is :class:`protocols.committee.server.CommitteeServer`'s.

    ``detect``: extra answers required beyond t + k (see the server). ``member_secrets``:
    member -> its own :class:`~fedsim.randomness.PartySecret`, from which its channel key is
    derived per session (None: keys from the OS CSPRNG). ``shard_class``: the class simulating
    each group (a :class:`~protocols.committee.member.CommitteeShard` subclass plays hostile
    members). ``enrolment``: the registry's authority, which enrols member m (its identity
    from ``member_secrets[m]``) so that its shard signs its channel key (None: the members are
    enrolled nowhere). ``root``: instead of ``member_secrets`` and ``enrolment``, where the
    run's root lies (a :class:`fedsim.randomness.RootSource`): each shard opens it where it runs
    (:class:`RootedShard`), so that with Ray actors the driver never holds a member's secret or
    the authority. In process there is no isolation: the members' keys and shares then lie in
    the driver's process beside the server. A committee is never pickled: its members' keys
    and shares are theirs.
    """

    def __init__(
        self,
        n: int,
        t: int,
        k: int = 1,
        *,
        shards: int = 1,
        detect: int = 1,
        ray_module: Any = None,
        field_: MersenneField = DEFAULT_FIELD,
        member_secrets: Mapping[int, PartySecret] | None = None,
        shard_class: type = CommitteeShard,
        enrolment: Enrolment | None = None,
        root: RootSource | RunSecret | None = None,
    ) -> None:
        check_layout(n, t, k, shards, detect)
        groups = [g.tolist() for g in np.array_split(np.arange(n), shards)]
        session_id = new_session_id()
        if root is not None:
            if member_secrets is not None or enrolment is not None:
                raise ValueError("give the committee root, or member_secrets and enrolment")
            if shard_class is CommitteeShard:
                shard_class = RootedShard
            arguments = [(list(g), field_.exponent, session_id, root) for g in groups]
        else:
            keys = member_channel_keys(member_secrets, n, session_id)
            identities = member_identities(enrolment, member_secrets, n)
            arguments = shard_arguments(groups, field_.exponent, session_id, keys, identities)
        self.host = MemberHost(MEMBERS, processes=len(groups), ray_module=ray_module)
        pool = self.host.open(groups, [ShardFactory(shard_class, tuple(a)) for a in arguments])
        super().__init__(n, t, k, members=pool, session_id=session_id, detect=detect, field_=field_)

    root_dir: str | None = None

    def close(self) -> None:
        """Forget the members (on Ray, their actors are killed) and remove a private root file
        written for them."""
        super().close()
        self.host.close()
        if self.root_dir is not None:
            shutil.rmtree(self.root_dir, ignore_errors=True)
            self.root_dir = None

    @property
    def shards(self) -> list[Any]:
        """The shards holding the members (in-process objects or Ray actor handles)."""
        return self.pool.shards

    def _member_keys(self, member_secrets) -> dict[int, bytes] | None:
        """Each member's channel private key for this session, from its own secret."""
        return member_channel_keys(member_secrets, self.scheme.n, self.session_id)

    def spec(self) -> CommitteeSpec:
        """The :class:`CommitteeSpec` this committee was built to."""
        scheme = self.scheme
        actors = self.host.actors
        return CommitteeSpec(scheme.n, scheme.t, scheme.k, self.detect, len(self.groups), actors)


@dataclass(frozen=True)
class CommitteeSpec:
    """How a run's committee is built (:func:`committee_for`): ``size`` members, privacy
    threshold ``threshold``, ``packing`` secrets per polynomial, ``detect`` extra answers,
    ``shards`` groups, on Ray actors when ``actors`` (Ray must be running)."""

    size: int
    threshold: int
    packing: int = 1
    detect: int = 1
    shards: int = 1
    actors: bool = False

    def __post_init__(self) -> None:
        for name in ("size", "threshold", "packing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}; allowed: an integer")
        if not isinstance(self.actors, bool):
            raise ValueError(f"actors={self.actors!r}; allowed: True or False")
        check_layout(self.size, self.threshold, self.packing, self.shards, self.detect)

    def build(self, secrets: RootSource | RunSecret | None) -> Committee:
        """The committee, member m's channel keys from ``secrets.member(m)`` and its enrolment
        by the run's registry, made where each shard runs (``secrets``: where the run's root
        lies, or the root held by the caller; None: keys from the OS CSPRNG, enrolled
        nowhere). With ``actors`` the driver sends the shards only the root's source."""
        if secrets is not None and not isinstance(secrets, RootSource | RunSecret):
            raise ValueError(
                f"secrets is a {type(secrets).__name__}; allowed: RootSource, RunSecret or None"
            )
        ray_module = None
        if self.actors:
            import ray as ray_module  # noqa: PLC0415

            if not ray_module.is_initialized():
                raise RuntimeError(
                    "committee actors need a running Ray: run with the Ray engine backend, or "
                    "call fedsim.engine.cluster.ensure_ray() first"
                )
        if isinstance(secrets, RunSecret) and not self.actors:  # held here: in process
            return Committee(
                self.size,
                self.threshold,
                self.packing,
                shards=self.shards,
                detect=self.detect,
                member_secrets={m: secrets.member(m) for m in range(self.size)},
                enrolment=Enrolment(secrets),
            )
        root_dir = None
        if isinstance(secrets, RunSecret):  # a root held here: a private file for the actors
            root_dir = tempfile.mkdtemp(prefix="fedsim-root-")
            secrets = RootSource(str(secrets.write(Path(root_dir) / "run.root")))
        committee = Committee(
            self.size,
            self.threshold,
            self.packing,
            shards=self.shards,
            detect=self.detect,
            ray_module=ray_module,
            root=secrets,
        )
        committee.root_dir = root_dir  # removed when the committee closes
        return committee


def committee_for(
    strategy: Any, secrets: RootSource | RunSecret | None
) -> Committee | None:
    """The :class:`Committee` that the first :class:`~fedsim.engine.hooks.CommitteeBound`
    layer of the wrapper chain asks for (its ``committee_spec()``, None: no committee), each
    member with its own secret from the run's root (``secrets``: where it lies), made where the
    member runs; None when no layer asks. The caller binds
    it (:func:`strategies.plumbing.server_secret.bind_parties`) and closes it after the run."""
    target = find(strategy, CommitteeBound)
    spec = None if target is None else target.committee_spec()
    return None if spec is None else spec.build(secrets)
