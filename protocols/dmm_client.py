"""Client side of a DMM round: share the rounded update and fresh noise, seal per member.

reference/dmm.md "Our protocol, corrected", step 3. Client c of round t holds its rounded update
u_c (D signed integers, :class:`protocols.encoding.DDGaussEncoder`) and one fresh noise row
zeta_{c,i} ~ N_Z(0, s^2)^D for every row i of M released in round t, drawn by the caller from
the client's *own* secret generator. It packed-Shamir-shares each of those 1 + rows segments
(ceil(D / k) blocks each) for the round's committee and seals seat j's row of shares under a
key agreed between the client's X25519 key and seat j's fresh public key, bound to
(protocol, session, client, seat, round, SHARE). The server relays only the ciphertexts and
the client's public key (:class:`protocols.dmm.DMMSealedShares`).

Randomness is passed in: ``rng`` (the client's secret share stream) draws the share polynomials;
``private_key`` (32 bytes of the client's secret) fixes its X25519 key, or None for a key from the
OS CSPRNG.
"""

from __future__ import annotations

import numpy as np

from protocols.channels import Endpoint
from protocols.dmm import (
    CLIENT_ID_LIMIT,
    MEMBER_ID_BASE,
    PROTOCOL,
    DMMSealedShares,
    DMMStage,
    RoundKeys,
)
from protocols.shamir import PackedShamir


def share_segments(scheme: PackedShamir, segments: list[np.ndarray], rng) -> np.ndarray:
    """(n, len(segments) * blocks) packed shares of the signed integer ``segments``, each
    padded to whole blocks; ``rng`` a numpy Generator (the owner's secret stream)."""
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng is a {type(rng).__name__}; allowed: the sharing party's numpy Generator"
        )
    parts = [scheme.share(scheme.field.encode_signed(s), rng=rng) for s in segments]
    return np.hstack(parts)


def seal_client_shares(
    keys: RoundKeys,
    party: int,
    update,
    noise,
    rng: np.random.Generator,
    private_key: bytes | None = None,
) -> DMMSealedShares:
    """The client's SHARE message: shares of ``update`` (D signed ints) and ``noise``
    (``keys.rows`` x D signed ints) sealed per seat (plain rows when the round has no session
    id). ``party``: the channel id the server assigned this client for the round."""
    if isinstance(party, bool) or not isinstance(party, int | np.integer):
        raise ValueError(f"party={party!r}; allowed: an integer in [0, 2^40)")
    if not 0 <= int(party) < CLIENT_ID_LIMIT:
        raise ValueError(f"party={party!r}; allowed: an integer in [0, 2^40)")
    update = np.asarray(update)
    noise = np.asarray(noise)
    if update.shape != (keys.dim,) or update.dtype.kind not in "iu":
        raise ValueError(
            f"update has shape {update.shape} and dtype {update.dtype}; allowed: ({keys.dim},) "
            "integers"
        )
    if noise.shape != (keys.rows, keys.dim) or (noise.size and noise.dtype.kind not in "iu"):
        raise ValueError(
            f"noise has shape {noise.shape} and dtype {noise.dtype}; allowed: "
            f"({keys.rows}, {keys.dim}) integers"
        )
    scheme = keys.scheme()
    segments = [update.astype(np.int64), *noise.astype(np.int64)]
    shares = share_segments(scheme, segments, rng)
    if keys.session_id is None:
        return DMMSealedShares(int(party), b"", {int(j): shares[j] for j in keys.member_keys})
    endpoint = Endpoint(int(party), keys.session_id, protocol=PROTOCOL, private_key=private_key)
    sealed = {}
    for j, key in sorted(keys.member_keys.items()):
        endpoint.connect(MEMBER_ID_BASE + int(j), key)
        sealed[int(j)] = endpoint.seal_array(
            MEMBER_ID_BASE + int(j), keys.round, DMMStage.SHARE, shares[int(j)]
        )
    return DMMSealedShares(int(party), endpoint.public_key, sealed)
