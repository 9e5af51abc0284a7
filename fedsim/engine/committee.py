"""Committee members as actors: client-sealed packed Shamir shares in, a decoded sum out, faults.

A committee of ``n`` members holds packed Shamir shares (:mod:`protocols.shamir`, privacy
threshold ``t``, ``k`` secrets per polynomial) of the clients' field vectors. The clients share
and seal inside their own ClientApps (:func:`protocols.committee.seal_input`, share randomness
and X25519 key from each client's own secret); the committee only ever receives their
:class:`protocols.committee.SealedInput` messages -- never a plaintext vector or share. One
round (:meth:`Committee.run_round_sealed`):

1. **SHARE**: the server checks each client's sealed input (usable key, one envelope per member
   and none for anyone else, headers for this round and stage, ciphertexts of the right length)
   and relays member j's envelope to member j, who opens it;
2. **COMBINE**: the members agree (on the driver's list) on the clients whose shares reached
   every live member, and each sums its rows of those clients locally: shares of sum_i x_i;
3. **RELEASE**: members seal their summed rows for the server, which decodes the sum.

Transport: every share travels over an authenticated encrypted channel
(:mod:`protocols.channels`: X25519, HKDF, ChaCha20-Poly1305, bound to protocol, session,
sender, receiver, round and stage) relayed by the server, which counts bytes in a transcript:
client -> member in SHARE, member -> server in RELEASE. A member's channel key comes from its
own secret (``member_secrets``, :class:`fedsim.randomness.PartySecret`, derived per session) or
from the OS CSPRNG; :meth:`Committee.keys_for` publishes the members' public keys for a round.

Members are simulated in groups: one :class:`CommitteeShard` holds many members and works on
all of them at once (an array with one row per member), and runs as a Ray actor (no CPU
reserved: shards are light and must not starve the client workers) or in process.

Faults are drawn per member and per stage (:class:`CommitteeFaults`): a member that **drops**
at a stage is silent from then on; one that is **late** at a stage answers after the deadline,
so its share does not count this round (nothing sleeps); one that **tampers** adds a random
non-zero offset to what it holds (SHARE, COMBINE) or sends (RELEASE).

Replies are validated where they arrive. A client whose sealed input the server finds
malformed, or whose share a live member cannot open or finds malformed (unusable key,
unauthenticated, replayed, wrong round or stage, wrong length, dtype or range: e.g.
``corrupt_in_transit``, the relay flipping a byte), is left out of the sum
(:attr:`CommitteeResult.excluded`); a member whose release does not open or is malformed is
not counted as an answer (:attr:`CommitteeResult.rejected`); the reasons are in
:attr:`CommitteeResult.reasons`. Nothing a party sends raises out of the committee.

Outcomes. The server needs ``t + k + detect`` answers: ``t + k`` to reconstruct and ``detect``
more so that up to ``detect`` tampered shares are always caught. Fewer answers ->
:class:`CommitteeAbort` (a :class:`protocols.secagg.TooManyDropoutsError`) naming how many were
needed and how many answered. The answers are decoded by Berlekamp-Welch
(:meth:`protocols.shamir.PackedShamir.decode`): wrong shares are corrected and their members
named only within the sound radius min(floor((m - t - k) / 2), m - t - k - max(t, detect)), so
neither t colluding members nor ``detect`` tampered shares can choose the release or get an
honest member blamed; beyond it :class:`TamperingDetected` is raised naming nobody, and
nothing is released. With exactly t + k answers nothing can be checked: the result says
``verified=False``. A round that fails is left ABORTED (:meth:`Committee.stage`) on the server
and in every shard, the exception names the clients excluded before it (``excluded``), and
earlier rounds' results stay in :attr:`Committee.history`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.randomness import PartySecret, Purpose, RunSecret
from protocols.channels import (
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    SERVER_ID,
    Endpoint,
    Envelope,
    Relay,
    new_session_id,
)
from protocols.committee import (
    ACTIVE_STAGES,
    CHANNEL_PROTOCOL,
    MEMBER_ID_BASE,
    TRANSITIONS,
    CommitteeKeys,
    CommitteeStage,
    SealedInput,
    check_client_id,
    check_transition,
    sealed_row_bytes,
)
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.secagg import TooManyDropoutsError
from protocols.shamir import PackedShamir, UncorrectableSharesError

__all__ = [
    "ACTIVE_STAGES",
    "CHANNEL_PROTOCOL",
    "MEMBER_ID_BASE",
    "TRANSITIONS",
    "Committee",
    "CommitteeAbort",
    "CommitteeFaults",
    "CommitteeKeys",
    "CommitteeResult",
    "CommitteeShard",
    "CommitteeSpec",
    "CommitteeStage",
    "MemberFault",
    "SealedInput",
    "SealedShares",
    "StageFaults",
    "TamperingDetected",
    "check_transition",
    "committee_for",
    "shard_actor",
]


class MemberFault(enum.Enum):
    DROP = "drop"
    LATE = "late"
    TAMPER = "tamper"


class CommitteeAbort(TooManyDropoutsError):
    """Too few members answered (or no client input was usable); ``needed`` and ``answered``
    say how many; ``excluded``: client -> reason, the clients left out before the abort."""

    excluded: Mapping[int, str] = {}

    def __init__(self, message: str, needed: int, answered: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.answered = answered


class TamperingDetected(RuntimeError):
    """Released shares do not lie on one polynomial and correcting them would go beyond the
    sound decoding radius: detected, nothing released, nobody named (``suspects == ()``);
    ``excluded``: client -> reason, the clients left out before it."""

    excluded: Mapping[int, str] = {}

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
    """One client's sealed shares as delivered to the members of a shard: its public key, one
    envelope per member (shard order) and the field elements each row must hold."""

    public_key: bytes
    envelopes: tuple[Envelope, ...]
    width: int


class CommitteeShard:
    """Members ``members`` (global indices) of one committee, held as one array per client.

    A plain class; :func:`shard_actor` makes it a Ray actor. Rounds are independent: each has
    its own stored rows, summed state and stage, and :meth:`abort` ends one. ``session_id``:
    the committee's channel session; ``private_keys``: member -> 32 bytes of that member's own
    secret for its channel key (else the OS CSPRNG).
    """

    def __init__(
        self,
        members: Sequence[int],
        field_exponent: int,
        session_id: bytes,
        private_keys: Mapping[int, bytes] | None = None,
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
        """Each member's channel public key."""
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
        member; a delivery that is not one sealed envelope per member of ``width`` elements
        (plain rows included: members take only sealed shares), by every member."""
        width = self._width.setdefault(round_, _width_of(delivered))
        if (
            not isinstance(delivered, SealedShares)
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
        a :class:`SealedShares`; ``width`` field elements per row, by default that of the first
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
    width = delivered.width if isinstance(delivered, SealedShares) else 0
    return int(width) if isinstance(width, int | np.integer) and width >= 0 else 0


def shard_actor(ray_module: Any, shard_class: type = CommitteeShard) -> Any:
    """``shard_class`` (:class:`CommitteeShard` by default) as a Ray actor class that reserves
    no CPU and is not restarted (a crashed member is a dropped member)."""
    return ray_module.remote(shard_class).options(num_cpus=0, max_restarts=0)


@dataclass(frozen=True)
class CommitteeResult:
    """One released round: the sum (field elements), whose inputs it holds, and the members
    that answered, were late, or were caught tampering (and corrected away).

    ``excluded``: clients left out (a malformed sealed input, or a share some live member
    refused); ``rejected``: members whose release did not open or was malformed; ``verified``:
    False when exactly t + k shares were decoded (nothing could be checked); ``reasons``: why
    each party was excluded or rejected, for the log (``"client C: ..."``, ``"member M: ..."``).
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


