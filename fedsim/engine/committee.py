"""Committee members as actors: packed Shamir shares in, a reconstructed sum out, under faults.

A committee of ``n`` members holds packed Shamir shares (:mod:`protocols.shamir`, privacy
threshold ``t``, ``k`` secrets per polynomial) of the clients' field vectors. One round:

1. **SHARE**: each client's vector is shared; member j receives row j of every client's shares;
2. **COMBINE**: the members agree (on the driver's list) on the clients whose shares reached
   every live member, and each sums its rows of those clients locally: shares of sum_i x_i;
3. **RELEASE**: members send their summed rows; the server reconstructs from the answers.

Transport (``encrypt=True``, the default): every share travels over an authenticated encrypted
channel (:mod:`protocols.channels`: X25519, HKDF, ChaCha20-Poly1305, bound to sender, receiver,
round and stage) relayed by the server, which counts bytes in a transcript: client -> member in
SHARE, member -> server in RELEASE. A share that fails authentication (``corrupt_in_transit``:
the relay flips a byte) is refused by its receiver; the members then leave that client out of
the sum (it is named in :attr:`CommitteeResult.excluded`), and a release that fails is not
counted as an answer.

Members are simulated in groups: one :class:`CommitteeShard` holds many members and works on
all of them at once (an array with one row per member), and runs as a Ray actor (no CPU
reserved: shards are light and must not starve the client workers) or in process.

Faults are drawn per member and per stage (:class:`CommitteeFaults`): a member that **drops**
at a stage is silent from then on; one that is **late** at a stage answers after the deadline,
so its share does not count this round (nothing sleeps); one that **tampers** adds a random
non-zero offset to what it holds (SHARE, COMBINE) or sends (RELEASE).

Outcomes. The server needs ``t + k + detect`` answers: ``t + k`` to reconstruct and ``detect``
more so that up to ``detect`` tampered shares always break the degree check. Fewer answers ->
:class:`CommitteeAbort` (a :class:`protocols.secagg.TooManyDropoutsError`) naming how many were
needed and how many answered; the round is dropped and earlier rounds' results stay in
:attr:`Committee.history`. Inconsistent shares are never reconstructed silently: if the faulty
members can be singled out (unique decoding, ``m >= t + k + 2e``) and enough others answered,
the sum is reconstructed without them and the result names them; otherwise
:class:`TamperingDetected` is raised naming the blocks (and suspects, if any).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.channels import SERVER_ID, ChannelError, Endpoint, Envelope, Relay, new_session_id
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.secagg import TooManyDropoutsError, check_move
from protocols.shamir import InconsistentSharesError, PackedShamir


class CommitteeStage(enum.Enum):
    """Stages of one committee round, in order; ABORTED is reachable from every live stage."""

    SETUP = 0
    SHARE = 1
    COMBINE = 2
    RELEASE = 3
    DONE = 4
    ABORTED = 5


TRANSITIONS: dict[CommitteeStage, frozenset[CommitteeStage]] = {
    CommitteeStage.SETUP: frozenset({CommitteeStage.SHARE, CommitteeStage.ABORTED}),
    CommitteeStage.SHARE: frozenset({CommitteeStage.COMBINE, CommitteeStage.ABORTED}),
    CommitteeStage.COMBINE: frozenset({CommitteeStage.RELEASE, CommitteeStage.ABORTED}),
    CommitteeStage.RELEASE: frozenset({CommitteeStage.DONE, CommitteeStage.ABORTED}),
    CommitteeStage.DONE: frozenset(),
    CommitteeStage.ABORTED: frozenset(),
}

ACTIVE_STAGES = (CommitteeStage.SHARE, CommitteeStage.COMBINE, CommitteeStage.RELEASE)


def check_transition(current: CommitteeStage, target: CommitteeStage, who: str) -> None:
    """Raise :class:`protocols.secagg.StageError` unless ``current -> target`` is allowed."""
    check_move(TRANSITIONS, current, target, who)


MEMBER_ID_BASE = 2**62
"""Channel party id of member j: MEMBER_ID_BASE + j (clients use their own ids below it)."""


class MemberFault(enum.Enum):
    DROP = "drop"
    LATE = "late"
    TAMPER = "tamper"


class CommitteeAbort(TooManyDropoutsError):
    """Too few members answered; ``needed`` and ``answered`` say how many."""

    def __init__(self, message: str, needed: int, answered: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.answered = answered


class TamperingDetected(RuntimeError):
    """Released shares do not lie on one polynomial and the culprits cannot be removed."""

    def __init__(self, message: str, blocks: np.ndarray, suspects: tuple[int, ...]) -> None:
        super().__init__(message)
        self.blocks = blocks
        self.suspects = suspects


@dataclass(frozen=True)
class CommitteeFaults:
    """Which member misbehaves at which stage: ``plan[(member, stage)] = fault``.

    ``seed`` drives the tampering offsets, so a faulty round is reproducible;
    ``corrupt_in_transit`` lists (client, member) pairs whose sealed share the relay alters.
    """

    plan: Mapping[tuple[int, CommitteeStage], MemberFault] = field(default_factory=dict)
    seed: int = 0
    corrupt_in_transit: frozenset[tuple[int, int]] = frozenset()

    def __post_init__(self) -> None:
        for (member, stage), fault in self.plan.items():
            if stage not in ACTIVE_STAGES:
                raise ValueError(
                    f"plan has stage {stage!r} for member {member}; allowed: "
                    f"{[s.name for s in ACTIVE_STAGES]}"
                )
            if not isinstance(fault, MemberFault):
                raise ValueError(f"plan[({member}, {stage.name})] = {fault!r}; use a MemberFault")

    @classmethod
    def random(
        cls,
        members: int,
        rng: np.random.Generator,
        *,
        drop: float = 0.0,
        late: float = 0.0,
        tamper: float = 0.0,
        stages: Sequence[CommitteeStage] = ACTIVE_STAGES,
    ) -> CommitteeFaults:
        """Each (member, stage) independently drops, is late or tampers with the given
        probabilities (a member's first fault wins; later stages of a dropped member are moot)."""
        for name, value in (("drop", drop), ("late", late), ("tamper", tamper)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} must be a probability in [0, 1]")
        if drop + late + tamper > 1:
            raise ValueError(f"drop + late + tamper = {drop + late + tamper} exceeds 1")
        plan: dict[tuple[int, CommitteeStage], MemberFault] = {}
        for member in range(members):
            for stage in stages:
                u = rng.random()
                if u < drop:
                    plan[(member, stage)] = MemberFault.DROP
                    break
                if u < drop + late:
                    plan[(member, stage)] = MemberFault.LATE
                elif u < drop + late + tamper:
                    plan[(member, stage)] = MemberFault.TAMPER
        return cls(plan, int(rng.integers(2**32)))

    def members_with(self, fault: MemberFault, stage: CommitteeStage) -> set[int]:
        return {m for (m, s), f in self.plan.items() if s == stage and f == fault}


@dataclass(frozen=True)
class StageFaults:
    """The faults of one stage, as sets of member indices, shipped to the shards."""

    drop: frozenset[int] = frozenset()
    late: frozenset[int] = frozenset()
    tamper: frozenset[int] = frozenset()
    seed: int = 0


class CommitteeShard:
    """Members ``members`` (global indices) of one committee, held as one array per client.

    A plain class; :func:`shard_actor` makes it a Ray actor. Rounds are independent: each has
    its own stored rows, summed state and stage, and :meth:`forget` drops one.
    """

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int = DEFAULT_FIELD.exponent,
        session_id: bytes | None = None,
    ):
        self.members = np.asarray(members, dtype=np.int64)
        self.field = MersenneField(field_exponent)
        self._endpoints = (
            {}
            if session_id is None
            else {int(m): Endpoint(MEMBER_ID_BASE + int(m), session_id) for m in self.members}
        )
        self._rows: dict[int, dict[int, np.ndarray]] = {}
        self._sum: dict[int, np.ndarray] = {}
        self._offline: dict[int, set[int]] = {}
        self._stage: dict[int, CommitteeStage] = {}

    def _enter(self, round_: int, target: CommitteeStage) -> None:
        current = self._stage.get(round_, CommitteeStage.SETUP)
        check_transition(
            current, target, f"committee shard {self.members[:1].tolist()}.. round {round_}"
        )
        self._stage[round_] = target

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
        """Each member's channel public key (empty without encryption)."""
        return {m: e.public_key for m, e in self._endpoints.items()}

    def connect(self, party_id: int, public_key: bytes) -> None:
        """Every member opens a channel with ``party_id`` (the server, or a client)."""
        for endpoint in self._endpoints.values():
            endpoint.connect(party_id, public_key)

    def _open(
        self, round_: int, client: int, sealed: SealedShares
    ) -> tuple[np.ndarray, list[int]]:
        rows = np.zeros((self.members.size, sealed.width), dtype=np.int64)
        refused = []
        for index, (member, envelope) in enumerate(zip(self.members, sealed.envelopes)):
            endpoint = self._endpoints[int(member)]
            try:
                endpoint.connect(client, sealed.public_key)
                opened = endpoint.open_array(
                    envelope, round_=round_, stage=CommitteeStage.SHARE, sender=client
                )
                rows[index] = self.field.asarray(opened, "share")
            except (ChannelError, ValueError):
                refused.append(int(member))
        return rows, refused

    def share(self, round_: int, shares: Mapping[int, Any], faults: StageFaults) -> dict:
        """SHARE: store this shard's rows of each client's shares (``shares[client]``: an array
        with one row per member of the shard, or :class:`SealedShares`); returns the members
        still online and, per client, the online members that refused its share."""
        self._enter(round_, CommitteeStage.SHARE)
        offline = self._offline.setdefault(round_, set()) | set(faults.drop)
        self._offline[round_] = offline
        stored = self._rows.setdefault(round_, {})
        refused: dict[int, list[int]] = {}
        for client, rows in shares.items():
            if isinstance(rows, SealedShares):
                if not self._endpoints:
                    raise ValueError("sealed shares sent to a shard without encryption")
                rows, bad = self._open(round_, int(client), rows)
                bad = [m for m in bad if m not in offline]
                if bad:
                    refused[int(client)] = bad
            rows = self.field.asarray(rows, f"shares[{client}]")
            if rows.shape[0] != self.members.size:
                raise ValueError(
                    f"shares[{client}] has {rows.shape[0]} rows for {self.members.size} members"
                )
            stored[int(client)] = self._tamper(rows, faults.tamper, faults.seed, int(client))
        return {"online": [int(m) for m in self.members if m not in offline], "refused": refused}

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
            width = next(iter(stored.values())).shape[1] if stored else 0
            total = np.zeros((self.members.size, width), dtype=np.int64)
        self._sum[round_] = self._tamper(total, faults.tamper, faults.seed, 2**62 + 1)
        return [int(m) for m in self.members if m not in self._offline[round_]]

    def release(self, round_: int, faults: StageFaults) -> dict[str, Any]:
        """RELEASE: the summed rows of the members that answer, and who answered late."""
        self._enter(round_, CommitteeStage.RELEASE)
        offline = self._offline.pop(round_) | set(faults.drop)
        total = self._tamper(self._sum.pop(round_), faults.tamper, faults.seed, 2**62 + 2)
        keep = np.array([m not in offline for m in self.members], dtype=bool)
        self._stage[round_] = CommitteeStage.DONE
        members = self.members[keep].tolist()
        rows: Any = total[keep]
        if self._endpoints:
            rows = [
                self._endpoints[m].seal_array(SERVER_ID, round_, CommitteeStage.RELEASE, row)
                for m, row in zip(members, rows)
            ]
        return {
            "members": members,
            "rows": rows,
            "late": [int(m) for m in self.members[keep] if m in faults.late],
        }

    def forget(self, round_: int) -> None:
        """Drop everything of ``round_`` (after an abort)."""
        for store in (self._rows, self._sum, self._offline, self._stage):
            store.pop(round_, None)


