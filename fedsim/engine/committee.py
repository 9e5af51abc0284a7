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
SHARE, member -> server in RELEASE. A member's channel key comes from its own secret
(``member_secrets``, :class:`fedsim.randomness.PartySecret`, derived per session) or from the
OS CSPRNG; a client's share randomness from the caller's generator or the OS CSPRNG.

Members are simulated in groups: one :class:`CommitteeShard` holds many members and works on
all of them at once (an array with one row per member), and runs as a Ray actor (no CPU
reserved: shards are light and must not starve the client workers) or in process.

Faults are drawn per member and per stage (:class:`CommitteeFaults`): a member that **drops**
at a stage is silent from then on; one that is **late** at a stage answers after the deadline,
so its share does not count this round (nothing sleeps); one that **tampers** adds a random
non-zero offset to what it holds (SHARE, COMBINE) or sends (RELEASE).

Replies are validated where they arrive. A client whose input is not ``length`` field elements,
or whose share a live member cannot open or finds malformed (unauthenticated, replayed, wrong
round or stage, wrong length, dtype or range: e.g. ``corrupt_in_transit``, the relay flipping a
byte), is left out of the sum (:attr:`CommitteeResult.excluded`); a member whose release does
not open or is malformed is not counted as an answer (:attr:`CommitteeResult.rejected`); the
reasons are in :attr:`CommitteeResult.reasons`. Nothing a party sends raises out of the
committee.

Outcomes. The server needs ``t + k + detect`` answers: ``t + k`` to reconstruct and ``detect``
more so that up to ``detect`` tampered shares are always caught. Fewer answers ->
:class:`CommitteeAbort` (a :class:`protocols.secagg.TooManyDropoutsError`) naming how many were
needed and how many answered. The answers are decoded by Berlekamp-Welch
(:meth:`protocols.shamir.PackedShamir.decode`): wrong shares are corrected and their members
named only within the sound radius min(floor((m - t - k) / 2), m - t - k - max(t, detect)), so
neither t colluding members nor ``detect`` tampered shares can choose the release or get an
honest member blamed; beyond it :class:`TamperingDetected` is raised naming nobody, and
nothing is released. With
exactly t + k answers nothing can be checked: the result says ``verified=False``. A round that
fails is left ABORTED (:meth:`Committee.stage`) on the server and in every shard, and earlier
rounds' results stay in :attr:`Committee.history`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.randomness import PartySecret, Purpose
from protocols.channels import SERVER_ID, Endpoint, Envelope, Relay, new_session_id
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.secagg import TooManyDropoutsError, check_move
from protocols.shamir import PackedShamir, UncorrectableSharesError

CHANNEL_PROTOCOL = b"fedsim/committee"
"""The protocol label every committee channel binds (protocols.channels associated data)."""


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
"""Channel party id of member j: MEMBER_ID_BASE + j (clients use their own ids, never these)."""


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
    """Released shares do not lie on one polynomial and correcting them would go beyond the
    sound decoding radius: detected, nothing released, nobody named (``suspects == ()``)."""

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



@dataclass(frozen=True)
class SealedShares:
    """One client's shares for the members of a shard, one envelope each (shard order)."""

    public_key: bytes
    envelopes: tuple[Envelope, ...]
    width: int


