"""Client side of a DMM round: share the rounded update and fresh noise, seal per member.

docs/dmm-design.md, step 3. Client c of round t holds its rounded update
u_c (D signed integers, :class:`protocols.encoding.DDGaussEncoder`) and one fresh noise row
zeta_{c,i} ~ N_Z(0, s^2)^D for every row i of M released in round t, drawn by the caller from
the client's *own* secret generator. It packed-Shamir-shares each of those 1 + rows segments
(ceil(D / k) blocks each) for the round's committee and seals seat j's row of shares under a
key agreed between the client's X25519 key and seat j's fresh public key, bound to
(protocol, session, client, seat, round, SHARE). The server relays only the ciphertexts and
the client's public key (:class:`protocols.dmm.common.DMMSealedShares`).

Folding (a simulation's worker batch): sharing is linear, so the clients a worker runs may add
their sharing inputs -- segments and share randomness, each drawn from the client's own secret
stream -- into a :class:`ShareFold` that deals the sum once and seals one row per seat from the
batch's channel (:func:`seal_rows`): each seat receives one share of the batch's sum instead of
one share per client, which tells it (and any coalition of seats) less, never more.

A fold the members can check (:class:`MaskedFold`): each client deals its own shares, adds to
seat j's row a pad expanded (AES-256-CTR) from a seed of its own secret stream, and seals only the
seed to seat j (:func:`mask_client_shares`, 32 bytes per seat); the fold sums the masked rows
and lists each client with its sealed seeds (:class:`protocols.dmm.common.FoldedClient`). Seat j
removes every listed client's pad: the sum is exact when the fold holds every listed client's
row, and off by a uniform pad at every honest seat when it lists a client whose row it left out
-- the fold proves who is in it, and never learns a client's shares (they are padded).

Randomness is passed in: ``rng`` (the client's secret share stream) draws the share polynomials;
``private_key`` (32 bytes of the client's secret) fixes its X25519 key, or None for a key from the
OS CSPRNG.

Keys are checked before anything is sealed: with its enrolment's
:class:`protocols.enrolment.KeyVerifier` a client seals only to seat keys that distinct enrolled
parties signed for this session and seat (:func:`check_seat_keys`); a substituted key raises
:class:`protocols.channels.KeySubstitution` and nothing is sealed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocols.channels import Endpoint, KeySubstitution
from protocols.dmm.common import (
    CLIENT_ID_LIMIT,
    FOLD_PAD,
    PAD_SEED_BYTES,
    PROTOCOL,
    DMMSealedShares,
    DMMStage,
    FoldedClient,
    RoundKeys,
)
from protocols.enrolment import KeyVerifier
from protocols.field import MersenneField
from protocols.kit import SEAT_ID_BASE
from protocols.limbs import MersenneSum, subtract_once
from protocols.secagg.prg import MaskPRG
from protocols.shamir import PackedShamir


def fold_pad(field: MersenneField, seed: bytes, width: int) -> np.ndarray:
    """``width`` field elements expanded from a 32-byte ``seed`` (the AES-256-CTR keystream of
    :attr:`protocols.secagg.prg.MaskPRG.AES_CTR`, 8 bytes per element, its low e bits reduced
    mod p = 2^e - 1: uniform up to 2^-e, and the keystream within q(q-1)/2^129 of uniform over
    q blocks by the PRP/PRF switching lemma, as that class's docstring argues). Each seed keys
    one pad only: it is drawn afresh for one seat of one round."""
    return low_bits_mod_p(field, pad_words(field, seed, width))


def pad_words(
    field: MersenneField, seed: bytes, width: int, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`fold_pad` before its reduction: the low e bits of each keystream word, uint64
    in [0, p] (p stands for 0). ``out``: a little-endian uint64 array of ``width`` words the
    keystream is written into and masked in place (returned), so that a party expanding many
    pads allocates none."""
    if not isinstance(seed, bytes) or len(seed) != PAD_SEED_BYTES:
        raise ValueError(f"a pad seed is {PAD_SEED_BYTES} bytes, got {seed!r:.40}")
    width = int(width)
    words = np.empty(width, dtype=_WORD) if out is None else out
    if words.shape != (width,) or words.dtype != _WORD or not words.flags.c_contiguous:
        raise ValueError(
            f"out is a {words.dtype} array of shape {words.shape}; allowed: a contiguous "
            f"little-endian uint64 array of shape ({width},)"
        )
    MaskPRG.AES_CTR.keystream(seed).update_into(_zeros(8 * width), words.view(np.uint8))
    return np.bitwise_and(words, np.uint64(field.modulus), out=words)


_WORD = np.dtype("<u8")
"""A pad's keystream word: 8 bytes, little-endian."""


@functools.lru_cache(maxsize=8)
def _zeros(size: int) -> bytes:
    """``size`` zero bytes (the plaintext whose encryption is the keystream), kept per size."""
    return bytes(size)


def low_bits_mod_p(field: MersenneField, words: np.ndarray) -> np.ndarray:
    """In place: the low e bits of uint64 ``words`` mod p = 2^e - 1, viewed as int64 (the low
    e bits are at most p, and p is 0 mod p)."""
    modulus = np.uint64(field.modulus)
    np.bitwise_and(words, modulus, out=words)
    subtract_once(words, modulus, np.empty_like(words))
    return words.view(np.int64)


def _add_in_place(
    row: np.ndarray, pad: np.ndarray, modulus: int, scratch: np.ndarray | None = None
) -> None:
    """In place: ``row`` + ``pad`` mod p (``row`` in [0, p), ``pad`` in [0, p], p standing
    for 0: the sum stays below 2p < 2^62); ``scratch``: a uint64 array of the row's shape."""
    unsigned = row.view(np.uint64)
    unsigned += pad.view(np.uint64)
    if scratch is None:
        scratch = np.empty_like(unsigned)
    subtract_once(unsigned, np.uint64(modulus), scratch)


@dataclass(frozen=True)
class MaskedShares:
    """What a folded client hands its fold: its shares with each seat's row padded
    (``rows``: (n, width) field elements) and the proof of its pads
    (:class:`protocols.dmm.common.FoldedClient`)."""

    rows: np.ndarray
    client: FoldedClient


def mask_client_shares(
    keys: RoundKeys,
    party: int,
    update,
    noise,
    rng,
    private_key: bytes | None = None,
    out: np.ndarray | None = None,
) -> MaskedShares:
    """Deal ``update`` and ``noise`` like :func:`seal_client_shares`, then pad seat j's row
    with :func:`fold_pad` of a seed drawn from ``rng`` (the client's own stream) and seal the
    seed to seat j at :data:`protocols.dmm.common.FOLD_PAD` from channel ``party``. ``out``:
    the (n, width) int64 array the padded rows are written into (e.g. a reply's payload,
    :func:`fedsim.record_codec.array_to_fill`)."""
    party = _party(party)
    if keys.session_id is None:
        raise ValueError("keys.session_id=None; folds are sealed over encrypted channels")
    scheme = keys.scheme()
    segments = [_update(keys, update), *_noise(keys, noise)]
    rows = share_segments(scheme, segments, rng, out=out)
    endpoint = Endpoint(party, keys.session_id, protocol=PROTOCOL, private_key=private_key)
    seats = sorted(keys.member_keys)
    seeds = [rng.bytes(PAD_SEED_BYTES) for _ in seats]  # seat by seat, as the pads are added
    pads = {}
    pad, scratch = np.empty(keys.width, dtype=_WORD), np.empty(keys.width, dtype=np.uint64)
    for j, seed in zip(seats, seeds):
        pad_words(scheme.field, seed, keys.width, out=pad)
        _add_in_place(rows[int(j)], pad, scheme.field.modulus, scratch)
        endpoint.connect(SEAT_ID_BASE + int(j), keys.member_keys[j])
        pads[int(j)] = endpoint.seal(SEAT_ID_BASE + int(j), keys.round, FOLD_PAD, seed)
    return MaskedShares(rows, FoldedClient(party, endpoint.public_key, pads))


class MaskedFold:
    """The sum of several clients' :class:`MaskedShares` for one round, with the list of who
    is in it; :meth:`seal` seals one row per seat from the fold's own channel ``party``. The
    rows are summed one addition each (:class:`protocols.limbs.MersenneSum`), reduced once
    when sealed."""

    def __init__(self, keys: RoundKeys) -> None:
        self.keys = keys
        self.field = keys.scheme().field
        self.clients: list[FoldedClient] = []
        self._rows = MersenneSum(self.field.exponent, (keys.n, keys.width))

    def add(self, masked: MaskedShares) -> None:
        """One client's padded rows; ValueError naming what is malformed."""
        rows = self.field.asarray(masked.rows, "masked rows")
        if rows.shape != (self.keys.n, self.keys.width):
            raise ValueError(
                f"masked rows have shape {rows.shape}; allowed ({self.keys.n}, {self.keys.width})"
            )
        if not isinstance(masked.client, FoldedClient):
            raise ValueError(f"a {type(masked.client).__name__}, not a FoldedClient")
        self._rows.add(rows.view(np.uint64))
        self.clients.append(masked.client)

    def seal(self, party: int) -> DMMSealedShares:
        """The folded SHARE message (a fresh channel key from the OS for the fold itself)."""
        if not self.clients:
            raise ValueError("nothing was added to the fold")
        sealed = seal_rows(self.keys, party, self._rows.value().view(np.int64))
        return DMMSealedShares(sealed.party, sealed.public_key, sealed.shares, tuple(self.clients))


def share_segments(
    scheme: PackedShamir, segments: list[np.ndarray], rng, out: np.ndarray | None = None
) -> np.ndarray:
    """(n, len(segments) * blocks) packed shares of the signed integer ``segments``, each
    padded to whole blocks; ``rng`` a numpy Generator (the owner's secret stream); ``out``:
    the int64 array of that shape to write them into (as :func:`deal_inputs`)."""
    return deal_inputs(scheme, _inputs(scheme, segments, rng), out=out)


def sharing_inputs(
    scheme: PackedShamir, segments: list[np.ndarray], rng
) -> tuple[np.ndarray, np.ndarray]:
    """What fixes the packed sharing of ``segments``: the (k, S) field matrix of their blocks
    (block b of segment g in column g * blocks + b, zero-padded) and the (t, S) uniform values
    at the first t share points, drawn from ``rng`` segment by segment (S = segments x blocks).

    Sharing is linear (Franklin-Yung 1992): the shares dealt from the element-wise sums (mod p)
    of several parties' inputs are the sums of their shares, so a batch of clients may add
    their inputs (:class:`ShareFold`) and deal once; every value of the sum's polynomial at the
    first t share points is then uniform as long as one party's randomness is."""
    inputs = _inputs(scheme, segments, rng)
    return inputs[: scheme.k], inputs[scheme.k :]


def _inputs(scheme: PackedShamir, segments: list[np.ndarray], rng) -> np.ndarray:
    """The (k + t, S) matrix [secret blocks; randomness] of :func:`sharing_inputs`, filled in
    place; the randomness is one draw of (segments, t, blocks) values, the same stream as one
    draw of (t, blocks) per segment."""
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng is a {type(rng).__name__}; allowed: the sharing party's numpy Generator"
        )
    if not len(segments):
        raise ValueError("segments is empty; allowed: one or more integer vectors to share")
    sizes = {np.asarray(s).size for s in segments}
    if len(sizes) > 1:  # segments of unequal lengths: one draw per segment
        secrets = secret_blocks(scheme, segments)
        randomness = [
            scheme.field.random(rng, (scheme.t, scheme.blocks_for(np.asarray(s).size)))
            for s in segments
        ]
        return np.vstack([secrets, np.hstack(randomness)])
    blocks = scheme.blocks_for(sizes.pop())
    k, t, count = scheme.k, scheme.t, len(segments)
    inputs = np.empty((k + t, count * blocks), dtype=np.int64)
    _fill_secret_blocks(scheme, segments, inputs[:k], blocks)
    drawn = scheme.field.random(rng, (count, t, blocks))
    inputs[k:].reshape(t, count, blocks)[...] = drawn.transpose(1, 0, 2)
    return inputs


