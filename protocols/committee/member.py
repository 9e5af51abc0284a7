"""Member side of a committee round: open the clients' sealed shares, sum, seal the release.

:mod:`protocols.committee` steps 1-3 at the members. Members are simulated in groups: one
:class:`CommitteeShard` holds many members and works on all of them at once (an array with one
row per member), with one channel endpoint per member (:mod:`protocols.channels`: X25519 key
from 32 bytes of the member's own secret, or from the OS CSPRNG). A shard answers the typed
calls of :data:`MEMBERS` (:meth:`CommitteeShard.answer`); :class:`protocols.kit.LocalMembers`
hosts a committee's shards in this process, :mod:`fedsim.engine.committee_host` on Ray actors.

1. **SHARE** (:meth:`CommitteeShard.share`): each member opens its envelope of every client's
   :class:`protocols.committee.common.ShardSealedShares`; one that cannot open it, or finds no
   ``width`` field elements in it (unusable key, unauthenticated, replayed, wrong round or stage,
   wrong length, dtype or range), refuses it and the server leaves the client out;
2. **COMBINE** (:meth:`CommitteeShard.combine`): each online member sums its rows of the
   clients the server names, mod p;
3. **RELEASE** (:meth:`CommitteeShard.release`): each member that answers seals its summed row
   for the server.

Faults (:class:`protocols.committee.common.StageFaults`, per stage): a member that **drops** is
silent from then on; one that is **late** answers after the deadline; one that **tampers** adds a
random non-zero offset (drawn from the faults' public seed) to what it holds (SHARE, COMBINE)
or sends (RELEASE). Rounds are independent; :meth:`CommitteeShard.abort` ends one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protocols.channels import SERVER_ID, Endpoint
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    CommitteeCall,
    CommitteeStage,
    ReleaseAnswer,
    ShardSealedShares,
    ShareAnswer,
    StageFaults,
    check_transition,
)
from protocols.enrolment import Certificate, Identity
from protocols.field import MersenneField
from protocols.kit import MEMBER_ID_BASE, MemberSide, answer_by

MEMBERS = MemberSide(calls=(CommitteeCall,))
"""The committee's member side: shards answer :class:`CommitteeCall`; none is ever silenced
(a shard's error, or its actor's death, reaches the server)."""


class CommitteeShard:
    """Members ``members`` (global indices) of one committee, held as one array per client.

    A plain class, hosted in process or on a Ray actor by the engine. Rounds are independent:
    each has its own stored rows, summed state and stage, and :meth:`abort` ends one.
    ``session_id``: the committee's channel session; ``private_keys``: member -> 32 bytes of
    that member's own secret for its channel key (else the OS CSPRNG); ``identities``:
    member -> (32-byte seed of its Ed25519 identity, its enrolment certificate as bytes),
    with which it signs its channel key (:meth:`key_proofs`; None: enrolled nowhere).
    """

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int,
        session_id: bytes,
        private_keys: Mapping[int, bytes] | None = None,
        identities: Mapping[int, tuple[bytes, bytes]] | None = None,
    ):
        self.members = np.asarray(members, dtype=np.int64)
        self.field = MersenneField(field_exponent)
        keys = private_keys or {}
        self._endpoints = {
            int(m): Endpoint(
                MEMBER_ID_BASE + int(m), session_id, CHANNEL_PROTOCOL, keys.get(int(m))
            )
            for m in self.members
        }
        self._proofs = {
            int(m): Identity.from_seed(seed, Certificate.from_bytes(certificate)).prove(
                CHANNEL_PROTOCOL,
                session_id,
                MEMBER_ID_BASE + int(m),
                (self._endpoints[int(m)].public_key,),
            )
            for m, (seed, certificate) in (identities or {}).items()
        }
        self._rows: dict[int, dict[int, np.ndarray]] = {}
        self._width: dict[int, int] = {}
        self._sum: dict[int, np.ndarray] = {}
        self._offline: dict[int, set[int]] = {}
        self._stage: dict[int, CommitteeStage] = {}

    def answer(self, call: CommitteeCall, args: tuple) -> Any:
        """The handler of ``call`` with ``args`` (:class:`protocols.kit.Member`)."""
        handlers = {
            CommitteeCall.ABORT: self.abort,
            CommitteeCall.COMBINE: self.combine,
            CommitteeCall.CONNECT: self.connect,
            CommitteeCall.KEY_PROOFS: self.key_proofs,
            CommitteeCall.PUBLIC_KEYS: self.public_keys,
            CommitteeCall.RELEASE: self.release,
            CommitteeCall.SHARE: self.share,
        }
        return answer_by(handlers, call, args)

    def _enter(self, round_: int, target: CommitteeStage) -> None:
        current = self._stage.get(round_, CommitteeStage.SETUP)
        check_transition(
            current, target, f"committee shard {self.members[:1].tolist()}.. round {round_}"
        )
        self._stage[round_] = target

    def stage(self, round_: int) -> CommitteeStage:
        """Where this shard stands in ``round_`` (SETUP before its first message)."""
        return self._stage.get(round_, CommitteeStage.SETUP)

    def _tamper(self, rows: np.ndarray, who: frozenset[int], seed: int, salt: int) -> np.ndarray:
        hit = np.isin(self.members, list(who))
        if not hit.any():
            return rows
        rng = np.random.default_rng([seed, salt, int(self.members[0])])
        offset = rng.integers(1, self.field.modulus, size=(int(hit.sum()), rows.shape[1]))
        rows = rows.copy()
        rows[hit] = self.field.add(rows[hit], offset)
        return rows

    def public_keys(self) -> dict[int, bytes]:
        """Each member's channel public key."""
        return {m: e.public_key for m, e in self._endpoints.items()}

    def key_proofs(self) -> dict[int, bytes]:
        """Each enrolled member's proof of its channel key (empty when enrolled nowhere)."""
        return dict(self._proofs)

    def connect(self, party_id: int, public_key: bytes) -> None:
        """Every member opens a channel with ``party_id`` (the server, or a client)."""
        for endpoint in self._endpoints.values():
            endpoint.connect(party_id, public_key)

    def _open(
        self, round_: int, client: int, sealed: ShardSealedShares, width: int
    ) -> tuple[np.ndarray, list[int]]:
        """One client's sealed rows, opened and checked by each member; a member that cannot
        open its envelope, or finds no ``width`` field elements in it, refuses it (its row
        stays 0 and the driver leaves the client out). Returns the rows and who refused."""
        rows = np.zeros((self.members.size, width), dtype=np.int64)
        refused = []
        for index, (member, envelope) in enumerate(zip(self.members, sealed.envelopes)):
            endpoint = self._endpoints[int(member)]
            try:
                endpoint.connect(client, sealed.public_key)
                opened = endpoint.open_array(
                    envelope, round_=round_, stage=CommitteeStage.SHARE, sender=client
                )
                rows[index] = self.field.vector(opened, width, f"share from client {client}")
            except ValueError:  # ChannelError is a ValueError
                refused.append(int(member))
        return rows, refused

    def _client_rows(self, round_: int, client: int, delivered: Any) -> tuple[np.ndarray, list]:
        """SHARE for one client: its rows for this shard (zeros where refused) and the members
        that refused them: a sealed share that does not open or is malformed is refused by its
        member; a delivery that is not one sealed envelope per member of ``width`` elements
        (plain rows included: members take only sealed shares), by every member."""
        width = self._width.setdefault(round_, _width_of(delivered))
        if (
            not isinstance(delivered, ShardSealedShares)
            or not isinstance(delivered.envelopes, tuple | list)
            or len(delivered.envelopes) != self.members.size
            or delivered.width != width
        ):
            everyone = [int(m) for m in self.members]
            return np.zeros((self.members.size, width), dtype=np.int64), everyone
        return self._open(round_, client, delivered, width)

    def share(
        self,
        round_: int,
        shares: Mapping[int, Any],
        faults: StageFaults,
        width: int | None = None,
    ) -> dict:
        """SHARE handler: store this shard's rows of each client's shares (``shares[client]``:
        a :class:`ShardSealedShares`; ``width`` field elements per row, by default that of the first
        client); returns the members still online and, per client, the online members that
        refused its share."""
        self._enter(round_, CommitteeStage.SHARE)
        if width is not None:
            self._width[round_] = int(width)
        offline = self._offline.setdefault(round_, set()) | set(faults.drop)
        self._offline[round_] = offline
        stored = self._rows.setdefault(round_, {})
        refused: dict[int, list[int]] = {}
        for client, delivered in shares.items():
            rows, bad = self._client_rows(round_, int(client), delivered)
            bad = [m for m in bad if m not in offline]
            if bad:
                refused[int(client)] = bad
            stored[int(client)] = self._tamper(rows, faults.tamper, faults.seed, int(client))
        online = [int(m) for m in self.members if m not in offline]
        return ShareAnswer(online, refused).to_record()

    def combine(self, round_: int, clients: Sequence[int], faults: StageFaults) -> list[int]:
        """COMBINE: each online member sums its rows of ``clients`` (all at once, mod p)."""
        self._enter(round_, CommitteeStage.COMBINE)
        self._offline[round_] |= set(faults.drop)
        stored = self._rows.pop(round_, {})
        missing = [c for c in clients if c not in stored]
        if missing:
            raise ValueError(f"clients {missing[:5]} were never shared with this shard")
        if clients:
            total = self.field.sum(np.stack([stored[c] for c in clients]), axis=0)
        else:
            total = np.zeros((self.members.size, self._width.get(round_, 0)), dtype=np.int64)
        self._sum[round_] = self._tamper(total, faults.tamper, faults.seed, 2**62 + 1)
        return [int(m) for m in self.members if m not in self._offline[round_]]

    def release(self, round_: int, faults: StageFaults) -> dict[str, Any]:
        """RELEASE: the summed rows of the members that answer, and who answered late."""
        self._enter(round_, CommitteeStage.RELEASE)
        offline = self._offline.pop(round_) | set(faults.drop)
        total = self._tamper(self._sum.pop(round_), faults.tamper, faults.seed, 2**62 + 2)
        self._width.pop(round_, None)
        keep = np.array([m not in offline for m in self.members], dtype=bool)
        self._stage[round_] = CommitteeStage.DONE
        members = self.members[keep].tolist()
        rows: Any = total[keep]
        if self._endpoints:
            rows = [
                self._endpoints[m].seal_array(SERVER_ID, round_, CommitteeStage.RELEASE, row)
                for m, row in zip(members, rows)
            ]
        late = [int(m) for m in self.members[keep] if m in faults.late]
        return ReleaseAnswer(members, rows, late).to_record()

    def abort(self, round_: int) -> None:
        """The driver aborted ``round_``: drop everything of it and leave it ABORTED."""
        for store in (self._rows, self._width, self._sum, self._offline):
            store.pop(round_, None)
        self._stage[round_] = CommitteeStage.ABORTED


def _width_of(delivered: Any) -> int:
    """Elements per row that a client's delivery claims (0 when it claims nothing usable)."""
    width = delivered.width if isinstance(delivered, ShardSealedShares) else 0
    return int(width) if isinstance(width, int | np.integer) and width >= 0 else 0


def shard_arguments(
    groups: Sequence[Sequence[int]],
    field_exponent: int,
    session_id: bytes,
    private_keys: Mapping[int, bytes] | None,
    identities: Mapping[int, tuple[bytes, bytes]] | None = None,
) -> list[tuple]:
    """The :class:`CommitteeShard` constructor arguments of each group: its members, the field
    exponent, the channel session, its members' channel keys (None: from the OS CSPRNG) and
    their enrolled identities (None: enrolled nowhere)."""
    return [
        (
            list(g),
            field_exponent,
            session_id,
            private_keys and {m: private_keys[m] for m in g},
            identities and {m: identities[m] for m in g},
        )
        for g in groups
    ]
