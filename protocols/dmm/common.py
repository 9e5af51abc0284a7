"""The distributed matrix mechanism (DMM): what clients, committee members and the server share.

Bienstock, Kumar & Polychroniadou, ICML 2025, as docs/dmm-design.md sets it out. The
mechanism is a public *integer* strategy matrix M (m rows x T rounds, int64;
``M = round(2^f C)`` for a banded C, or the 0/1 binary-tree matrix with f = 0). Row i is
released in round r_i, its last non-zero column, as

    y_i = sum_{s <= r_i} M[i, s] X_s + z_i,        z_i = sum_{c in S_i} zeta_{c,i},

where X_s is the sum of round s's rounded client updates (D integers) and zeta_{c,i} ~
N_Z(0, s^2)^D is *fresh* discrete Gaussian noise that client c of round r_i draws from its own
secret randomness. The committee of round t holds packed Shamir shares of the partial sums
P_j = sum_{s < t} M[j, s] X_s of the rows j that are open (started, not yet released): the DATA,
never noise. In round t it adds the shares of X_t and of the z_i it receives, releases y_i for
the rows i with r_i = t, and hands the partial sums of the rows still open to the next round's
committee by linear resharing. For a banded M with b bands that state is b - 1 vectors (the same
as the b - 1 most recent X_s); for the tree, one per open node (at most log2 T + 1).

**A lattice noise protects only shifts that lie on its lattice.** The noise z here is added to
each released coordinate directly (its lattice is Z^{m x D}); a neighbouring dataset shifts the
release by sum_{s in pattern} M[:, s] (u_s - u'_s), an integer vector because M and the rounded
updates are integers: the shift lies on the noise's lattice. (The first version of this design
released M^{-1}-weighted noise on the lattice M Z^m and leaked frac(M^{-1} y) without noise.)

This module holds what every side needs: the public :class:`Schedule` of M, the round's stages
(:class:`DMMStage`, an explicit state machine), the public :class:`RoundKeys` a client shares
with, the :class:`DMMSealedShares` message, the simulation's :class:`DMMFaults` and the errors.
The client side is :mod:`protocols.dmm.client`, the member side :mod:`protocols.dmm.member`,
the server side :mod:`protocols.dmm.server`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from functools import cached_property

import numpy as np

from protocols.field import MersenneField
from protocols.kit import Fault, MemberSide, StageError, TooManyDropoutsError, check_move
from protocols.shamir import PackedShamir

PROTOCOL = b"fedsim/dmm"
"""The protocol label every DMM channel binds into its keys and associated data."""
CLIENT_ID_LIMIT = 2**40
"""Clients' channel party ids lie in [0, CLIENT_ID_LIMIT)."""
FOLD_PAD = "FOLD_PAD"
"""Stage label of a folded client's sealed pad seed (:class:`FoldedClient`)."""
PAD_SEED_BYTES = 32
"""Bytes of one pad seed."""


class MemberCall(StrEnum):
    """The requests a DMM server makes of a committee's pool (``pool.call`` /
    ``pool.broadcast``), answered by :meth:`protocols.dmm.member.MemberGroup.answer`."""

    ACCUMULATE = "accumulate"
    ANNOUNCE = "announce"
    ANNOUNCE_HANDOFF = "announce_handoff"
    CHECK_SHARES = "check_shares"
    COMBINE = "combine"
    COMMIT = "commit"
    CONNECT = "connect"
    DEAL = "deal"
    DISCARD = "discard"
    KEEP = "keep"
    KEY_PROOFS = "key_proofs"
    RECEIVE = "receive"
    RELEASE = "release"
    RETIRE = "retire"
    SHARE = "share"
    SNAPSHOT = "snapshot"


class DMMStage(Enum):
    """Stages of one DMM round, in order; ABORTED is reachable from every live stage."""

    SETUP = 0
    SHARE = 1
    COMBINE = 2
    RELEASE = 3
    RESHARE = 4
    DONE = 5
    ABORTED = 6


