"""The packed-Shamir sum committee: what clients, members and the server share.

A committee of ``n`` members (privacy threshold ``t``, ``k`` secrets per polynomial,
:mod:`protocols.shamir`) sums vectors of field elements (F_p, p = 2^e - 1) that clients share
with it; the server relays and sees only ciphertexts. A round moves through
:class:`CommitteeStage` (an explicit state machine, :data:`TRANSITIONS`):

1. **SHARE** (the client, :func:`protocols.committee.client.seal_input`): the client
   packed-Shamir-shares its vector -- share randomness from *its own* secret stream -- and seals
   row j of the shares for member j under a key agreed between its X25519 key and member j's
   public key (:class:`CommitteeKeys`, published for the round), bound to (``CHANNEL_PROTOCOL``,
   session, client, member, round, SHARE) (:mod:`protocols.channels`). What leaves the client is
   a :class:`SealedInput`: its public key and one envelope per member. The server relays each
   member's envelopes (:class:`ShardSealedShares`) to it;
2. **COMBINE**: each member sums its rows of the agreed clients (shares of the sum);
3. **RELEASE**: each member seals its summed row for the server, which decodes the sum.

Any t members' rows are uniformly distributed whatever the vector; the server together with at
most t members learns nothing of one client's vector beyond the released sum.

**Opened is released.** Once more than t members' release rows have reached the server, it
holds enough to determine (part of) the sum, whatever the round is then called: such a round
leaves an :class:`OpenedRelease` (on the server, and on the abort it raises), which the
strategy accounts as a release of the sum.

This module holds the stages, the public round parameters, the messages, the simulation's
faults (:class:`CommitteeFaults`), the outcome (:class:`CommitteeResult`) and the errors. The
client side is :mod:`protocols.committee.client`, the member side
:mod:`protocols.committee.member` (its stage handlers :mod:`protocols.committee.stages`, the
state they pass on :mod:`protocols.committee.state`), the server side
:mod:`protocols.committee.server`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import numpy as np

from protocols.channels import PUBLIC_KEY_BYTES, TAG_BYTES, Envelope, encode_array
from protocols.field import MersenneField
from protocols.kit import MEMBER_ID_BASE, Fault, TooManyDropoutsError, check_move
from protocols.shamir import PackedShamir

CHANNEL_PROTOCOL = b"fedsim/committee"
"""The protocol label every committee channel binds (protocols.channels associated data)."""



class CommitteeCall(StrEnum):
    """The member requests a committee server makes of its shard pool (``pool.call``), answered
    by :meth:`protocols.committee.member.CommitteeShard.answer`."""

    ABORT = "abort"
    COMBINE = "combine"
    CONNECT = "connect"
    KEY_PROOFS = "key_proofs"
    PUBLIC_KEYS = "public_keys"
    RELEASE = "release"
    SHARE = "share"


class CommitteeStage(Enum):
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
    """Raise :class:`protocols.kit.StageError` unless ``current -> target`` is allowed."""
    check_move(TRANSITIONS, current, target, who)


def check_client_id(party) -> int:
    """``party`` as a client's channel id, or ``ValueError``: an integer in [0, 2^62)."""
    if isinstance(party, bool) or not isinstance(party, int | np.integer):
        raise ValueError(f"client id {party!r}; allowed: an integer in [0, 2^62)")
    if not 0 <= int(party) < MEMBER_ID_BASE:
        raise ValueError(f"client id {party}; allowed: an integer in [0, 2^62)")
    return int(party)


class CommitteeWire:
    """The committee protocol's wire names: the ``<prefix>committee.*`` entries of a client's
    instruction (:class:`CommitteeKeys` and its channel party), a client's ``<prefix>sealed``
    reply record (its ``public-key`` and its envelopes) and the entries of the members' answers
    to SHARE (:class:`ShareAnswer`) and RELEASE (:class:`ReleaseAnswer`)."""

    PREFIX = "committee."
    """Before each instruction entry, after the secure sum's own prefix."""
    N, T, K, FIELD_EXPONENT = "n", "t", "k", "field-exponent"
    SESSION, MEMBER_KEYS, PARTY = "session", "member-keys", "party"
    MEMBER_PROOFS = "member-proofs"
    INSTRUCTION = (N, T, K, FIELD_EXPONENT, SESSION, MEMBER_KEYS, PARTY)
    """The instruction entries every client's instruction holds (``member-proofs`` is
    optional)."""
    SEALED, PUBLIC_KEY = "sealed", "public-key"
    ONLINE, REFUSED = "online", "refused"
    MEMBERS, ROWS, LATE = "members", "rows", "late"


