"""DMM committees of clients, hosted by the engine.

docs/dmm-design.md, step 8: each round's committee is n clients drawn
publicly from the population (the strategy draws them with ``public_generator(seed, round,
Stream.COMMITTEE)``); the :class:`CommitteeHost` plays those clients' member side
(:class:`protocols.dmm.member.MemberGroup`), keyed by client id, on the engine's one member
host (:class:`fedsim.engine.committee_host.MemberHost`, under :data:`HOSTED`: DMM's member
calls and this module's custody calls): a few Ray actors (``actors=True``; ``shards`` actors,
seat j on actor j mod shards) or this process.

Secrets. The host is the engine's: the front end builds it with where the run's root lies
(:class:`fedsim.randomness.RootSource`) and binds it to the strategy (``bind_committee_host``);
each member actor opens the root in its own process, so neither the host nor the strategy
holds the root, a member's secret or the enrolment authority. Member c's secret is
``root.client(c)`` -- the same secret the client has as a trainer -- made on the actor that
hosts it (:class:`MemberContext`); from it the member
derives its channel keys (``seed_bytes(round, Purpose.KEYS, "dmm", role)``) and its resharing
randomness (``generator(round, Purpose.RESHARE, "dmm")``), and it seals its own state
(:meth:`fedsim.randomness.PartySecret.seal`). Member c is enrolled as ``client/c`` by the
registry's :class:`fedsim.engine.client_registry.Enrolment` (from the same root, on the same
actor): it signs every
channel key it announces, and as a dealer checks the next committee's keys against the
authority before it deals (:class:`protocols.dmm.member.MemberGroup`).

Custody. A member's state (its shares of the open rows' partial sums) is its own: after every
round the host stores each holder's state sealed under that member's secret in a
:class:`fedsim.engine.state.ClientStateStore` keyed by client id and versioned by round
(``DIR/dmm_members.sqlite`` in a run directory), never in the server's checkpoint; the front end
confirms versions with :meth:`CommitteeHost.checkpoint` and returns to one with
:meth:`CommitteeHost.rollback` on ``--resume``, and :meth:`CommitteeHost.restore` re-hosts the
holders with their opened states. Whoever holds the run directory holds only ciphertexts.

Faults. A member's availability follows the run's [faults] (:func:`member_faults`): in each
round each member client drops with probability ``dropout`` at a stage drawn uniformly, and
is late at RELEASE like a straggler past the deadline; the next committee's members drop the
same way. An actor that dies answers nothing: its members count as dropped; a later committee
gets a fresh actor in its place.
"""

from __future__ import annotations

import functools
import io
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.engine.client_registry import (
    NODE_ID_OFFSET,
    Enrolment,
    client_name,
    identity_seed,
    public_names,
)
from fedsim.engine.committee_host import HostedGroups, MemberHost
from fedsim.engine.faults import FaultConfig
from fedsim.engine.hooks import CommitteeHostBound, find
from fedsim.engine.state import ClientStateStore
from fedsim.randomness import (
    PartySecret,
    Purpose,
    RootSource,
    RunSecret,
    Stream,
    public_generator,
)
from protocols.dmm.common import (
    ACTIVE,
    MEMBERS,
    REFUSALS,
    DMMFaults,
    DMMStage,
    MemberCall,
)
from protocols.dmm.member import MemberGroup
from protocols.kit import MemberSide

STATE_FILE = "dmm_members.sqlite"
_MEMBER_FAULTS = 11
STATE_LABEL = b"fedsim/dmm-member-state/v1/"


class CustodyCall(StrEnum):
    """What the engine asks of the members it hosts besides DMM's own calls: each seat's state
    sealed under its own secret, and such states opened and held again."""

    SEAL_STATES = "seal_states"
    LOAD_STATES = "load_states"


HOSTED = MemberSide(
    calls=(MemberCall, CustodyCall),
    silent={**MEMBERS.silent, CustodyCall.SEAL_STATES: None},
    refusals=REFUSALS,
)
"""The hosted members' side: DMM's (:data:`protocols.dmm.common.MEMBERS`) plus custody; a
dead or refusing group seals nothing, and loading states is never silenced."""


