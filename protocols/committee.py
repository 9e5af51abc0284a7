"""The packed-Shamir sum committee: its public round parameters and the client's SHARE step.

A committee of ``n`` members (privacy threshold ``t``, ``k`` secrets per polynomial,
:mod:`protocols.shamir`) sums vectors of field elements (F_p, p = 2^e - 1) that clients share
with it; the server relays and sees only ciphertexts (members' side:
:mod:`fedsim.engine.committee`). A round moves through :class:`CommitteeStage`:

1. **SHARE** (the client, :func:`seal_input`): the client packed-Shamir-shares its vector --
   share randomness from *its own* secret stream -- and seals row j of the shares for member j
   under a key agreed between its X25519 key and member j's public key (:class:`CommitteeKeys`,
   published for the round), bound to (``CHANNEL_PROTOCOL``, session, client, member, round,
   SHARE) (:mod:`protocols.channels`). What leaves the client is a :class:`SealedInput`: its
   public key and one envelope per member.
2. **COMBINE**: each member sums its rows of the agreed clients (shares of the sum).
3. **RELEASE**: each member seals its summed row for the server, which decodes the sum.

Any t members' rows are uniformly distributed whatever the vector; the server together with at
most t members learns nothing of one client's vector beyond the released sum.

Randomness is passed in: ``rng`` (the client's share stream) draws the share polynomials,
``private_key`` (32 bytes of the client's secret) fixes its X25519 key, or None for a key from
the OS CSPRNG.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocols.channels import PUBLIC_KEY_BYTES, TAG_BYTES, Endpoint, Envelope, encode_array
from protocols.field import MersenneField
from protocols.secagg import check_move
from protocols.shamir import PackedShamir

CHANNEL_PROTOCOL = b"fedsim/committee"
"""The protocol label every committee channel binds (protocols.channels associated data)."""

MEMBER_ID_BASE = 2**62
"""Channel party id of member j: MEMBER_ID_BASE + j; clients' ids lie in [0, MEMBER_ID_BASE)."""


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


def check_client_id(party) -> int:
    """``party`` as a client's channel id, or ``ValueError``: an integer in [0, 2^62)."""
    if isinstance(party, bool) or not isinstance(party, int | np.integer):
        raise ValueError(f"client id {party!r}; allowed: an integer in [0, 2^62)")
    if not 0 <= int(party) < MEMBER_ID_BASE:
        raise ValueError(f"client id {party}; allowed: an integer in [0, 2^62)")
    return int(party)


@dataclass(frozen=True)
class CommitteeKeys:
    """What a client needs to share with the committee in one round, all public: the round,
    the scheme (n, t, k, field exponent e of p = 2^e - 1), the channel session id and the
    members' X25519 public keys (member j's at index j, 32 bytes each)."""

    round: int
    n: int
    t: int
    k: int
    field_exponent: int
    session_id: bytes
    member_keys: tuple[bytes, ...]

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


def seal_input(
    keys: CommitteeKeys,
    party: int,
    vector,
    rng: np.random.Generator,
    private_key: bytes | None = None,
) -> SealedInput:
    """The client's SHARE message: packed shares of ``vector`` (field elements of F_p), row j
    sealed for member j. ``party``: the client's channel id for the round (assigned by the
    server); ``rng``: the client's own share stream; ``private_key``: 32 bytes of its secret
    for its X25519 key (None: from the OS CSPRNG)."""
    party = check_client_id(party)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng is a {type(rng).__name__}; allowed: the sharing client's numpy Generator"
        )
    scheme = keys.scheme()
    values = scheme.field.asarray(vector, "vector")
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"vector has shape {values.shape}; allowed: a non-empty 1-D vector")
    shares = scheme.share(values, rng=rng)
    endpoint = Endpoint(party, keys.session_id, CHANNEL_PROTOCOL, private_key)
    envelopes = {}
    for j, member_key in enumerate(keys.member_keys):
        endpoint.connect(MEMBER_ID_BASE + j, member_key)
        envelopes[j] = endpoint.seal_array(
            MEMBER_ID_BASE + j, keys.round, CommitteeStage.SHARE, shares[j]
        )
    return SealedInput(endpoint.public_key, envelopes)