def _answer_entry(record: object, name: str, call: str) -> Any:
    """``record[name]`` of a member's answer, or ValueError naming the key and what is allowed."""
    if not isinstance(record, Mapping) or name not in record:
        kind = type(record).__name__
        raise ValueError(f"a {call} answer ({kind}) lacks {name!r}; allowed: a mapping with it")
    return record[name]


@dataclass(frozen=True)
class ShareAnswer:
    """A shard's answer to SHARE: its ``online`` members and, per client whose shares some of
    them refused, those members (``refused``)."""

    online: list[int]
    refused: Mapping[int, list[int]]

    def to_record(self) -> dict[str, Any]:
        return {CommitteeWire.ONLINE: list(self.online), CommitteeWire.REFUSED: self.refused}

    @classmethod
    def from_record(cls, record: object) -> ShareAnswer:
        online = _answer_entry(record, CommitteeWire.ONLINE, "SHARE")
        return cls(online, _answer_entry(record, CommitteeWire.REFUSED, "SHARE"))


@dataclass(frozen=True)
class ReleaseAnswer:
    """A shard's answer to RELEASE: the ``members`` that answer with their summed ``rows``
    (sealed to the server when channels are on) and the members among them that are ``late``."""

    members: list[int]
    rows: Any
    late: list[int]

    def to_record(self) -> dict[str, Any]:
        names = (CommitteeWire.MEMBERS, CommitteeWire.ROWS, CommitteeWire.LATE)
        return dict(zip(names, (self.members, self.rows, self.late)))

    @classmethod
    def from_record(cls, record: object) -> ReleaseAnswer:
        names = (CommitteeWire.MEMBERS, CommitteeWire.ROWS, CommitteeWire.LATE)
        return cls(*(_answer_entry(record, name, "RELEASE") for name in names))


@dataclass(frozen=True)
class CommitteeKeys:
    """What a client needs to share with the committee in one round, all public: the round,
    the scheme (n, t, k, field exponent e of p = 2^e - 1), the channel session id, the
    members' X25519 public keys (member j's at index j, 32 bytes each) and ``member_proofs``:
    member j's enrolment proof of its key (:meth:`protocols.enrolment.Identity.prove`; empty
    when the members are enrolled nowhere)."""

    round: int
    n: int
    t: int
    k: int
    field_exponent: int
    session_id: bytes
    member_keys: tuple[bytes, ...]
    member_proofs: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int | np.integer):
            raise ValueError(f"round={self.round!r}; allowed: an integer in [0, 2^63)")
        if not 0 <= self.round < 2**63:
            raise ValueError(f"round={self.round!r}; allowed: an integer in [0, 2^63)")
        self.scheme()  # checks n, t, k and the field
        if not isinstance(self.session_id, bytes) or len(self.session_id) < 16:
            raise ValueError("session_id must be at least 16 bytes")
        keys = self.member_keys
        if not isinstance(keys, tuple) or len(keys) != self.n:
            raise ValueError(f"member_keys must be a tuple of n = {self.n} public keys")
        if any(not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES for key in keys):
            raise ValueError(f"every member key must be {PUBLIC_KEY_BYTES} bytes")
        proofs = self.member_proofs
        if not isinstance(proofs, tuple) or len(proofs) not in (0, self.n):
            raise ValueError(f"member_proofs must be empty or a tuple of n = {self.n} proofs")
        if any(not isinstance(proof, bytes) for proof in proofs):
            raise ValueError("every member proof must be bytes")

    def scheme(self) -> PackedShamir:
        return PackedShamir(self.n, self.t, self.k, MersenneField(self.field_exponent))

    def width(self, length: int) -> int:
        """Field elements member j receives from one client sharing ``length`` elements."""
        return self.scheme().blocks_for(length)


def sealed_row_bytes(width: int) -> int:
    """Ciphertext bytes of one sealed row of ``width`` int64 shares (.npy payload + tag)."""
    return len(encode_array(np.zeros(width, dtype=np.int64))) + TAG_BYTES