def secret_blocks(scheme: PackedShamir, segments) -> np.ndarray:
    """The (k, S) field matrix of the signed ``segments``' blocks (see :func:`sharing_inputs`)."""
    k, columns = scheme.k, []
    for segment in segments:
        out = np.empty((k, scheme.blocks_for(np.asarray(segment).size)), dtype=np.int64)
        _fill_secret_blocks(scheme, [segment], out, out.shape[1])
        columns.append(out)
    return np.hstack(columns)


def _fill_secret_blocks(scheme: PackedShamir, segments, out: np.ndarray, blocks: int) -> None:
    """Write the signed ``segments`` (each of at most ``blocks * k`` values) as field blocks
    into ``out`` ((k, len(segments) * blocks)), zero-padded."""
    k = scheme.k
    padded = np.zeros(blocks * k, dtype=np.int64)
    for g, segment in enumerate(segments):
        encoded = scheme.field.encode_signed(np.asarray(segment).ravel())
        padded[: encoded.size] = encoded
        padded[encoded.size :] = 0
        out[:, g * blocks : (g + 1) * blocks] = padded.reshape(blocks, k).T


def deal_shares(scheme: PackedShamir, secrets: np.ndarray, randomness: np.ndarray) -> np.ndarray:
    """(n, S) shares: the share matrix times [secrets (k, S); randomness (t, S)] mod p, one
    matrix product for every block of every segment."""
    return deal_inputs(scheme, np.vstack([secrets, randomness]))