def member_faults(
    config: FaultConfig | None,
    server_round: int,
    committee: Sequence[int],
    next_committee: Sequence[int] = (),
) -> DMMFaults:
    """The members' faults of one round from the run's fault model (a public stream per
    (round, client)): each member client drops with probability ``config.dropout`` at a stage
    drawn uniformly from SHARE..RESHARE, or, when it stays, is late at RELEASE when its straggler
    delay exceeds ``deadline_s``; a next-committee client is gone with probability ``dropout``."""
    if config is None:
        return DMMFaults()
    plan: dict[tuple[int, DMMStage], str] = {}
    for seat, client in enumerate(committee):
        rng = public_generator(config.seed, server_round, Stream.FAULTS, _MEMBER_FAULTS, client)
        drop, stage = rng.random() < config.dropout, ACTIVE[int(rng.integers(len(ACTIVE)))]
        slow = rng.random() < config.straggler_fraction
        delay = rng.exponential(config.straggler_delay_s or 1.0)
        if drop:
            plan[(seat, stage)] = "drop"
        elif slow and config.straggler_delay_s and 0 < config.deadline_s < delay:
            plan[(seat, DMMStage.RELEASE)] = "late"
    gone = frozenset(
        seat
        for seat, client in enumerate(next_committee)
        if public_generator(
            config.seed, server_round, Stream.FAULTS, _MEMBER_FAULTS + 1, client
        ).random()
        < config.dropout
    )
    return DMMFaults(member=plan, next_drop=gone)