def _check_layout(n: int, t: int, k: int, shards: Any, detect: Any) -> PackedShamir:
    """The scheme of a committee of n members, threshold t, packing k, after checking that
    ``shards`` groups and ``detect`` extra answers fit it."""
    scheme = PackedShamir(n=n, t=t, k=k)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= n:
        raise ValueError(f"shards={shards!r} must be an integer in [1, n={n}]")
    if (
        isinstance(detect, bool)
        or not isinstance(detect, int)
        or detect < 0
        or scheme.threshold + detect > n
    ):
        raise ValueError(
            f"detect={detect!r} must be an integer >= 0 with t + k + detect <= n "
            f"(t + k = {scheme.threshold}, n = {n})"
        )
    return scheme


class Committee:
    """A committee of ``n`` members with privacy threshold ``t`` and packing ``k``, split into
    ``shards`` groups, each a Ray actor (``ray_module`` given) or an in-process object.

    ``detect``: extra answers required beyond t + k, so that up to ``detect`` tampered shares
    are always caught (0 trusts every answer). Shares travel over authenticated encrypted
    channels through :attr:`relay`, whose transcript counts the bytes. ``member_secrets``:
    member -> its own :class:`~fedsim.randomness.PartySecret`, from which its channel key is
    derived per session (None: keys from the OS CSPRNG). ``shard_class``: the class simulating
    each group (a :class:`CommitteeShard` subclass plays hostile members). A committee is never
    pickled: its members' keys and shares are theirs.
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
    ) -> None:
        _check_layout(n, t, k, shards, detect)
        self.scheme = PackedShamir(n=n, t=t, k=k, field=field_)
        self.detect = detect
        self.groups = [g.tolist() for g in np.array_split(np.arange(n), shards)]
        self._ray = ray_module
        self.session_id = new_session_id()
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
        self._server = Endpoint(SERVER_ID, self.session_id, CHANNEL_PROTOCOL)
        for part in self._call("public_keys", [() for _ in self.groups]):
            self.member_keys.update(part)
        for member, key in sorted(self.member_keys.items()):
            self.relay.publish(MEMBER_ID_BASE + member, key)
            self._server.connect(MEMBER_ID_BASE + member, key)
        self._call("connect", [(SERVER_ID, self._server.public_key) for _ in self.groups])

    def __reduce__(self):
        raise TypeError("a Committee is never pickled: its members' keys and shares are theirs")

    def _member_keys(self, member_secrets) -> dict[int, bytes] | None:
        """Each member's channel private key for this session, from its own secret."""
        if member_secrets is None:
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

    def spec(self) -> CommitteeSpec:
        """The :class:`CommitteeSpec` this committee was built to."""
        scheme = self.scheme
        actors = self._ray is not None
        return CommitteeSpec(scheme.n, scheme.t, scheme.k, self.detect, len(self.groups), actors)

    def keys_for(self, round_: int) -> CommitteeKeys:
        """What the clients of ``round_`` need to share with this committee (all public)."""
        return CommitteeKeys(
            round=int(round_),
            n=self.scheme.n,
            t=self.scheme.t,
            k=self.scheme.k,
            field_exponent=self.scheme.field.exponent,
            session_id=self.session_id,
            member_keys=tuple(self.member_keys[m] for m in range(self.scheme.n)),
        )

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

    def run_round_sealed(
        self,
        round_: int,
        sealed: Mapping[int, SealedInput],
        length: int,
        faults: CommitteeFaults | None = None,
    ) -> CommitteeResult:
        """Run round ``round_`` on the clients' sealed inputs (client channel id ->
        :class:`~protocols.committee.SealedInput`, made by
        :func:`protocols.committee.seal_input` against :meth:`keys_for`) of ``length`` field
        elements each: relay each member's envelopes, combine, release, decode
        sum_i x_i mod p. A malformed sealed input excludes its client with a reason. Each round
        number runs once; a failed round is left ABORTED. Raises :class:`CommitteeAbort` or
        :class:`TamperingDetected` (each with ``excluded``, client -> reason)."""
        if isinstance(round_, bool) or not isinstance(round_, int | np.integer):
            raise ValueError(f"round_={round_!r} must be an integer in [0, 2^63)")
        if not 0 <= round_ < 2**63:
            raise ValueError(f"round_={round_!r} must be an integer in [0, 2^63)")
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
            raise ValueError(f"length={length!r} must be a positive integer")
        if round_ in self.stages:
            raise ValueError(
                f"round {round_} was already run (it is {self.stages[round_].name}); each "
                "round number runs once"
            )
        if not isinstance(sealed, Mapping) or not sealed:
            raise ValueError("sealed is empty: no client to aggregate")
        for client in sealed:
            check_client_id(client)
        self.stages[round_] = CommitteeStage.SETUP
        excluded: dict[int, str] = {}
        try:
            result = self._run_round(
                int(round_), sealed, int(length), faults or CommitteeFaults(), excluded
            )
        except BaseException as error:
            self.stages[round_] = CommitteeStage.ABORTED
            self._call("abort", [(round_,) for _ in self.groups])
            if isinstance(error, CommitteeAbort | TamperingDetected):
                error.excluded = dict(excluded)
            raise
        self.history[round_] = result
        return result

    def _run_round(self, round_, sealed, length, faults, excluded) -> CommitteeResult:
        parts, width = self._relay_shares(round_, sealed, length, faults, excluded)
        if not parts[0]:
            reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(excluded.items()))
            raise CommitteeAbort(
                f"round {round_}: no usable client input: {reasons[:500]}", needed=1, answered=0
            )
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
        answers = self._call(
            "share", [(round_, part, per_stage[CommitteeStage.SHARE], width) for part in parts]
        )
        late = set(per_stage[CommitteeStage.SHARE].late)
        online = sorted(m for part in answers for m in part["online"] if m not in late)
        self._require(len(online), CommitteeStage.SHARE, round_)
        # a client counts when its shares reached every member that is online and on time
        refusals: dict[int, set[int]] = {}
        for part in answers:
            for client, who in part["refused"].items():
                refusals.setdefault(client, set()).update(who)
        for client, who in refusals.items():
            if who - late:
                excluded[client] = f"members {sorted(who)} refused its share"
        clients = tuple(sorted(set(parts[0]) - set(excluded)))
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
        reasons = [f"client {c}: {r}" for c, r in sorted(excluded.items())]
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

    def _relay_shares(
        self,
        round_: int,
        sealed: Mapping[int, Any],
        length: int,
        faults: CommitteeFaults,
        excluded: dict[int, str],
    ) -> tuple[list[dict[int, SealedShares]], int]:
        """SHARE at the server: check each client's sealed input (excluding it, with the
        reason, when malformed), relay the envelopes (counted; those in
        ``faults.corrupt_in_transit`` altered on the way) and group them per shard. Returns
        each shard's deliveries and the field elements per share row."""
        width = self.scheme.blocks_for(length)
        size = sealed_row_bytes(width)
        accepted = {}
        for client, delivery in sealed.items():
            problem = self._sealed_problem(round_, int(client), delivery, size)
            if problem is None:
                accepted[int(client)] = delivery
            else:
                excluded[int(client)] = problem
        for client, delivery in accepted.items():
            for member in range(self.scheme.n):
                envelope = delivery.envelopes[member]
                if (client, member) in faults.corrupt_in_transit:
                    flipped = bytes([envelope.ciphertext[0] ^ 1]) + envelope.ciphertext[1:]
                    envelope = dataclasses.replace(envelope, ciphertext=flipped)
                self.relay.post(envelope)
        inbox = {
            member: {e.sender: e for e in self.relay.deliver(MEMBER_ID_BASE + member)}
            for member in range(self.scheme.n)
        }
        parts = [
            {
                client: SealedShares(
                    delivery.public_key, tuple(inbox[m][client] for m in group), width
                )
                for client, delivery in accepted.items()
            }
            for group in self.groups
        ]
        return parts, width

    def _sealed_problem(self, round_: int, client: int, delivery: Any, size: int) -> str | None:
        """Why a client's sealed input is no SHARE message of this round (None if its form is
        right): a public key of 32 bytes, exactly one envelope per member, each from the
        client to that member for this round and stage SHARE, with a nonce and ``size``
        ciphertext bytes. Whether it opens is for its member to find."""
        if not isinstance(delivery, SealedInput):
            return f"its input is a {type(delivery).__name__}, not a SealedInput"
        key, envelopes = delivery.public_key, delivery.envelopes
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            return f"its public key is not {PUBLIC_KEY_BYTES} bytes"
        if not isinstance(envelopes, Mapping):
            return "its envelopes are not a mapping member -> envelope"
        members = range(self.scheme.n)
        strangers = [j for j in envelopes if j not in members]
        if strangers:
            return f"envelopes for non-members {strangers[:5]}"
        missing = [j for j in members if j not in envelopes]
        if missing:
            return f"no envelope for members {missing[:5]}"
        for j in members:
            envelope = envelopes[j]
            if not isinstance(envelope, Envelope):
                return f"its envelope for member {j} is a {type(envelope).__name__}"
            header = (envelope.sender, envelope.receiver, envelope.round, envelope.stage)
            expected = (client, MEMBER_ID_BASE + j, round_, CommitteeStage.SHARE.name)
            if header != expected:
                return (
                    f"its envelope for member {j} has header (sender, receiver, round, stage) "
                    f"= {header!r}; expected {expected!r}"
                )
            nonce, body = envelope.nonce, envelope.ciphertext
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                return f"its envelope for member {j} has no {NONCE_BYTES}-byte nonce"
            if not isinstance(body, bytes) or len(body) != size:
                got = len(body) if isinstance(body, bytes) else type(body).__name__
                return f"its envelope for member {j} holds {got} ciphertext bytes, {size} expected"
        return None

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
        self.relay.post(row)  # counted; refuses anything that is not an Envelope
        self.relay.deliver(SERVER_ID)
        opened = self._server.open_array(
            row, round_=round_, stage=CommitteeStage.RELEASE, sender=MEMBER_ID_BASE + member
        )
        return self.scheme.field.vector(opened, width, f"release of member {member}")

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
        _check_layout(self.size, self.threshold, self.packing, self.shards, self.detect)

    def build(self, secrets: RunSecret | None) -> Committee:
        """The committee, member m's channel keys from ``secrets.member(m)`` (None: from the
        OS CSPRNG)."""
        if secrets is not None and not isinstance(secrets, RunSecret):
            raise ValueError(f"secrets is a {type(secrets).__name__}; allowed: RunSecret or None")
        ray_module = None
        if self.actors:
            import ray as ray_module  # noqa: PLC0415

            if not ray_module.is_initialized():
                raise RuntimeError(
                    "committee actors need a running Ray: run with the Ray engine backend, or "
                    "call fedsim.engine.cluster.ensure_ray() first"
                )
        member_secrets = (
            None if secrets is None else {m: secrets.member(m) for m in range(self.size)}
        )
        return Committee(
            self.size,
            self.threshold,
            self.packing,
            shards=self.shards,
            detect=self.detect,
            ray_module=ray_module,
            member_secrets=member_secrets,
        )


def committee_for(strategy: Any, secrets: RunSecret | None) -> Committee | None:
    """The :class:`Committee` that the first object of the wrapper chain (``.strategy`` links)
    defining ``bind_committee`` asks for (its ``committee_spec()``, None: no committee), each
    member with its own secret from the run's root; None when no object asks. The caller binds
    it (:func:`strategies.server_secret.bind_parties`) and closes it after the run."""
    target = strategy
    while target is not None and not callable(getattr(type(target), "bind_committee", None)):
        target = getattr(target, "__dict__", {}).get("strategy")
    spec = None if target is None else target.committee_spec()
    return None if spec is None else spec.build(secrets)