ACTIVE = (DMMStage.SHARE, DMMStage.COMBINE, DMMStage.RELEASE, DMMStage.RESHARE)

TRANSITIONS: dict[DMMStage, frozenset[DMMStage]] = {
    DMMStage.SETUP: frozenset({DMMStage.SHARE, DMMStage.RESHARE, DMMStage.ABORTED}),
    DMMStage.SHARE: frozenset({DMMStage.COMBINE, DMMStage.ABORTED}),
    DMMStage.COMBINE: frozenset({DMMStage.RELEASE, DMMStage.ABORTED}),
    DMMStage.RELEASE: frozenset({DMMStage.RESHARE, DMMStage.ABORTED}),
    DMMStage.RESHARE: frozenset({DMMStage.DONE, DMMStage.ABORTED}),
    DMMStage.DONE: frozenset(),
    DMMStage.ABORTED: frozenset(),
}
"""Allowed moves. SETUP -> RESHARE is the next committee's: it enters a round only to receive
the handoff."""


def check_transition(current: DMMStage, target: DMMStage, who: str) -> None:
    """Raise :class:`protocols.kit.StageError` unless ``current -> target`` is allowed."""
    check_move(TRANSITIONS, current, target, who)


class MemberRefused(ValueError):
    """A committee member refused a request (wrong step, stage, seat, client or shape)."""


@dataclass(frozen=True)
class OpenedRelease:
    """A round whose release the server holds enough to determine: the release shares of more
    than t members reached it. Shares of a packed sharing lie on a polynomial of degree
    < t + k, so any t + 1 of them give the server linear combinations of each block's k noisy
    values and t + k (with a colluding member naming its own wrong share) give the rows
    y_i themselves; whatever it computes from them is post-processing of the rows released at
    ``step``, so they count as released whatever the round is then called.

    ``step``; ``rows``: the rows of M released at it; ``clients``: how many clients' noise
    they carry; ``members``: the seats whose shares reached the server (on time or late,
    opened or not: it holds the channel key); ``outcome``: ``"released"`` or why the round
    aborted after the shares reached it.
    """

    step: int
    rows: tuple[int, ...]
    clients: int
    members: tuple[int, ...]
    outcome: str = "released"


class DMMAbort(TooManyDropoutsError):
    """The round released nothing; ``stage``, ``needed`` and ``answered`` say why. The
    committee's state is as before the round. ``opened``: the :class:`OpenedRelease` when more
    than t members' release shares had reached the server before it aborted (a release, to be
    accounted), else None."""

    opened: OpenedRelease | None = None

    def __init__(self, message: str, stage: DMMStage, needed: int, answered: int) -> None:
        super().__init__(message)
        self.stage, self.needed, self.answered = stage, needed, answered


class StateLost(DMMAbort):
    """Fewer than t + k members still hold the state: the mechanism cannot continue."""