def deal_inputs(
    scheme: PackedShamir, inputs: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """(n, S) shares from the stacked (k + t, S) inputs [secrets; randomness]. The first t
    seats' shares are the randomness itself (their points are nodes of the polynomial: rows
    [0 | I] of the share matrix); the other n - t are one exact product with the rest of the
    share matrix (:meth:`protocols.field.MersenneField.matmul`). ``out``: a C-contiguous
    int64 (n, S) array to write the shares into (returned), else a new one."""
    k, t = scheme.k, scheme.t
    shape = (scheme.n, inputs.shape[1])
    if out is None:
        out = np.empty(shape, dtype=np.int64)
    elif out.shape != shape or out.dtype != np.int64 or not out.flags.c_contiguous:
        raise ValueError(
            f"out is a {out.dtype} array of shape {out.shape}; allowed: a C-contiguous int64 "
            f"array of shape {shape}"
        )
    shares = out
    shares[:t] = inputs[k:]
    scheme.field.matmul(scheme.share_matrix[t:], inputs, out=shares[t:])
    return shares


class ShareFold:
    """The sum of several parties' sharing inputs (:func:`sharing_inputs`) for one round:
    signed segments summed in int64 (|sum| stays far below 2^62 for the bit budgets DMM
    checks), randomness summed mod p; :meth:`shares` deals the sum once."""

    def __init__(self, keys: RoundKeys) -> None:
        self.keys = keys
        self.scheme = keys.scheme()
        self.count = 0
        self._segments: np.ndarray | None = None
        self._randomness: np.ndarray | None = None

    def add(self, update, noise, randomness) -> None:
        """One party's segments (``update``: D ints, ``noise``: rows x D ints) and its (t, S)
        share randomness (field elements). Raises ``ValueError`` naming what is malformed."""
        segments = np.vstack([_update(self.keys, update)[None, :], _noise(self.keys, noise)])
        columns = (1 + self.keys.rows) * self.scheme.blocks_for(self.keys.dim)
        randomness = self.scheme.field.asarray(randomness, "randomness")
        if randomness.shape != (self.scheme.t, columns):
            raise ValueError(
                f"randomness has shape {randomness.shape}; allowed ({self.scheme.t}, {columns})"
            )
        if self._segments is None:
            self._segments, self._randomness = segments.copy(), randomness.copy()
        else:
            self._segments += segments
            self._randomness = self.scheme.field.add(self._randomness, randomness)
        self.count += 1

    def shares(self) -> np.ndarray:
        """(n, S) shares of the summed segments, dealt with the summed randomness."""
        if self._segments is None:
            raise ValueError("nothing was added to the fold")
        secrets = secret_blocks(self.scheme, list(self._segments))
        return deal_shares(self.scheme, secrets, self._randomness)


def seal_client_shares(
    keys: RoundKeys,
    party: int,
    update,
    noise,
    rng: np.random.Generator,
    private_key: bytes | None = None,
    verifier: KeyVerifier | None = None,
) -> DMMSealedShares:
    """The client's SHARE message: shares of ``update`` (D signed ints) and ``noise``
    (``keys.rows`` x D signed ints) sealed per seat (plain rows when the round has no session
    id). ``party``: the channel id the server assigned this client for the round;
    ``verifier``: its enrolment, checked against every seat key before anything is shared."""
    _party(party)
    if verifier is not None:
        check_seat_keys(keys, verifier)
    segments = [_update(keys, update), *_noise(keys, noise)]
    return seal_rows(keys, party, share_segments(keys.scheme(), segments, rng), private_key)


def check_seat_keys(
    keys: RoundKeys, verifier: KeyVerifier, names: Mapping[int, str] | None = None
) -> list[str]:
    """The enrolled names behind the seats' keys, or :class:`KeySubstitution` naming the seat
    whose key no distinct enrolled party signed for this session and seat. ``names``: seat ->
    the enrolled name its key must be signed by (the round's public committee, which the
    caller draws); None checks only that the signers are distinct enrolled parties."""
    if keys.session_id is None:
        return []
    missing = sorted(set(keys.member_keys) - set(keys.member_proofs))
    if missing:
        raise KeySubstitution(
            f"round {keys.round}: DMM seats {missing[:5]} announced keys without enrolment "
            "proofs; this client seals only to enrolled members"
        )
    if names is not None:
        unnamed = sorted(set(keys.member_keys) - set(names))
        if unnamed:
            raise KeySubstitution(
                f"round {keys.round}: DMM seats {unnamed[:5]} are not seats of the public "
                "committee; this client seals only to its members"
            )
    entries = [
        (
            f"DMM seat {j}",
            SEAT_ID_BASE + int(j),
            (key,),
            keys.member_proofs[j],
            None if names is None else names[j],
        )
        for j, key in sorted(keys.member_keys.items())
    ]
    return verifier.check_all(entries, protocol=PROTOCOL, session_id=keys.session_id)


def seal_rows(
    keys: RoundKeys,
    party: int,
    shares: np.ndarray,
    private_key: bytes | None = None,
    verifier: KeyVerifier | None = None,
) -> DMMSealedShares:
    """Seal row j of ``shares`` ((n, width) field elements) to seat j, from channel ``party``
    (a client's, or a worker batch's that folded its clients' inputs): one AEAD call per seat
    over the whole row. ``private_key``: 32 bytes of the sealing party's secret, or None for a
    key from the OS CSPRNG; ``verifier``: the sealing party's enrolment, which every seat key
    must pass first (:func:`check_seat_keys`; None: keys are taken as relayed)."""
    party = _party(party)
    if shares.shape != (keys.n, keys.width):
        raise ValueError(f"shares has shape {shares.shape}; allowed ({keys.n}, {keys.width})")
    if verifier is not None:
        check_seat_keys(keys, verifier)
    if keys.session_id is None:
        return DMMSealedShares(party, b"", {int(j): shares[j] for j in keys.member_keys})
    endpoint = Endpoint(party, keys.session_id, protocol=PROTOCOL, private_key=private_key)
    sealed = {}
    for j, key in sorted(keys.member_keys.items()):
        endpoint.connect(SEAT_ID_BASE + int(j), key)
        sealed[int(j)] = endpoint.seal_array(
            SEAT_ID_BASE + int(j), keys.round, DMMStage.SHARE, shares[int(j)]
        )
    return DMMSealedShares(party, endpoint.public_key, sealed)


def _party(party) -> int:
    if isinstance(party, bool) or not isinstance(party, int | np.integer):
        raise ValueError(f"party={party!r}; allowed: an integer in [0, 2^40)")
    if not 0 <= int(party) < CLIENT_ID_LIMIT:
        raise ValueError(f"party={party!r}; allowed: an integer in [0, 2^40)")
    return int(party)


def _update(keys: RoundKeys, update) -> np.ndarray:
    update = np.asarray(update)
    if update.shape != (keys.dim,) or update.dtype.kind not in "iu":
        raise ValueError(
            f"update has shape {update.shape} and dtype {update.dtype}; allowed: ({keys.dim},) "
            "integers"
        )
    return update.astype(np.int64)


def _noise(keys: RoundKeys, noise) -> np.ndarray:
    noise = np.asarray(noise)
    if noise.shape != (keys.rows, keys.dim) or (noise.size and noise.dtype.kind not in "iu"):
        raise ValueError(
            f"noise has shape {noise.shape} and dtype {noise.dtype}; allowed: "
            f"({keys.rows}, {keys.dim}) integers"
        )
    return noise.astype(np.int64).reshape(keys.rows, keys.dim)