class CommitteeShard:
    """Members ``members`` (global indices) of one committee, held as one array per client.

    A plain class; :func:`shard_actor` makes it a Ray actor. Rounds are independent: each has
    its own stored rows, summed state and stage, and :meth:`abort` ends one. ``private_keys``:
    member -> 32 bytes of that member's own secret for its channel key (else the OS CSPRNG).
    """

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int = DEFAULT_FIELD.exponent,
        session_id: bytes | None = None,
        private_keys: Mapping[int, bytes] | None = None,
    ):
        self.members = np.asarray(members, dtype=np.int64)
        self.field = MersenneField(field_exponent)
        keys = private_keys or {}
        self._endpoints = (
            {}
            if session_id is None
            else {
                int(m): Endpoint(
                    MEMBER_ID_BASE + int(m), session_id, CHANNEL_PROTOCOL, keys.get(int(m))
                )
                for m in self.members
            }
        )
        self._rows: dict[int, dict[int, np.ndarray]] = {}
        self._width: dict[int, int] = {}
        self._sum: dict[int, np.ndarray] = {}
        self._offline: dict[int, set[int]] = {}
        self._stage: dict[int, CommitteeStage] = {}

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
        """Each member's channel public key (empty without encryption)."""
        return {m: e.public_key for m, e in self._endpoints.items()}

    def connect(self, party_id: int, public_key: bytes) -> None:
        """Every member opens a channel with ``party_id`` (the server, or a client)."""
        for endpoint in self._endpoints.values():
            endpoint.connect(party_id, public_key)

    def _open(
        self, round_: int, client: int, sealed: SealedShares, width: int
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
        member; plain rows that are not (members, width) field elements, or that reach a shard
        whose members only take sealed shares, by every member."""
        width = self._width.setdefault(round_, _width_of(delivered))
        everyone = [int(m) for m in self.members]
        zeros = np.zeros((self.members.size, width), dtype=np.int64)
        if isinstance(delivered, SealedShares):
            if (
                not self._endpoints
                or not isinstance(delivered.envelopes, tuple | list)
                or len(delivered.envelopes) != self.members.size
                or delivered.width != width
            ):
                return zeros, everyone
            return self._open(round_, client, delivered, width)
        if (
            self._endpoints
            or not isinstance(delivered, np.ndarray)
            or delivered.dtype.kind not in "iu"
            or delivered.shape != zeros.shape
        ):
            return zeros, everyone
        try:
            return self.field.asarray(delivered, f"shares[{client}]"), []
        except ValueError:
            return zeros, everyone

    def share(
        self,
        round_: int,
        shares: Mapping[int, Any],
        faults: StageFaults,
        width: int | None = None,
    ) -> dict:
        """SHARE handler: store this shard's rows of each client's shares (``shares[client]``:
        an array with one row per member of the shard, or :class:`SealedShares`; ``width``
        field elements per row, by default that of the first client); returns the members
        still online and, per client, the online members that refused its share."""
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
        return {
            "members": members,
            "rows": rows,
            "late": [int(m) for m in self.members[keep] if m in faults.late],
        }

    def abort(self, round_: int) -> None:
        """The driver aborted ``round_``: drop everything of it and leave it ABORTED."""
        for store in (self._rows, self._width, self._sum, self._offline):
            store.pop(round_, None)
        self._stage[round_] = CommitteeStage.ABORTED


def _width_of(delivered: Any) -> int:
    """Elements per row that a client's delivery claims (0 when it claims nothing usable)."""
    if isinstance(delivered, SealedShares):
        width = delivered.width
    else:
        plain = isinstance(delivered, np.ndarray) and delivered.ndim == 2
        width = delivered.shape[1] if plain else 0
    return int(width) if isinstance(width, int | np.integer) and width >= 0 else 0


def shard_actor(ray_module: Any, shard_class: type = CommitteeShard) -> Any:
    """``shard_class`` (:class:`CommitteeShard` by default) as a Ray actor class that reserves
    no CPU and is not restarted (a crashed member is a dropped member)."""
    return ray_module.remote(shard_class).options(num_cpus=0, max_restarts=0)


@dataclass(frozen=True)
class CommitteeResult:
    """One released round: the sum (field elements), whose inputs it holds, and the members
    that answered, were late, or were caught tampering (and corrected away).

    ``excluded``: clients left out (invalid input, or a share some live member refused);
    ``rejected``: members whose release did not open or was malformed; ``verified``: False when
    exactly t + k shares were decoded (nothing could be checked); ``reasons``: why each party
    was excluded or rejected, for the log.
    """

    round: int
    aggregate: np.ndarray
    clients: tuple[int, ...]
    answered: tuple[int, ...]
    late: tuple[int, ...]
    dropped: tuple[int, ...]
    tampered: tuple[int, ...]
    excluded: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()
    verified: bool = False
    reasons: tuple[str, ...] = ()


class Committee:
    """A committee of ``n`` members with privacy threshold ``t`` and packing ``k``, split into
    ``shards`` groups, each a Ray actor (``ray_module`` given) or an in-process object.

    ``detect``: extra answers required beyond t + k, so that up to ``detect`` tampered shares
    are always caught (0 trusts every answer). ``encrypt``: shares travel over authenticated
    encrypted channels through :attr:`relay`, whose transcript counts the bytes.
    ``member_secrets``: member -> its own :class:`~fedsim.randomness.PartySecret`, from which
    its channel key is derived per session (None: keys from the OS CSPRNG). ``shard_class``:
    the class simulating each group (a :class:`CommitteeShard` subclass plays hostile members).
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
        member_secrets: Mapping[int, PartySecret] | None = None,
        shard_class: type = CommitteeShard,
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
        keys = self._member_keys(member_secrets)
        arguments = [
            (g, field_.exponent, self.session_id, keys and {m: keys[m] for m in g})
            for g in self.groups
        ]
        if ray_module is not None:
            actor = shard_actor(ray_module, shard_class)
            self.shards = [actor.remote(*a) for a in arguments]
        else:
            self.shards = [shard_class(*a) for a in arguments]
        self.history: dict[int, CommitteeResult] = {}
        self.stages: dict[int, CommitteeStage] = {}
        self.relay = Relay()
        self.member_keys: dict[int, bytes] = {}
        if encrypt:
            self._server = Endpoint(SERVER_ID, self.session_id, CHANNEL_PROTOCOL)
            for part in self._call("public_keys", [() for _ in self.groups]):
                self.member_keys.update(part)
            for member, key in sorted(self.member_keys.items()):
                self.relay.publish(MEMBER_ID_BASE + member, key)
                self._server.connect(MEMBER_ID_BASE + member, key)
            self._call("connect", [(SERVER_ID, self._server.public_key) for _ in self.groups])

    def _member_keys(self, member_secrets) -> dict[int, bytes] | None:
        """Each member's channel private key for this session, from its own secret."""
        if member_secrets is None or not self.encrypt:
            return None
        if not isinstance(member_secrets, Mapping):
            raise ValueError(
                f"member_secrets must map members to PartySecret, got {type(member_secrets)}"
            )
        missing = [m for m in range(self.scheme.n) if m not in member_secrets]
        wrong = [m for m, s in member_secrets.items() if not isinstance(s, PartySecret)]
        if missing or wrong:
            raise ValueError(
                f"member_secrets must hold a PartySecret for every member 0..{self.scheme.n - 1}"
                f"; missing {missing[:5]}, not a PartySecret {wrong[:5]}"
            )
        label = self.session_id.hex()
        return {
            m: member_secrets[m].seed_bytes(Purpose.KEYS, "committee-channel", label)
            for m in range(self.scheme.n)
        }

    @property
    def needed(self) -> int:
        """Answers the server needs: t + k + detect."""
        return self.scheme.threshold + self.detect

    def stage(self, round_: int) -> CommitteeStage:
        """Where round ``round_`` stands: SETUP before it runs, DONE or ABORTED after."""
        return self.stages.get(round_, CommitteeStage.SETUP)

    def _advance(self, round_: int, target: CommitteeStage) -> None:
        check_transition(self.stage(round_), target, f"committee round {round_}")
        self.stages[round_] = target

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
        *,
        length: int | None = None,
    ) -> CommitteeResult:
        """Share every client's vector (``length`` field elements, by default the most common
        length; randomness from ``rng``, or from the OS CSPRNG when ``rng`` is None), combine,
        release, decode sum_i inputs[i] mod p. Each round number runs once; a failed round is
        left ABORTED. Raises :class:`CommitteeAbort` or :class:`TamperingDetected`."""
        if not isinstance(round_, int | np.integer) or not 0 <= round_ < 2**63:
            raise ValueError(f"round_={round_!r} must be an integer in [0, 2^63)")
        if round_ in self.stages:
            raise ValueError(
                f"round {round_} was already run (it is {self.stages[round_].name}); each "
                "round number runs once"
            )
        if not inputs:
            raise ValueError("inputs is empty: no client to aggregate")
        self.stages[round_] = CommitteeStage.SETUP
        try:
            result = self._run_round(int(round_), inputs, rng, faults or CommitteeFaults(), length)
        except BaseException:
            self.stages[round_] = CommitteeStage.ABORTED
            self._call("abort", [(round_,) for _ in self.groups])
            raise
        self.history[round_] = result
        return result

    def _run_round(self, round_, inputs, rng, faults, length) -> CommitteeResult:
        vectors, length, excluded, reasons = self._client_inputs(inputs, length)
        per_stage = {
            stage: StageFaults(
                drop=frozenset(faults.members_with(MemberFault.DROP, stage)),
                late=frozenset(faults.members_with(MemberFault.LATE, stage)),
                tamper=frozenset(faults.members_with(MemberFault.TAMPER, stage)),
                seed=faults.seed,
            )
            for stage in ACTIVE_STAGES
        }
        self._advance(round_, CommitteeStage.SHARE)
        answers = self._share(round_, vectors, rng, faults, per_stage[CommitteeStage.SHARE])
        late = set(per_stage[CommitteeStage.SHARE].late)
        online = sorted(m for part in answers for m in part["online"] if m not in late)
        self._require(len(online), CommitteeStage.SHARE, round_)
        # a client counts when its shares reached every member that is online and on time
        for part in answers:
            for client, who in part["refused"].items():
                if set(who) - late:
                    excluded.add(client)
                    reasons.append(f"client {client}: members {sorted(who)} refused its share")
        clients = tuple(sorted(set(vectors) - excluded))
        self._advance(round_, CommitteeStage.COMBINE)
        self._call(
            "combine",
            [(round_, list(clients), per_stage[CommitteeStage.COMBINE]) for _ in self.groups],
        )
        self._advance(round_, CommitteeStage.RELEASE)
        released = self._call(
            "release", [(round_, per_stage[CommitteeStage.RELEASE]) for _ in self.groups]
        )
        late |= per_stage[CommitteeStage.COMBINE].late
        members, rows, rejected = self._open_release(round_, released, late, length, reasons)
        self._require(len(members), CommitteeStage.RELEASE, round_)
        aggregate, tampered = self._reconstruct(np.stack(rows), members, length, round_)
        self._advance(round_, CommitteeStage.DONE)
        dropped = set(range(self.scheme.n)) - set(members) - late - set(rejected)
        return CommitteeResult(
            round_,
            aggregate,
            clients,
            tuple(m for m in members if m not in tampered),
            tuple(sorted(late)),
            tuple(sorted(dropped)),
            tampered,
            tuple(sorted(excluded)),
            tuple(sorted(rejected)),
            verified=len(members) > self.scheme.threshold,
            reasons=tuple(reasons),
        )

    def _client_inputs(
        self, inputs: Mapping[int, Any], length: int | None
    ) -> tuple[dict[int, np.ndarray], int, set[int], list[str]]:
        """The clients' vectors that are ``length`` field elements (by default the most common
        length, the smaller on a tie); the others are excluded with a reason."""
        vectors, excluded, reasons = {}, set(), []
        for client, vector in inputs.items():
            if isinstance(client, bool) or not isinstance(client, int | np.integer):
                raise ValueError(f"inputs has client id {client!r}; allowed: integers")
            if not 0 <= client < SERVER_ID or 0 <= client - MEMBER_ID_BASE < self.scheme.n:
                raise ValueError(
                    f"inputs has client id {client}; allowed: [0, 2^63 - 1) except the members' "
                    f"channel ids [2^62, 2^62 + {self.scheme.n})"
                )
            try:
                vectors[int(client)] = self.scheme.field.asarray(vector, "input").ravel()
            except (ValueError, TypeError, OverflowError) as error:
                excluded.add(int(client))
                reasons.append(f"client {client}: {error}")
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1
        ):
            raise ValueError(f"length={length!r} must be a positive integer")
        if length is None:
            counts = Counter(v.size for v in vectors.values() if v.size)
            length = min(counts, key=lambda size: (-counts[size], size)) if counts else 1
        for client in [c for c, v in vectors.items() if v.size != length]:
            reasons.append(f"client {client}: {vectors[client].size} elements, {length} expected")
            excluded.add(client)
            del vectors[client]
        if not vectors:
            raise CommitteeAbort(
                f"no usable client input: {'; '.join(reasons)[:500]}", needed=1, answered=0
            )
        return vectors, int(length), excluded, reasons

    def _share(self, round_, vectors, rng, faults, stage_faults) -> list[dict]:
        """SHARE: every client shares its vector (and seals each member's row); the shards
        store them and report who is online and whose shares they refused."""
        if rng is None:
            shares = {c: self.scheme.share(v, secure=True) for c, v in vectors.items()}
        else:
            shares = {c: self.scheme.share(v, rng=rng) for c, v in vectors.items()}
        if self.encrypt:
            outgoing = self._seal_shares(round_, shares, faults.corrupt_in_transit)
        else:
            outgoing = [{c: s[g] for c, s in shares.items()} for g in self.groups]
        width = next(iter(shares.values())).shape[1]
        return self._call("share", [(round_, part, stage_faults, width) for part in outgoing])

    def _seal_shares(
        self, round_: int, shares: dict[int, np.ndarray], corrupt: frozenset[tuple[int, int]]
    ) -> list[dict[int, SealedShares]]:
        """Each client seals row j of its shares for member j; the relay carries (and counts)
        the envelopes, altering those in ``corrupt``; returns each shard's deliveries."""
        keys = {}
        for client, rows in shares.items():
            endpoint = Endpoint(client, self.session_id, CHANNEL_PROTOCOL)
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

    def _open_release(
        self, round_: int, released: list[Any], late: set[int], length: int, reasons: list[str]
    ) -> tuple[list[int], list[np.ndarray], list[int]]:
        """RELEASE at the server: each on-time member's row, opened and checked (blocks field
        elements); a row that does not open or is malformed rejects its member. Adds the
        members that answered late to ``late``."""
        width = self.scheme.blocks_for(length)
        members, rows, rejected = [], [], []
        for group, part in zip(self.groups, released):
            try:
                pairs = list(zip(part["members"], part["rows"], strict=True))
                late |= {int(m) for m in part["late"] if m in group}
            except (TypeError, KeyError, ValueError):
                reasons.append(f"members {group}: malformed release reply")
                continue
            for member, row in pairs:
                if not isinstance(member, int | np.integer) or member not in group:
                    continue
                if member in late or member in members or member in rejected:
                    continue
                try:
                    rows.append(self._open_row(round_, int(member), row, width))
                    members.append(int(member))
                except ValueError as error:  # ChannelError is a ValueError
                    rejected.append(int(member))
                    reasons.append(f"member {member}: {error}")
        return members, rows, rejected

    def _open_row(self, round_: int, member: int, row: Any, width: int) -> np.ndarray:
        if self.encrypt:
            self.relay.post(row)  # counted; refuses anything that is not an Envelope
            self.relay.deliver(SERVER_ID)
            row = self._server.open_array(
                row, round_=round_, stage=CommitteeStage.RELEASE, sender=MEMBER_ID_BASE + member
            )
        return self.scheme.field.vector(row, width, f"release of member {member}")

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
        """The sum and the members whose shares were corrected, decoded leaving room for
        max(t, detect) faulty members (:meth:`protocols.shamir.PackedShamir.decode`)."""
        bound = max(self.scheme.t, self.detect)
        try:
            decoding = self.scheme.decode(rows, members, length, max_faulty=bound)
        except UncorrectableSharesError as error:
            raise TamperingDetected(
                f"round {round_}: released shares of members {members} are inconsistent in "
                f"{error.blocks.size} blocks and the tampering members cannot be singled out "
                f"leaving room for {bound} faulty members; nothing was released",
                error.blocks,
                (),
            ) from error
        return decoding.values, decoding.corrected