class Schedule:
    """The public integer strategy matrix M (m x T, int64) and when each row is used.

    Row i is *released* in round ``release_rounds[i]`` (its last non-zero column) and *open*
    from its first non-zero column until then. Rows must be ordered by release round (the order
    the noise rows are drawn). Members and the server both hold it, so a member computes what
    it releases from M itself and never from a coefficient the server sends.
    """

    def __init__(self, matrix) -> None:
        M = np.asarray(matrix)
        if M.ndim != 2 or M.size == 0 or M.dtype.kind not in "iu":
            raise ValueError(
                f"matrix has shape {M.shape} and dtype {M.dtype}; allowed: a non-empty 2-D "
                "integer matrix (m rows x T rounds)"
            )
        M = M.astype(np.int64)
        nonzero = M != 0
        if not np.all(nonzero.any(axis=1)):
            raise ValueError("matrix has an all-zero row; every row must be released once")
        self.matrix = M
        self.release_rounds = M.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)
        self.first_rounds = np.argmax(nonzero, axis=1)
        if np.any(np.diff(self.release_rounds) < 0):
            raise ValueError("matrix rows must be ordered by release round (last non-zero column)")

    @property
    def rounds(self) -> int:
        """T, the number of rounds (columns)."""
        return int(self.matrix.shape[1])

    @property
    def rows(self) -> int:
        """m, the number of released rows."""
        return int(self.matrix.shape[0])

    def released_at(self, t: int) -> tuple[int, ...]:
        """Rows released in round t."""
        return tuple(int(i) for i in np.flatnonzero(self.release_rounds == t))

    def open_after(self, t: int) -> tuple[int, ...]:
        """Rows whose partial sums a committee holds after round t (t = -1: none)."""
        started = self.first_rounds <= t
        return tuple(int(i) for i in np.flatnonzero(started & (self.release_rounds > t)))

    def coefficient(self, row: int, t: int) -> int:
        return int(self.matrix[row, t])

    @cached_property
    def max_row_l1(self) -> int:
        """max_i sum_s |M[i, s]|: the most a release row amplifies one round sum."""
        return int(np.abs(self.matrix).sum(axis=1).max())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and np.array_equal(self.matrix, other.matrix)

    def __hash__(self) -> int:
        return hash(self.matrix.tobytes())

    def __getstate__(self) -> dict:
        return {"matrix": self.matrix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["matrix"])


class DMMKeys:
    """DMM's wire names, all in one place: the records of its instructions and replies
    (``dmm.*``), the ``dmm.share.*`` entries of a full-mode instruction
    (:class:`strategies.secure.dmm.wire.ShareConfig`), the entries of a sealed-shares record and of
    a member group's RELEASE answer."""

    NAME = "dmm"
    PREFIX = "dmm."
    SHARE_PREFIX = "dmm.share."
    UPDATE = "dmm.update"
    NOISE = "dmm.noise"
    FOLD = "dmm.fold"
    PADS = "dmm.pads"
    BATCH = "dmm.batch"
    SEALED = "dmm.sealed"
    # the dmm.* entries of an instruction, without their prefix
    DIM, CLIP, GAMMA, BETA, MAX_TRIES = "dim", "clip", "gamma", "beta", "max-tries"
    ROTATION_SEED, NOISE_STD, ROWS, MODE = "rotation-seed", "noise-std", "rows", "mode"
    INSTRUCTION = (DIM, CLIP, GAMMA, BETA, MAX_TRIES, ROTATION_SEED, NOISE_STD, ROWS, MODE)
    """The ``dmm.*`` entries of every instruction
    (:func:`strategies.secure.dmm.wire.instruction`)."""
    # the dmm.share.* entries (:class:`strategies.secure.dmm.wire.ShareConfig`), without their
    # prefix (``dim`` as above)
    ROUND, STEP, N, T, K, FIELD_EXPONENT = "round", "step", "n", "t", "k", "field-exponent"
    SESSION, MEMBERS, MEMBER_KEYS, PARTY = "session", "members", "member-keys", "party"
    MEMBER_PROOFS, COHORT = "member-proofs", "cohort"
    COMMITTEE_ROUND, COMMITTEE = "committee-round", "committee"
    SHARE = (ROUND, STEP, N, T, K, FIELD_EXPONENT, DIM, SESSION, MEMBERS, MEMBER_KEYS, PARTY)
    """The ``dmm.share.*`` entries every full-mode instruction holds (a folded round's has
    ``cohort`` in place of ``party``)."""
    MASKED = "masked"
    """The array of a :attr:`FOLD` record: the client's padded share rows."""
    BATCH_ENTRIES = ("nodes", "public-keys", "pad-nonces", "pad-ciphertexts")
    """The entries of a folded reply's :attr:`BATCH` record
    (:class:`strategies.secure.dmm.fold.ShareFoldReducer`)."""
    SEALED_ENTRIES = ("public-key", "members", "nonces", "ciphertexts")
    """The entries of a sealed-shares record
    (:func:`strategies.secure.dmm.wire.sealed_to_record`)."""
    RELEASE_ENTRIES = ("seats", "rows", "late")
    """The entries of a member group's answer to RELEASE (:class:`ReleaseAnswer`)."""