@dataclass(frozen=True)
class SealedInput:
    """One client's SHARE message as the server relays it: the client's X25519 public key and
    ``envelopes[j]``, the envelope for member j (addressed to ``MEMBER_ID_BASE + j``)."""

    public_key: bytes
    envelopes: Mapping[int, Envelope]


@dataclass(frozen=True)
class OpenedRelease:
    """A round whose sum the server holds enough to determine: the release rows of more than t
    members reached it. Rows of a packed sharing lie on polynomials of degree < t + k, so any
    t + 1 of them give the server a linear combination of each block's k secrets and t + k give
    the sum itself (:mod:`protocols.shamir`); whatever it computes from them is post-processing
    of the sum of ``clients``' inputs, so that sum counts as released whatever the round is
    then called.

    ``round``; ``clients``: the clients whose inputs the members summed; ``members``: those
    whose rows reached the server (on time or late, opened or not: it holds its channel key);
    ``outcome``: ``"released"``, or why the round aborted after the rows reached it.
    """

    round: int
    clients: tuple[int, ...]
    members: tuple[int, ...]
    outcome: str = "released"


class CommitteeAbort(TooManyDropoutsError):
    """Too few members answered (or no client input was usable); ``needed`` and ``answered``
    say how many; ``excluded``: client -> reason, the clients left out before the abort;
    ``opened``: the :class:`OpenedRelease` when more than t members' rows had reached the
    server before it aborted (a release, to be accounted), else None."""

    excluded: Mapping[int, str] = {}
    opened: OpenedRelease | None = None

    def __init__(self, message: str, needed: int, answered: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.answered = answered


@dataclass(frozen=True)
class CommitteeFaults:
    """Which member misbehaves at which stage: ``plan[(member, stage)] = fault``.

    ``seed`` drives the tampering offsets, so a faulty round is reproducible;
    ``corrupt_in_transit`` lists (client, member) pairs whose sealed share the relay alters.
    """

    plan: Mapping[tuple[int, CommitteeStage], Fault] = field(default_factory=dict)
    seed: int = 0
    corrupt_in_transit: frozenset[tuple[int, int]] = frozenset()

    def __post_init__(self) -> None:
        for (member, stage), fault in self.plan.items():
            if stage not in ACTIVE_STAGES:
                raise ValueError(
                    f"plan has stage {stage!r} for member {member}; allowed: "
                    f"{[s.name for s in ACTIVE_STAGES]}"
                )
            if not isinstance(fault, Fault):
                raise ValueError(f"plan[({member}, {stage.name})] = {fault!r}; use a Fault")

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
        plan: dict[tuple[int, CommitteeStage], Fault] = {}
        for member in range(members):
            for stage in stages:
                u = rng.random()
                if u < drop:
                    plan[(member, stage)] = Fault.DROP
                    break
                if u < drop + late:
                    plan[(member, stage)] = Fault.LATE
                elif u < drop + late + tamper:
                    plan[(member, stage)] = Fault.TAMPER
        return cls(plan, int(rng.integers(2**32)))

    def members_with(self, fault: Fault, stage: CommitteeStage) -> set[int]:
        return {m for (m, s), f in self.plan.items() if s == stage and f == fault}

    def at(self, stage: CommitteeStage) -> StageFaults:
        """The faults of ``stage``, as shipped to the shards."""
        return StageFaults(
            drop=frozenset(self.members_with(Fault.DROP, stage)),
            late=frozenset(self.members_with(Fault.LATE, stage)),
            tamper=frozenset(self.members_with(Fault.TAMPER, stage)),
            seed=self.seed,
        )


@dataclass(frozen=True)
class StageFaults:
    """The faults of one stage, as sets of member indices, shipped to the shards."""

    drop: frozenset[int] = frozenset()
    late: frozenset[int] = frozenset()
    tamper: frozenset[int] = frozenset()
    seed: int = 0


@dataclass(frozen=True)
class ShardSealedShares:
    """One client's sealed shares as delivered to the members of a shard: its public key, one
    envelope per member (shard order) and the field elements each row must hold."""

    public_key: bytes
    envelopes: tuple[Envelope, ...]
    width: int


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


def check_layout(n: int, t: int, k: int, shards: Any, detect: Any) -> PackedShamir:
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