def encode_member_state(step: int, partials: Mapping[int, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    rows = sorted(partials)
    np.savez(
        buffer,
        step=np.array([step], dtype=np.int64),
        rows=np.array(rows, dtype=np.int64),
        **{f"r{r}": np.asarray(partials[r], dtype=np.int64) for r in rows},
    )
    return buffer.getvalue()


def decode_member_state(data: bytes) -> tuple[int, dict[int, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        rows = [int(r) for r in archive["rows"]]
        return int(archive["step"][0]), {r: archive[f"r{r}"] for r in rows}


class HostedMembers:
    """The seats of one committee on one host, each with its client's own secret.

    Wraps a :class:`protocols.dmm.member.MemberGroup`, to which it supplies the member-side
    randomness from each seat's :class:`fedsim.randomness.PartySecret` (channel keys, resharing
    streams: :class:`protocols.dmm.member.MemberSecrets`), and seals / opens each seat's state
    under it (:class:`CustodyCall`).
    """

    def __init__(
        self, seats, clients, tokens, member_kwargs: Mapping[str, Any], enrolment=None
    ) -> None:
        """``enrolment``: (the authority's public key, each seat's certificate as bytes, the
        run's public (seed, population) or None), or None when the members are enrolled
        nowhere. With the public draw, a dealer deals only to the seats of the next round's
        public committee (:func:`fedsim.engine.client_registry.public_names`)."""
        self.clients = {int(s): int(c) for s, c in zip(seats, clients)}
        self.secrets = {
            int(s): PartySecret.from_token(token, "client") for s, token in zip(seats, tokens)
        }
        enrolled: dict[str, Any] = {}
        if enrolment is not None:
            authority, certificates, *draw = enrolment
            enrolled["authority"] = authority
            if draw and draw[0] is not None:
                seed, population = draw[0]
                enrolled["next_names"] = functools.partial(
                    public_names, int(seed), int(population), int(member_kwargs["n"])
                )
            enrolled["identities"] = {
                int(s): (identity_seed(self.secrets[int(s)]), cert)
                for s, cert in zip(seats, certificates)
            }
        self.group = MemberGroup(seats, **member_kwargs, **enrolled, secrets=self)

    def channel_keys(self, round_: int, role: str) -> dict[int, bytes]:
        return {
            s: secret.seed_bytes(int(round_), Purpose.KEYS, "dmm", role)
            for s, secret in self.secrets.items()
        }

    def reshare_rngs(self, round_: int) -> dict[int, np.random.Generator]:
        return {
            s: secret.generator(int(round_), Purpose.RESHARE, "dmm")
            for s, secret in self.secrets.items()
        }

    def answer(self, call: MemberCall | CustodyCall, args: tuple) -> Any:
        """A member call answered by the group, a custody call here; the committed state in
        the clear (:attr:`MemberCall.SNAPSHOT`) never leaves the host."""
        if call is CustodyCall.SEAL_STATES:
            return self.seal_states(*args)
        if call is CustodyCall.LOAD_STATES:
            return self.load_states(*args)
        if call is MemberCall.SNAPSHOT:
            raise AttributeError(f"{call} is not a member request")
        return self.group.answer(call, args)

    def seal_states(self) -> dict[int, bytes]:
        """client -> its state (step and its own row of every partial sum) sealed under its
        own secret."""
        step, partials = self.group.snapshot()
        out = {}
        for index, seat in enumerate(self.group.seats):
            own = {r: rows[index] for r, rows in partials.items()}
            label = STATE_LABEL + str(self.clients[seat]).encode()
            out[self.clients[seat]] = self.secrets[seat].seal(encode_member_state(step, own), label)
        return out

    def load_states(self, sealed: Mapping[int, bytes], step: int) -> None:
        """Open each seat's sealed state (by client id) and hold it as the state of ``step``;
        seats without one hold zeros and must never be asked (they are not holders)."""
        rows_by_seat = {}
        for seat, client in self.clients.items():
            blob = sealed.get(client)
            if blob is None:
                continue
            data = self.secrets[seat].open(blob, STATE_LABEL + str(client).encode())
            saved_step, own = decode_member_state(data)
            if saved_step != step:
                raise ValueError(
                    f"member client {client}'s stored state is for step {saved_step}, the "
                    f"server's checkpoint for step {step}"
                )
            rows_by_seat[seat] = own
        rows = self.group.schedule.open_after(step - 1)
        zeros = np.zeros(self.group.blocks, dtype=np.int64)
        partials = {
            r: np.stack([rows_by_seat.get(s, {}).get(r, zeros) for s in self.group.seats])
            for r in rows
        }
        self.group.load(step, partials)


class MemberContext:
    """What one host process holds for the DMM members it hosts: the run's root and its
    enrolment authority, made there.

    ``root``: where the run's root lies (a :class:`fedsim.randomness.RootSource`, opened here,
    in the host's own process), the root itself (a caller that holds it), or None (every
    member a fresh OS secret, enrolled nowhere). Member client c's secret is ``root.client(c)``
    and its certificate the run's :class:`fedsim.engine.client_registry.Enrolment`'s, both
    made here: the driver that asks for a committee sends only client ids. ``draw``: the run's
    public (seed, population)."""

    def __init__(self, root: RootSource | RunSecret | None = None, draw=None) -> None:
        self._root = root.open() if isinstance(root, RootSource) else root
        self._enrolment = None if self._root is None else Enrolment(self._root)
        self._draw = draw

    def __reduce__(self):
        raise TypeError("a committee host process is never pickled: it holds the run's root")

    def token(self, client: int) -> str:
        if self._root is None:
            return PartySecret.fresh("client").token()
        return self._root.client(int(client)).token()

    def certificates(self, clients: Sequence[int]) -> tuple | None:
        """The authority's public key, each member client's certificate (``client/c``, its
        identity from its own secret) and the public draw, or None without the run's root."""
        if self._root is None:
            return None
        certificates = [
            self._enrolment.identity(
                client_name(c), self._root.client(int(c))
            ).certificate.to_bytes()
            for c in clients
        ]
        return self._enrolment.public_key, certificates, self._draw


@dataclass(frozen=True)
class SeatsFactory:
    """Builds the :class:`HostedMembers` of ``seats`` (members ``clients``, by client id) where
    they run, from that process's :class:`MemberContext`."""

    seats: tuple[int, ...]
    clients: tuple[int, ...]
    member_kwargs: Mapping[str, Any]

    def __call__(self, context: MemberContext) -> HostedMembers:
        tokens = [context.token(c) for c in self.clients]
        enrolment = context.certificates(self.clients)
        return HostedMembers(
            list(self.seats), list(self.clients), tokens, dict(self.member_kwargs), enrolment
        )


class DMMPool(HostedGroups):
    """One committee (``members``: client ids in seat order) on the host: the pool interface of
    :class:`protocols.dmm.server.DMMServer`, and the members' sealed states."""

    def __init__(self, host: MemberHost, key: str, groups, handles, *, members) -> None:
        super().__init__(host, key, groups, handles)
        self.members = [int(m) for m in members]

    def seal_states(self, seats) -> dict[int, bytes]:
        """client -> sealed state of the live groups' ``seats``."""
        wanted = {self.members[s] for s in seats}
        out: dict[int, bytes] = {}
        for sealed in self.broadcast(CustodyCall.SEAL_STATES):
            out.update({c: b for c, b in (sealed or {}).items() if c in wanted})
        return out


class CommitteeHost:
    """Hosts DMM committee members for one run (the engine side of ``bind_committee_host``),
    on the engine's :class:`fedsim.engine.committee_host.MemberHost`.

    ``secrets``: where the run's root lies (:class:`fedsim.randomness.RootSource`, what the
    front end gives: each member actor opens it in its own process, and the host -- which the
    strategy reaches -- holds only the file's path), the root itself (a caller that holds it,
    e.g. a test), or None (every member gets a fresh OS secret and states cannot be restored);
    ``faults``: the run's fault model for the members; ``actors``: host on Ray actors (Ray must
    be running) or in process; ``shards``: actors; ``store``: the store of the members' sealed
    states (a run's :meth:`fedsim.frontend.rundir.RunDirectory.party_store`, which checkpoints and
    cross-checks it with the run), or ``state_path``: a file for one (None for both: in
    memory; with a source, a file opens only in this process). States are keyed by the
    member's node id.

    **In process there is no isolation** (``actors=False``, or the engine's local backend):
    the members then run beside the server, their secrets and shares in the driver's process,
    which may also open the root file; only member actors keep them from the server.
    """

    def __init__(
        self,
        secrets: RunSecret | None,
        faults: FaultConfig | None = None,
        *,
        actors: bool = False,
        shards: int = 4,
        state_path: str | Path | None = None,
        store: ClientStateStore | None = None,
        ray_module: Any = None,
        draw: tuple[int, int] | None = None,
    ) -> None:
        _check_host_arguments(secrets, shards, draw)
        self._draw = None if draw is None else (int(draw[0]), int(draw[1]))
        #: what each host process gets to open the members' secrets from (never opened here)
        self._root = secrets
        self._restorable = secrets is not None
        self._root_dir: str | None = None
        self.faults = faults if faults is not None and faults.active else None
        self.actors, self.shards = bool(actors), int(shards)
        self.ray = ray_module
        if store is not None and state_path is not None:
            raise ValueError("give the member-state store or its state_path, not both")
        if store is None:
            store = ClientStateStore(
                None if state_path is None else Path(state_path),
                secrets=secrets if isinstance(secrets, RunSecret) else None,
            )
        self.store = store
        if self.actors and self.ray is None:
            import ray  # noqa: PLC0415

            self.ray = ray
        if self.actors and self.ray.is_initialized() and isinstance(secrets, RunSecret):
            self._root_dir = tempfile.mkdtemp(prefix="fedsim-root-")  # a private file for actors
            self._root = RootSource(str(secrets.write(Path(self._root_dir) / "run.root")))
        self._members = MemberHost(
            HOSTED,
            processes=self.shards,
            ray_module=self.ray if self.actors else None,
            context=functools.partial(MemberContext, self._root, self._draw),
        )

    def __reduce__(self):
        raise TypeError("a CommitteeHost is never pickled: its members' states are theirs")

    def pool(self, members: Sequence[int], member_kwargs: Mapping[str, Any]) -> DMMPool:
        """Host a committee of ``members`` (client ids, seat order)."""
        members = [int(m) for m in members]
        if len(set(members)) != len(members):
            raise ValueError(f"members={members}; allowed: distinct client ids")
        groups = [
            [s for s in range(len(members)) if s % self.shards == g]
            for g in range(min(self.shards, len(members)))
        ]
        factories = [
            SeatsFactory(tuple(seats), tuple(members[s] for s in seats), dict(member_kwargs))
            for seats in groups
        ]
        return self._members.open(groups, factories, DMMPool, members=members)

    def member_faults(self, server_round: int, committee, next_committee=()) -> DMMFaults:
        return member_faults(self.faults, server_round, committee, next_committee)

    # ------------------------------------------------------------------ custody
    def persist(self, pool: DMMPool, holders, version: int, forget=()) -> None:
        """Store every holder's state, sealed under its own secret, at ``version``; clients in
        ``forget`` (a retired committee) hold nothing any more."""
        sealed = pool.seal_states(holders)
        gone = {int(c): None for c in forget if int(c) not in sealed}
        states = {NODE_ID_OFFSET + int(c): blob for c, blob in {**gone, **sealed}.items()}
        self.store.put_many(states, version=int(version))

    def restore(self, members, holders, member_kwargs, step: int) -> DMMPool:
        """Re-host a committee whose ``holders`` seats stored their states for ``step``."""
        if not self._restorable:
            raise ValueError(
                "restoring DMM members needs the run's secrets (the RunSecret the run used): "
                "their states are sealed under their own keys"
            )
        pool = self.pool(members, member_kwargs)
        clients = {pool.members[s]: s for s in holders}
        stored = {
            node - NODE_ID_OFFSET: blob
            for node, blob in self.store.get_many([NODE_ID_OFFSET + c for c in clients]).items()
        }
        missing = sorted(set(clients) - set(stored))
        if missing:
            raise ValueError(
                f"{STATE_FILE}: no stored state for DMM member clients {missing} of step {step}"
            )
        loads = [
            ({pool.members[s]: stored[pool.members[s]] for s in seats if s in holders}, int(step))
            for seats in pool.groups
        ]
        pool.call(CustodyCall.LOAD_STATES, loads)
        return pool

    def checkpoint(self, version: int) -> None:
        """Round ``version`` is the server's checkpoint: keep the states it needs."""
        self.store.checkpoint(int(version))

    def cpu_seconds(self) -> float | None:
        """CPU seconds the committee actors have used so far (None in process: the members'
        work is then the caller's own)."""
        return self._members.cpu_seconds()

    def rollback(self, version: int) -> None:
        """Return the member states to round ``version`` (a resumed run)."""
        self.store.rollback(int(version))

    def close(self) -> None:
        """End the actors (their shares go with them) and close the store."""
        self._members.close()
        self.store.close()
        if self._root_dir is not None:
            shutil.rmtree(self._root_dir, ignore_errors=True)
            self._root_dir = None


def _check_host_arguments(secrets, shards, draw) -> None:
    """Raise ``ValueError`` naming the argument a :class:`CommitteeHost` cannot take."""
    if secrets is not None and not isinstance(secrets, RootSource | RunSecret):
        raise ValueError(
            f"secrets is a {type(secrets).__name__}; allowed: RootSource, RunSecret or None"
        )
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r}; allowed: an integer >= 1")
    if draw is not None and (
        len(draw) != 2
        or any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in draw)
        or draw[1] < 1
    ):
        raise ValueError(
            f"draw={draw!r}; allowed: None or the run's public (seed, population) integers"
        )


def committee_host_for(
    strategy: Any,
    secrets: RootSource | RunSecret | None,
    faults: FaultConfig | None,
    store: Callable[[str], ClientStateStore] | None = None,
    draw: tuple[int, int] | None = None,
) -> CommitteeHost | None:
    """The :class:`CommitteeHost` that the first :class:`~fedsim.engine.hooks.CommitteeHostBound`
    layer of the wrapper chain asks for (its ``committee_host_options()``), or None when none
    does. ``store(STATE_FILE)`` gives the member-state store (a run's
    :meth:`~fedsim.frontend.rundir.RunDirectory.party_store`; None: in memory); ``draw``: the run's
    public (seed, population), from which dealers recompute the next committee. The caller binds it
    (:func:`strategies.plumbing.server_secret.bind_parties`)."""
    target = find(strategy, CommitteeHostBound)
    if target is None:
        return None
    options = dict(target.committee_host_options())
    return CommitteeHost(
        secrets, faults, store=None if store is None else store(STATE_FILE), draw=draw, **options
    )