@dataclass(frozen=True)
class ReleaseAnswer:
    """A member group's answer to RELEASE: its online ``seats`` with their shares of the
    released rows (``rows``, sealed to the server when channels are on) and the seats among
    them whose answer misses the deadline (``late``). Read leniently, as the server reads any
    member's word: an entry left out is empty."""

    seats: list
    rows: list
    late: list

    def to_record(self) -> dict[str, list]:
        return dict(zip(DMMKeys.RELEASE_ENTRIES, (self.seats, self.rows, self.late)))

    @classmethod
    def from_record(cls, record: Mapping) -> ReleaseAnswer:
        return cls(*(list(record.get(name, [])) for name in DMMKeys.RELEASE_ENTRIES))


@dataclass(frozen=True)
class RoundKeys:
    """What a client needs to share in one round, all public: the scheme (n, t, k, field
    exponent), D, the round and mechanism step, the number of noise rows released this step,
    the channel session id (None: plain rows, no encryption), the online seats' fresh
    X25519 public keys (seat -> 32 bytes; b'' without encryption) and ``member_proofs``: seat ->
    the enrolment proof of its key (:meth:`protocols.enrolment.Identity.prove`; empty when the
    members are enrolled nowhere)."""

    round: int
    step: int
    rows: int
    n: int
    t: int
    k: int
    field_exponent: int
    dim: int
    session_id: bytes | None
    member_keys: Mapping[int, bytes]
    member_proofs: Mapping[int, bytes] = field(default_factory=dict)

    def scheme(self) -> PackedShamir:
        return PackedShamir(self.n, self.t, self.k, MersenneField(self.field_exponent))

    @property
    def width(self) -> int:
        """Field elements one member receives from one client: (1 + rows) segments of
        ceil(D / k) blocks (the update, then one noise row per released row)."""
        return (1 + self.rows) * (-(-self.dim // self.k))


@dataclass(frozen=True)
class FoldedClient:
    """A client in a folded SHARE message, and the proof that its shares are in the fold: its
    channel ``party``, its ``public_key`` and per seat j the sealed seed (``pads[j]``, an
    :class:`protocols.channels.Envelope` to ``SEAT_ID_BASE + j`` at :data:`FOLD_PAD`) of the
    pad it added to its row of shares before handing it to the fold
    (:func:`protocols.dmm.client.mask_client_shares`). Seat j removes the pad of every folded
    client listed; a row the fold left out (or a client it lists without its row) leaves a
    uniform pad in seat j's share, which no release decodes, so the fold cannot count clients
    whose noise it does not carry."""

    party: int
    public_key: bytes
    pads: Mapping[int, object]


@dataclass(frozen=True)
class DMMSealedShares:
    """One client's SHARE message as the server holds it: its channel party id, its public
    key, and per seat j one :class:`protocols.channels.Envelope` addressed to
    ``SEAT_ID_BASE + j`` (plain share rows only when the round runs without encryption).
    ``folded``: for a worker's folded message, the clients whose masked rows it sums
    (:class:`FoldedClient`); empty for a client's own message."""

    party: int
    public_key: bytes
    shares: Mapping[int, object]
    folded: tuple[FoldedClient, ...] = ()


@dataclass(frozen=True)
class DMMFaults:
    """Injected faults of one round (simulation). Seats index the committee.

    ``member[(j, stage)]``: 'drop' (silent from ``stage`` on), 'late' (RELEASE only: its share
    misses the deadline) or 'tamper' (adds a non-zero offset to what it holds at COMBINE, sends
    at RELEASE, or deals at RESHARE); ``client_drop[i]``: the stage at which client i stops (at
    SHARE it sends nothing; later its shares are already with the members); ``client_partial``:
    clients whose shares reach only seats ``< n // 2``; ``next_drop``: seats of the next
    committee gone at RESHARE; ``corrupt_in_transit``: (client, seat) pairs whose sealed shares
    the relay alters; ``seed``: the tampering offsets' public stream.
    """

    member: Mapping[tuple[int, DMMStage], Fault | str] = field(default_factory=dict)
    client_drop: Mapping[int, DMMStage] = field(default_factory=dict)
    client_partial: frozenset[int] = frozenset()
    next_drop: frozenset[int] = frozenset()
    corrupt_in_transit: frozenset[tuple[int, int]] = frozenset()
    seed: int = 0

    def __post_init__(self) -> None:
        for (j, stage), kind in self.member.items():
            if stage not in ACTIVE or kind not in tuple(Fault):
                raise ValueError(
                    f"member[({j}, {stage})] = {kind!r}; allowed stages "
                    f"{[s.name for s in ACTIVE]} and faults 'drop', 'late', 'tamper'"
                )
            if kind == Fault.TAMPER and stage is DMMStage.SHARE:
                raise ValueError(
                    f"member[({j}, SHARE)] = 'tamper'; members hold nothing to alter before "
                    "COMBINE (a corrupted client share is corrupt_in_transit)"
                )
            if kind == Fault.LATE and stage is not DMMStage.RELEASE:
                raise ValueError(
                    f"member[({j}, {stage.name})] = 'late'; only RELEASE has a deadline"
                )
        for i, stage in self.client_drop.items():
            if stage not in ACTIVE:
                raise ValueError(f"client_drop[{i}] = {stage!r}; allowed: {ACTIVE}")

    def members(self, kind: Fault, stage: DMMStage) -> set[int]:
        return {j for (j, s), f in self.member.items() if s is stage and f == kind}

    def dropped_by(self, stage: DMMStage) -> set[int]:
        """Seats silent at ``stage`` (dropped there or earlier)."""
        order = ACTIVE.index(stage)
        return {
            j for (j, s), f in self.member.items() if f == Fault.DROP and ACTIVE.index(s) <= order
        }


REFUSALS = (MemberRefused, StageError)
"""What a member raises for a request it will not serve."""

SILENT: dict[MemberCall, object] = {
    MemberCall.ACCUMULATE: None,
    MemberCall.ANNOUNCE: {},
    MemberCall.ANNOUNCE_HANDOFF: {},
    MemberCall.CHECK_SHARES: {},
    MemberCall.COMBINE: [],
    MemberCall.COMMIT: None,
    MemberCall.CONNECT: [],
    MemberCall.DEAL: {},
    MemberCall.DISCARD: None,
    MemberCall.KEEP: None,
    MemberCall.KEY_PROOFS: {},
    MemberCall.RECEIVE: [],
    MemberCall.RELEASE: ReleaseAnswer([], [], []).to_record(),
    MemberCall.RETIRE: None,
    MemberCall.SHARE: {},
    MemberCall.SNAPSHOT: None,
}
"""What each call answers for seats that are gone (a crashed or refusing member)."""

MEMBERS = MemberSide(calls=(MemberCall,), silent=SILENT, refusals=REFUSALS)
"""DMM's member side: groups answer :class:`MemberCall`; a refusing or crashed group is silent
(:data:`SILENT`) and the round goes on without its seats."""


MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError)
"""What a malformed request's arguments raise in a handler (refused as :class:`MemberRefused`)."""


def refusing(name: str):
    """A member request named ``name`` (a handler, or a method): anything malformed in its
    arguments is refused as :class:`MemberRefused` naming the request (handlers check before
    they change anything)."""

    def wrap(handler):
        @functools.wraps(handler)
        def checked(*args, **kwargs):
            try:
                return handler(*args, **kwargs)
            except REFUSALS:
                raise
            except MALFORMED as err:
                raise MemberRefused(f"{name}: malformed request ({err})") from None

        return checked

    return wrap


def request(handler):
    """A member request method: :func:`refusing` under the method's name."""
    return refusing(handler.__name__)(handler)
