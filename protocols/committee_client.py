"""Client side of a committee round: share the vector, seal each member's row.

:mod:`protocols.committee` step 1 (SHARE). The client packed-Shamir-shares its vector of field
elements (F_p, p = 2^e - 1) with the round's scheme and seals row j of the shares for member j
under a key agreed between its X25519 key and member j's public key (:class:`CommitteeKeys`),
bound to (``CHANNEL_PROTOCOL``, session, client, member, round, SHARE). The server relays only
the ciphertexts and the client's public key (:class:`protocols.committee.SealedInput`).

Randomness is passed in: ``rng`` (the client's share stream) draws the share polynomials,
``private_key`` (32 bytes of the client's secret) fixes its X25519 key, or None for a key from
the OS CSPRNG.
"""

from __future__ import annotations

import numpy as np

from protocols.channels import Endpoint
from protocols.committee import (
    CHANNEL_PROTOCOL,
    MEMBER_ID_BASE,
    CommitteeKeys,
    CommitteeStage,
    SealedInput,
    check_client_id,
)


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
