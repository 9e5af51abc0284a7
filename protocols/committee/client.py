"""Client side of a committee round: share the vector, seal each member's row.

:mod:`protocols.committee` step 1 (SHARE). The client packed-Shamir-shares its vector of field
elements (F_p, p = 2^e - 1) with the round's scheme and seals row j of the shares for member j
under a key agreed between its X25519 key and member j's public key (:class:`CommitteeKeys`),
bound to (``CHANNEL_PROTOCOL``, session, client, member, round, SHARE). The server relays only
the ciphertexts and the client's public key (:class:`protocols.committee.common.SealedInput`).

Randomness is passed in: ``rng`` (the client's share stream) draws the share polynomials,
``private_key`` (32 bytes of the client's secret) fixes its X25519 key, or None for a key from
the OS CSPRNG.

Keys are checked before anything is sealed: a client holding its enrolment's
:class:`protocols.enrolment.KeyVerifier` seals only to member keys that n distinct enrolled
members signed for this session and seat (:func:`check_member_keys`); a substituted key raises
:class:`protocols.channels.KeySubstitution` and nothing leaves the client.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocols.channels import Endpoint, KeySubstitution
from protocols.committee.common import (
    CHANNEL_PROTOCOL,
    CommitteeKeys,
    CommitteeStage,
    SealedInput,
    check_client_id,
)
from protocols.enrolment import KeyVerifier
from protocols.kit import MEMBER_ID_BASE


def check_member_keys(
    keys: CommitteeKeys, verifier: KeyVerifier, names: Sequence[str] | None = None
) -> list[str]:
    """The enrolled names behind the members' keys, or :class:`KeySubstitution` naming the
    member whose key no enrolled member signed for this session and seat (or whose name is
    not ``names[j]``, or is another seat's)."""
    if len(keys.member_proofs) != keys.n:
        raise KeySubstitution(
            f"round {keys.round}: the committee's member keys carry no enrolment proofs; "
            "this client seals only to enrolled members"
        )
    entries = [
        (
            f"committee member {j}",
            MEMBER_ID_BASE + j,
            (key,),
            keys.member_proofs[j],
            None if names is None else names[j],
        )
        for j, key in enumerate(keys.member_keys)
    ]
    return verifier.check_all(entries, protocol=CHANNEL_PROTOCOL, session_id=keys.session_id)


def seal_input(
    keys: CommitteeKeys,
    party: int,
    vector,
    rng: np.random.Generator,
    private_key: bytes | None = None,
    verifier: KeyVerifier | None = None,
    names: Sequence[str] | None = None,
) -> SealedInput:
    """The client's SHARE message: packed shares of ``vector`` (field elements of F_p), row j
    sealed for member j. ``party``: the client's channel id for the round (assigned by the
    server); ``rng``: the client's own share stream; ``private_key``: 32 bytes of its secret
    for its X25519 key (None: from the OS CSPRNG); ``verifier``: the client's enrolment, which
    every member key must pass first (:func:`check_member_keys`, with the expected ``names``;
    None: keys are taken as relayed)."""
    party = check_client_id(party)
    if verifier is not None:
        check_member_keys(keys, verifier, names)
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