@dataclass(frozen=True)
class SealedShares:
    """One client's shares for the members of a shard, one envelope each (shard order)."""

    public_key: bytes
    envelopes: tuple[Envelope, ...]
    width: int


def shard_actor(ray_module: Any, shard_class: type = CommitteeShard) -> Any:
    """``shard_class`` (:class:`CommitteeShard` by default) as a Ray actor class that reserves
    no CPU and is not restarted (a crashed member is a dropped member)."""
    return ray_module.remote(shard_class).options(num_cpus=0, max_restarts=0)


@dataclass(frozen=True)
class CommitteeResult:
    """One released round: the sum (field elements), whose inputs it holds, and the members
    that answered, were late, or were caught tampering (and left out)."""

    round: int
    aggregate: np.ndarray
    clients: tuple[int, ...]
    answered: tuple[int, ...]
    late: tuple[int, ...]
    dropped: tuple[int, ...]
    tampered: tuple[int, ...]
    excluded: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()


class Committee:
    """A committee of ``n`` members with privacy threshold ``t`` and packing ``k``, split into
    ``shards`` groups, each a Ray actor (``ray_module`` given) or an in-process object.

    ``detect``: extra answers required beyond t + k, so that up to ``detect`` tampered shares
    are always detected (0 trusts every answer). ``encrypt``: shares travel over authenticated
    encrypted channels through :attr:`relay`, whose transcript counts the bytes.
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
        encrypt: bool = True,
    ) -> None:
        self.scheme = PackedShamir(n=n, t=t, k=k, field=field_)
        if not isinstance(shards, int) or not 1 <= shards <= n:
            raise ValueError(f"shards={shards!r} must be an integer in [1, n={n}]")
        if not isinstance(detect, int) or detect < 0 or self.scheme.threshold + detect > n:
            raise ValueError(
                f"detect={detect!r} must be an integer >= 0 with t + k + detect <= n "
                f"(t + k = {self.scheme.threshold}, n = {n})"
            )
        self.detect = detect
        self.groups = [g.tolist() for g in np.array_split(np.arange(n), shards)]
        self._ray = ray_module
        self.encrypt = encrypt
        self.session_id = new_session_id() if encrypt else None
        if ray_module is not None:
            actor = shard_actor(ray_module)
            self.shards = [actor.remote(g, field_.exponent, self.session_id) for g in self.groups]
        else:
            self.shards = [CommitteeShard(g, field_.exponent, self.session_id) for g in self.groups]
        self.history: dict[int, CommitteeResult] = {}
        self.relay = Relay()
        self.member_keys: dict[int, bytes] = {}
        if encrypt:
            self._server = Endpoint(SERVER_ID, self.session_id)
            for part in self._call("public_keys", [() for _ in self.groups]):
                self.member_keys.update(part)
            for member, key in sorted(self.member_keys.items()):
                self.relay.publish(MEMBER_ID_BASE + member, key)
                self._server.connect(MEMBER_ID_BASE + member, key)
            self._call("connect", [(SERVER_ID, self._server.public_key) for _ in self.groups])

    @property
    def needed(self) -> int:
        """Answers the server needs: t + k + detect."""
        return self.scheme.threshold + self.detect

    def _call(self, method: str, args_per_shard: list[tuple]) -> list[Any]:
        if self._ray is None:
            return [getattr(s, method)(*a) for s, a in zip(self.shards, args_per_shard)]
        futures = [getattr(s, method).remote(*a) for s, a in zip(self.shards, args_per_shard)]
        return self._ray.get(futures)

    def close(self) -> None:
        if self._ray is not None:
            for shard in self.shards:
                self._ray.kill(shard)
        self.shards = []

    def run_round(
        self,
        round_: int,
        inputs: Mapping[int, np.ndarray],
        rng: np.random.Generator | None,
        faults: CommitteeFaults | None = None,
    ) -> CommitteeResult:
        """Share every client's vector (randomness from ``rng``, or from the OS CSPRNG when
        ``rng`` is None), combine, release, reconstruct sum_i inputs[i] mod p. Raises
        :class:`CommitteeAbort` or :class:`TamperingDetected`."""
        if round_ in self.history:
            raise ValueError(f"round {round_} was already released")
        if not inputs:
            raise ValueError("inputs is empty: no client to aggregate")
        faults = faults or CommitteeFaults()
        field_ = self.scheme.field
        vectors = {int(c): field_.asarray(v, f"inputs[{c}]").ravel() for c, v in inputs.items()}
        lengths = {v.size for v in vectors.values()}
        if len(lengths) != 1:
            raise ValueError(f"inputs have different lengths {sorted(lengths)}")
        length = lengths.pop()
        per_stage = {
            stage: StageFaults(
                drop=frozenset(faults.members_with(MemberFault.DROP, stage)),
                late=frozenset(faults.members_with(MemberFault.LATE, stage)),
                tamper=frozenset(faults.members_with(MemberFault.TAMPER, stage)),
                seed=faults.seed,
            )
            for stage in ACTIVE_STAGES
        }
        try:
            shares = {
                c: self.scheme.share(v, rng=rng)
                if rng is not None
                else self.scheme.share(v, secure=True)
                for c, v in vectors.items()
            }
            if self.encrypt:
                outgoing = self._seal_shares(round_, shares, faults.corrupt_in_transit)
            else:
                outgoing = [{c: s[g] for c, s in shares.items()} for g in self.groups]
            answers = self._call(
                "share",
                [(round_, part, per_stage[CommitteeStage.SHARE]) for part in outgoing],
            )
            late_share = per_stage[CommitteeStage.SHARE].late
            online_members = sorted(
                m for part in answers for m in part["online"] if m not in late_share
            )
            self._require(len(online_members), CommitteeStage.SHARE, round_)
            # a client counts when its shares reached every member that is online and on time
            excluded = {
                c for part in answers for c, who in part["refused"].items() if set(who) - late_share
            }
            clients = tuple(sorted(set(vectors) - excluded))
            self._call(
                "combine",
                [(round_, list(clients), per_stage[CommitteeStage.COMBINE]) for _ in self.groups],
            )
            released = self._call(
                "release", [(round_, per_stage[CommitteeStage.RELEASE]) for _ in self.groups]
            )
            late = set(late_share) | per_stage[CommitteeStage.COMBINE].late
            late |= {m for part in released for m in part["late"]}
            members, rows, rejected = [], [], []
            for part in released:
                for member, row in zip(part["members"], part["rows"]):
                    if member in late:
                        continue
                    if isinstance(row, Envelope):
                        self.relay.post(row)
                        self.relay.deliver(SERVER_ID)
                        try:
                            row = self.field_array(
                                self._server.open_array(
                                    row,
                                    round_=round_,
                                    stage=CommitteeStage.RELEASE,
                                    sender=MEMBER_ID_BASE + member,
                                )
                            )
                        except (ChannelError, ValueError):
                            rejected.append(member)
                            continue
                    members.append(member)
                    rows.append(row)
            self._require(len(members), CommitteeStage.RELEASE, round_)
            aggregate, tampered = self._reconstruct(np.stack(rows), members, length, round_)
        except BaseException:
            self._call("forget", [(round_,) for _ in self.groups])
            raise
        dropped = tuple(sorted(set(range(self.scheme.n)) - set(members) - late - set(rejected)))
        result = CommitteeResult(
            round_,
            aggregate,
            clients,
            tuple(m for m in members if m not in tampered),
            tuple(sorted(late)),
            dropped,
            tampered,
            tuple(sorted(excluded)),
            tuple(sorted(rejected)),
        )
        self.history[round_] = result
        return result

    def field_array(self, values: np.ndarray) -> np.ndarray:
        return self.scheme.field.asarray(values, "released share")

    def _seal_shares(
        self, round_: int, shares: dict[int, np.ndarray], corrupt: frozenset[tuple[int, int]]
    ) -> list[dict[int, SealedShares]]:
        """Each client seals row j of its shares for member j; the relay carries (and counts)
        the envelopes, altering those in ``corrupt``; returns each shard's deliveries."""
        keys = {}
        for client, rows in shares.items():
            endpoint = Endpoint(client, self.session_id)
            keys[client] = endpoint.public_key
            for member in range(self.scheme.n):
                party = MEMBER_ID_BASE + member
                endpoint.connect(party, self.member_keys[member])
                envelope = endpoint.seal_array(party, round_, CommitteeStage.SHARE, rows[member])
                if (client, member) in corrupt:
                    flipped = bytes([envelope.ciphertext[0] ^ 1]) + envelope.ciphertext[1:]
                    envelope = Envelope(
                        envelope.sender,
                        envelope.receiver,
                        envelope.round,
                        envelope.stage,
                        envelope.nonce,
                        flipped,
                    )
                self.relay.post(envelope)
        inbox = {
            member: {e.sender: e for e in self.relay.deliver(MEMBER_ID_BASE + member)}
            for member in range(self.scheme.n)
        }
        width = next(iter(shares.values())).shape[1]
        return [
            {
                client: SealedShares(keys[client], tuple(inbox[m][client] for m in group), width)
                for client in shares
            }
            for group in self.groups
        ]

    def _require(self, answered: int, stage: CommitteeStage, round_: int) -> None:
        if answered < self.needed:
            raise CommitteeAbort(
                f"round {round_} aborted in {stage.name}: {self.needed} committee members needed "
                f"(t + k = {self.scheme.threshold} to reconstruct, + detect = {self.detect}), "
                f"{answered} answered in time; earlier rounds are unaffected",
                needed=self.needed,
                answered=answered,
            )

    def _reconstruct(
        self, rows: np.ndarray, members: list[int], length: int, round_: int
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        try:
            return self.scheme.reconstruct(rows, members, length), ()
        except InconsistentSharesError as error:
            suspects = tuple(error.suspects)
            keep = [i for i, m in enumerate(members) if m not in suspects]
            if suspects and len(keep) >= self.needed:
                kept = [members[i] for i in keep]
                return self.scheme.reconstruct(rows[keep], kept, length), suspects
            raise TamperingDetected(
                f"round {round_}: released shares are inconsistent in {error.blocks.size} "
                f"blocks; "
                + (
                    f"members {list(suspects)} tampered, and without them only "
                    f"{len(keep)} of {self.needed} needed shares remain"
                    if suspects
                    else "the tampering members cannot be singled out"
                )
                + "; nothing was released",
                error.blocks,
                suspects,
            ) from error
