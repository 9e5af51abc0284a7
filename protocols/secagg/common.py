"""SecAgg+ secure aggregation as explicit state machines (client and server).

Implements the protocol of Bell, Bonawitz, Gascon, Lepoint & Raykova, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", CCS 2020 (SecAgg+), itself the sparse-graph
version of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, for an honest-but-curious server, over F_p (p = 2^61 - 1 by default):

* the server draws a random ``degree``-regular neighbour graph (a Harary graph on a random
  permutation of the clients, seeded by the caller's ``numpy.random.Generator``);
* each client advertises two X25519 public keys: one for its channels (protocols.channels), one
  for mask agreement;
* each client Shamir-shares (threshold ``threshold`` among its neighbours) a 32-byte self-mask
  seed b_i and its mask-agreement private key, sending each neighbour its share over an
  authenticated encrypted channel relayed by the server;
* each client sends y_i = x_i + PRG(b_i) + sum_{j in N(i)} sign(i, j) PRG(s_ij) (mod p), where
  s_ij = HKDF(X25519(s_i, S_j)) and sign is + for i < j, - otherwise;
* the server announces who survived; each neighbour returns its share of b_j for survivors and of
  s_j for clients that dropped after sharing (never both for one client); the server
  reconstructs, removes the self-masks of survivors and the pairwise masks survivors share with
  dropped clients, and obtains sum_{i in survivors} x_i (mod p).

The PRG is the ChaCha20 keystream (RFC 8439) of the seed, read as 64-bit words masked to e bits
with the single value 2^e - 1 rejected, so masks are uniform in F_p (``SecAggConfig.prg``
names the keystream: :class:`~protocols.secagg.prg.MaskPRG`). With
``SecAggConfig.ring_bits = b`` the inputs, masks and aggregate live in the ring Z_{2^b} instead
(:class:`RingZ2k`, as in the original SecAgg): masks are raw keystream words (uniform, nothing
rejected), arithmetic is native unsigned wrap-around, and an element travels in ceil(b/8)
bytes. The seeds and key shares stay in F_p. A sum of signed values decodes correctly in
Z_{2^b} iff it lies in [-2^(b-1), 2^(b-1)), the same bit budget DDGauss plans for
(:func:`protocols.encoding.sum_headroom_bits` with ``bits=b``).

The client side is :mod:`protocols.secagg.client`, the server side (and an in-process round,
:func:`protocols.secagg.server.run_secagg`) :mod:`protocols.secagg.server`; this module holds
what both use: stages, parameters, the graph, the PRG (its keystreams in
:mod:`protocols.secagg.prg`), the ring and the pairwise seeds.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocols.channels import PUBLIC_KEY_BYTES, TAG_BYTES, decode_array, encode_array
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.kit import check_move
from protocols.secagg.prg import SEED_BYTES, KeyedField, MaskPRG, expand_mask
from protocols.shamir import PackedShamir

PROTOCOL = b"fedsim/secagg+/v2"
"""Label every SecAgg+ channel binds into its keys and associated data."""
_CHUNK_BITS = 16
CHUNKS_PER_SECRET = SEED_BYTES * 8 // _CHUNK_BITS
SHARE_ROW_LENGTH = 2 * CHUNKS_PER_SECRET
"""Field elements of one share row: a share of b_i's 16 chunks and of the agreement key's 16."""
_PAIRWISE_LABEL = b"fedsim/secagg/pairwise/v1"


class Stage(Enum):
    """Stages of one SecAgg+ round, in order; ABORTED is reachable from any live stage."""

    SETUP = 0
    ADVERTISE_KEYS = 1
    SHARE_KEYS = 2
    MASKED_INPUT = 3
    UNMASK = 4
    DONE = 5
    ABORTED = 6


TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.SETUP: frozenset({Stage.ADVERTISE_KEYS, Stage.ABORTED}),
    Stage.ADVERTISE_KEYS: frozenset({Stage.SHARE_KEYS, Stage.ABORTED}),
    Stage.SHARE_KEYS: frozenset({Stage.MASKED_INPUT, Stage.ABORTED}),
    Stage.MASKED_INPUT: frozenset({Stage.UNMASK, Stage.ABORTED}),
    Stage.UNMASK: frozenset({Stage.DONE, Stage.ABORTED}),
    Stage.DONE: frozenset(),
    Stage.ABORTED: frozenset(),
}
"""Allowed moves: each live stage to the next one or to ABORTED; DONE and ABORTED are final."""


def check_transition(current: Stage, target: Stage, who: str) -> None:
    """Raise :class:`StageError` unless ``current -> target`` is in :data:`TRANSITIONS`."""
    check_move(TRANSITIONS, current, target, who)


class SecAggKeys:
    """SecAgg+'s wire names, all in one place: the records of its messages and replies
    (``secagg.*``), the entries inside them, the parameters of :class:`SecAggConfig` and the
    entries of a client's stored state (:class:`protocols.secagg.state.ClientState`)."""

    # records of a message or reply (Flower RecordDict keys)
    HEADER = "secagg"
    KEYS = "secagg.keys"
    SETUP = "secagg.setup"
    NEIGHBOURS = "secagg.neighbours"
    ENVELOPES = "secagg.envelopes"
    MASKED = "secagg.masked"
    SURVIVORS = "secagg.survivors"
    UNMASK = "secagg.unmask"
    STATE = "secagg.state"
    REFUSED = "secagg.refused"
    # the round's parameters (SETUP's entries, and a stored state's with prefix "config.")
    NUM_CLIENTS = "num-clients"
    DEGREE = "degree"
    THRESHOLD = "threshold"
    VECTOR_LENGTH = "vector-length"
    ROUND = "round"
    MIN_SURVIVORS = "min-survivors"
    RING_BITS = "ring-bits"
    FIELD_EXPONENT = "field-exponent"
    PRG = "prg"
    CONFIG = (
        NUM_CLIENTS, DEGREE, THRESHOLD, VECTOR_LENGTH, ROUND, MIN_SURVIVORS, RING_BITS,
        FIELD_EXPONENT, PRG,
    )  # fmt: skip
    OPTIONAL = (MIN_SURVIVORS, RING_BITS)
    """Parameters that may be None, written as -1."""
    DEFAULTED = (PRG,)
    """Parameters written only when not at their default (code 0) and read as it when absent,
    so a round at the defaults has the record it had before they existed."""
    # entries of the other records
    CLIENT_ID = "client-id"
    CONTRIBUTE = "contribute"
    SESSION = "session"
    """The round's public session id: a header entry, and ``<prefix>session`` in the train
    instruction of a secure sum (:class:`strategies.secure.secagg.SecAggSum`)."""
    HEADER_ENTRIES = ("server-round", SESSION, "stage")
    CHANNEL, AGREEMENT, PROOF = "channel", "agreement", "proof"
    KEY_ENTRIES = (CHANNEL, AGREEMENT, PROOF)
    NEIGHBOUR_ENTRIES = ("ids", "channel-keys", "agreement-keys", "proofs")
    ENVELOPE_ENTRIES = ("senders", "receivers", "rounds", "stages", "nonces", "ciphertexts")
    SURVIVOR_ENTRIES = ("survivors", "dropped")
    UNMASK_PARTS = ("self-mask", "secret-key")
    REFUSED_ENTRIES = ("stage", "reason")
    MASKED_ENTRY = "masked"
    """The one array of a MASKED_INPUT reply."""
    # the record a client keeps under STATE: its round, whether sealed, and the packed state
    STORED_ROUND, STORED_SEALED, STORED_BLOB = "round", "sealed", "state"
    # a client's stored state (protocols.secagg.state)
    STATE_SERVER_ROUND = "round"
    STATE_INPUT = "input"
    STATE_CONFIG_PREFIX = "config."
    STATE_ARRAYS = (
        "seed", "session", "stage", "client_id", "contributes", "neighbours", "neighbour_keys",
        "receive_keys", "mask_seeds", "share_owners", "shares",
    )  # fmt: skip
    """The protocol state's entries besides its parameters (named ``config.<parameter>``)."""


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of a round.

    ``degree``: neighbours per client (even, or num_clients - 1 for the complete graph);
    ``threshold``: shares needed to recover a client's secrets, with
    degree/2 < threshold <= degree (a majority, so a server cannot collect both of a client's
    secrets from two disjoint groups of neighbours); ``min_survivors``: fewest clients whose
    inputs may be summed (default ``threshold``), so that an aggregate never exposes a
    handful of inputs; ``vector_length``: field elements per input; ``ring_bits``: mask and
    sum in Z_{2^ring_bits} instead of F_p (None: the field); ``prg``: the keystream that
    expands mask seeds (:class:`MaskPRG`, or its name).
    """

    num_clients: int
    degree: int
    threshold: int
    vector_length: int
    round: int = 0
    min_survivors: int | None = None
    field: MersenneField = DEFAULT_FIELD
    ring_bits: int | None = None
    prg: MaskPRG = MaskPRG.CHACHA20

    def __post_init__(self) -> None:
        object.__setattr__(self, "prg", MaskPRG.parse(self.prg, "prg"))
        for name in ("num_clients", "degree", "threshold", "vector_length", "round"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.ring_bits is not None:
            RingZ2k(self.ring_bits)
        if self.num_clients < 2:
            raise ValueError(f"num_clients must be >= 2, got {self.num_clients}")
        complete = self.num_clients - 1
        if not 1 <= self.degree <= complete or (self.degree % 2 and self.degree != complete):
            raise ValueError(
                f"degree={self.degree} must be even and in [2, {complete}], or exactly "
                f"num_clients - 1 = {complete} (complete graph)"
            )
        if not (self.degree / 2 < self.threshold <= self.degree and self.threshold >= 2):
            raise ValueError(
                f"threshold={self.threshold} must satisfy degree/2 < threshold <= degree "
                f"(degree={self.degree}) and threshold >= 2"
            )
        if self.vector_length < 1:
            raise ValueError(f"vector_length must be >= 1, got {self.vector_length}")
        if not 0 <= self.round < 2**63:
            raise ValueError(f"round must be in [0, 2^63), got {self.round}")
        if self.field.exponent <= _CHUNK_BITS:
            raise ValueError(
                f"field={self.field!r} is too small to share {_CHUNK_BITS}-bit key chunks; "
                "use exponent >= 17"
            )
        if self.min_survivors is not None and not 1 <= self.min_survivors <= self.num_clients:
            raise ValueError(
                f"min_survivors={self.min_survivors} must be in [1, {self.num_clients}]"
            )

    @property
    def masking(self) -> MersenneField | RingZ2k:
        """Where inputs, masks and the aggregate live: the field, or Z_{2^ring_bits}."""
        if self.ring_bits is not None:
            return _cached_ring(self.ring_bits, self.prg)
        return self.field if self.prg is MaskPRG.CHACHA20 else _cached_field(self.field, self.prg)

    @property
    def survivors_needed(self) -> int:
        return self.threshold if self.min_survivors is None else self.min_survivors

    def to_record(self) -> dict[str, int]:
        """The parameters as named integers (:attr:`SecAggKeys.CONFIG`; None as -1; the PRG
        by its code, left out for the default, :attr:`SecAggKeys.DEFAULTED`)."""
        record = {
            SecAggKeys.NUM_CLIENTS: self.num_clients,
            SecAggKeys.DEGREE: self.degree,
            SecAggKeys.THRESHOLD: self.threshold,
            SecAggKeys.VECTOR_LENGTH: self.vector_length,
            SecAggKeys.ROUND: self.round,
            SecAggKeys.MIN_SURVIVORS: -1 if self.min_survivors is None else self.min_survivors,
            SecAggKeys.RING_BITS: -1 if self.ring_bits is None else self.ring_bits,
            SecAggKeys.FIELD_EXPONENT: self.field.exponent,
        }
        if self.prg is not MaskPRG.CHACHA20:
            record[SecAggKeys.PRG] = self.prg.code
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, object], prefix: str = "") -> SecAggConfig:
        """The config of :meth:`to_record`'s entries, each read as ``prefix + name`` (other
        keys of ``record`` are ignored); ValueError naming the key, the value and what is
        allowed when one is missing or not an integer, or the config is invalid."""
        values = {}
        for name in SecAggKeys.CONFIG:
            value = record.get(prefix + name, _MISSING)
            if value is _MISSING and name in SecAggKeys.DEFAULTED:
                value = 0
            if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
                value = int(value)
            if value is _MISSING or not isinstance(value, int) or isinstance(value, bool):
                shown = "missing" if value is _MISSING else repr(value)
                raise ValueError(
                    f"SecAgg+ parameter {prefix + name!r}: {shown}; allowed: an integer"
                )
            values[name] = value
        return _config_of(cls, prefix, tuple(values[name] for name in SecAggKeys.CONFIG))

    @classmethod
    def _of_values(cls, values: dict[str, int], prefix: str) -> SecAggConfig:
        """The config of :meth:`from_record`'s checked integers (by name)."""
        optional = {k: None if values[k] < 0 else values[k] for k in SecAggKeys.OPTIONAL}
        return cls(
            num_clients=values[SecAggKeys.NUM_CLIENTS],
            degree=values[SecAggKeys.DEGREE],
            threshold=values[SecAggKeys.THRESHOLD],
            vector_length=values[SecAggKeys.VECTOR_LENGTH],
            round=values[SecAggKeys.ROUND],
            min_survivors=optional[SecAggKeys.MIN_SURVIVORS],
            field=MersenneField(values[SecAggKeys.FIELD_EXPONENT]),
            ring_bits=optional[SecAggKeys.RING_BITS],
            prg=MaskPRG.parse(values[SecAggKeys.PRG], prefix + SecAggKeys.PRG),
        )


_MISSING = object()


@functools.lru_cache(maxsize=64)
def _config_of(cls: type, prefix: str, values: tuple[int, ...]) -> SecAggConfig:
    """:meth:`SecAggConfig._of_values`, kept by its integers: a config is public and frozen,
    and the same integers always give the same one (a bad one raises, and is not kept)."""
    return cls._of_values(dict(zip(SecAggKeys.CONFIG, values)), prefix)


def neighbour_graph(
    client_ids: Iterable[int], degree: int, rng: np.random.Generator
) -> dict[int, tuple[int, ...]]:
    """A random ``degree``-regular graph: the Harary graph H(degree, n) on a random order.

    Clients sit on a cycle in the order of a permutation drawn from ``rng``; each is joined to
    the degree/2 nearest on either side (the complete graph when degree = n - 1).
    """
    ids = list(client_ids)
    count = len(ids)
    if len(set(ids)) != count:
        raise ValueError("client_ids must be distinct")
    order = [ids[i] for i in rng.permutation(count)]
    if degree == count - 1:
        return {i: tuple(sorted(j for j in ids if j != i)) for i in ids}
    if degree % 2 or not 0 < degree < count:
        raise ValueError(f"degree={degree} must be even and in (0, {count})")
    neighbours: dict[int, set[int]] = {i: set() for i in ids}
    for position, client in enumerate(order):
        for step in range(1, degree // 2 + 1):
            other = order[(position + step) % count]
            neighbours[client].add(other)
            neighbours[other].add(client)
    return {i: tuple(sorted(neighbours[i])) for i in ids}


class RingZ2k:
    """The ring Z_{2^bits} (1 <= bits <= 64) on unsigned numpy arrays (uint32 for bits <= 32,
    else uint64): the masking space of SecAgg+ when ``SecAggConfig.ring_bits`` is set.

    Offers the element-wise methods SecAgg+ uses on a field (asarray, add, sub, sum) plus
    :meth:`expand` (the PRG, ``prg``'s keystream) and the signed encoding in
    [-2^(bits-1), 2^(bits-1)).
    """

    def __init__(self, bits: int, prg: MaskPRG = MaskPRG.CHACHA20) -> None:
        if not isinstance(bits, int | np.integer) or not 1 <= bits <= 64:
            raise ValueError(f"ring_bits must be an integer in [1, 64], got {bits!r}")
        self.bits = int(bits)
        self.dtype = np.dtype(np.uint32 if self.bits <= 32 else np.uint64)
        self._width = self.dtype.itemsize * 8
        self._mask = self.dtype.type((1 << self.bits) - 1)
        self.modulus = 1 << self.bits
        self.prg = MaskPRG.parse(prg, "prg")

    def __repr__(self) -> str:
        shown = "" if self.prg is MaskPRG.CHACHA20 else f", prg={self.prg.value!r}"
        return f"RingZ2k(bits={self.bits}{shown})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RingZ2k) and (other.bits, other.prg) == (self.bits, self.prg)

    def __hash__(self) -> int:
        return hash(("RingZ2k", self.bits, self.prg))

    @property
    def bytes_per_element(self) -> int:
        return -(-self.bits // 8)

    def _wrap(self, a: np.ndarray) -> np.ndarray:
        if self.bits < self._width:
            np.bitwise_and(a, self._mask, out=a)
        return a

    def asarray(self, values, name: str = "values") -> np.ndarray:
        """``values`` as the ring's dtype after checking every entry lies in [0, 2^bits)."""
        array = np.asarray(values)
        if array.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers in [0, 2^{self.bits}), got {array.dtype}")
        if self._holds(array.dtype, 0, self.modulus):
            return array.astype(self.dtype, copy=False)  # every value of the dtype is in range
        if array.size and (int(array.min()) < 0 or int(array.max()) >= self.modulus):
            bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
            raise ValueError(f"{name} has entry {bad} outside [0, 2^{self.bits})")
        return array.astype(self.dtype, copy=False)

    def add(self, a, b) -> np.ndarray:
        return self._wrap(np.add(a, b, dtype=self.dtype))

    def sub(self, a, b) -> np.ndarray:
        return self._wrap(np.subtract(a, b, dtype=self.dtype))

    def sum(self, a, axis: int = 0) -> np.ndarray:
        return self._wrap(np.sum(a, axis=axis, dtype=self.dtype))

    def sum_list(self, arrays: list[np.ndarray]) -> np.ndarray:
        """Sum of equally long vectors, accumulated in place (no stacked copy)."""
        total = np.array(arrays[0], dtype=self.dtype)
        for array in arrays[1:]:
            np.add(total, array, out=total)
        return self._wrap(total)

    def expand(self, seed: bytes, length: int) -> np.ndarray:
        """PRG(seed): ``length`` uniform ring elements, the keystream as words (k bits each)."""
        stream = self.prg.keystream(seed)
        words = np.frombuffer(stream.update(bytes(self.dtype.itemsize * length)), self.dtype)
        return self._wrap(words.copy()) if self.bits < self._width else words

    def masked_sum(
        self, values: np.ndarray, seeds: list[tuple[bytes, int]]
    ) -> np.ndarray:
        """values + sum of sign * PRG(seed) over ``seeds`` ((seed, +1 or -1) pairs), the same
        ring elements as :meth:`add` / :meth:`sub` of each :meth:`expand` in turn: every
        keystream is written into one reused buffer and added in place (no array per mask),
        and the sum is reduced mod 2^bits once at the end (2^bits divides the word modulus)."""
        total = np.array(values, dtype=self.dtype)
        zeros = _zeros(self.dtype.itemsize * total.size)  # keystream: the encryption of zeros
        words = np.empty(total.size, dtype=self.dtype)  # each keystream overwrites all of it
        buffer = memoryview(words).cast("B")
        for seed, sign in seeds:
            stream = self.prg.keystream(seed)
            stream.update_into(zeros, buffer)
            (np.add if sign > 0 else np.subtract)(total, words, out=total)
        return self._wrap(total)

    def encode_signed(self, integers) -> np.ndarray:
        """Signed integers in [-2^(bits-1), 2^(bits-1)) to their residues."""
        array = np.asarray(integers)
        if array.dtype.kind not in "iu":
            raise ValueError(f"integers must hold integers, got dtype {array.dtype}")
        if array.dtype == np.uint64:
            array = array.astype(np.int64)
        half = 1 << (self.bits - 1)
        checked = self._holds(array.dtype, -half, half)  # the dtype itself fits: no pass
        if not checked and array.size and (int(array.min()) < -half or int(array.max()) >= half):
            raise ValueError(
                f"integers has entries outside [-2^{self.bits - 1}, 2^{self.bits - 1}): "
                f"[{int(array.min())}, {int(array.max())}] would wrap in Z_2^{self.bits}"
            )
        # integer casts to the unsigned word are modular: the residue mod 2^width, then bits
        return self._wrap(array.astype(self.dtype))

    @staticmethod
    def _holds(dtype: np.dtype, low: int, high: int) -> bool:
        """Whether every value of the integer ``dtype`` lies in [low, high)."""
        info = np.iinfo(dtype)
        return low <= int(info.min) and int(info.max) < high

    def decode_signed(self, elements) -> np.ndarray:
        """Ring elements to their representative in [-2^(bits-1), 2^(bits-1)), as int64."""
        values = self.asarray(elements, "elements").astype(np.uint64)
        if self.bits == 64:
            return values.view(np.int64)
        signed = values.astype(np.int64)
        return np.where(signed >= 1 << (self.bits - 1), signed - (1 << self.bits), signed)


@functools.lru_cache(maxsize=2)
def _zeros(size: int) -> bytes:
    """``size`` zero bytes, kept for the next vector of that size (immutable, so shared)."""
    return bytes(size)


def prg(space, seed: bytes, length: int) -> np.ndarray:
    """The mask PRG in the masking space: F_p (:func:`expand_mask`), a :class:`KeyedField` or
    a :class:`RingZ2k` (their ``prg``)."""
    if isinstance(space, RingZ2k | KeyedField):
        return space.expand(seed, length)
    return expand_mask(seed, length, space)


def sum_vectors(space, vectors: list[np.ndarray]) -> np.ndarray:
    if isinstance(space, RingZ2k):
        return space.sum_list(vectors)
    return space.sum(np.stack(vectors), axis=0)


def pairwise_seed(
    private_key: X25519PrivateKey, peer_public_key: bytes, session_id: bytes, a: int, b: int
) -> bytes:
    """s_ab = HKDF-SHA256(X25519(private, peer), salt=session, info=label || min || max)."""
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    info = _PAIRWISE_LABEL + struct.pack(">QQ", min(a, b), max(a, b))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=session_id, info=info).derive(
        shared
    )


def secret_to_elements(secret: bytes) -> np.ndarray:
    return np.frombuffer(secret, dtype="<u2").astype(np.int64)


def elements_to_secret(elements: np.ndarray) -> bytes:
    if np.any(elements >= 2**_CHUNK_BITS):
        raise ValueError("reconstructed key chunks exceed 16 bits: shares are inconsistent")
    return elements.astype("<u2").tobytes()


def raw_private_key(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def raw_public_key(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)



_KEY_CHECK = X25519PrivateKey.from_private_bytes(b"fedsim/secagg/public-key-check/1")
"""A fixed scalar, no one's secret: X25519 with it gives all zeros exactly for the low-order
points (RFC 7748, Sec. 6.1), which ``cryptography`` refuses."""


def key_problem(public_key: object) -> str | None:
    """Why ``public_key`` cannot serve as an X25519 public key (None if it can): not 32 bytes,
    or an all-zero or low-order point -- the keys :meth:`protocols.channels.Endpoint.connect`
    refuses with a ChannelError."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        return f"a public key must be {PUBLIC_KEY_BYTES} bytes, got {type(public_key).__name__}"
    try:
        _KEY_CHECK.exchange(X25519PublicKey.from_public_bytes(public_key))
    except ValueError as error:
        return f"unusable X25519 public key (all-zero or low-order point): {error}"
    return None


def _share_ciphertext_bytes() -> int:
    return len(encode_array(np.zeros(SHARE_ROW_LENGTH, dtype=np.int64))) + TAG_BYTES


SHARE_CIPHERTEXT_BYTES = _share_ciphertext_bytes()
"""Length of every sealed share row (a .npy int64 row of SHARE_ROW_LENGTH plus the tag)."""

_ROW_BYTES = SHARE_ROW_LENGTH * 8
_ROW_HEADER = encode_array(np.zeros(SHARE_ROW_LENGTH, dtype="<i8"))[:-_ROW_BYTES]
"""The .npy header :func:`protocols.channels.encode_array` writes for every share row (its
dtype and shape are fixed), computed once with the running numpy."""


def encode_share_row(row: np.ndarray) -> bytes:
    """A share row as the bytes :func:`protocols.channels.encode_array` writes for it, byte
    for byte, without running ``np.save`` each time (an int64 row of SHARE_ROW_LENGTH has one
    header); any other array goes through ``encode_array``."""
    array = np.asarray(row)
    if array.shape == (SHARE_ROW_LENGTH,) and array.dtype == np.dtype("<i8"):
        return _ROW_HEADER + array.tobytes()
    return encode_array(array)


def decode_share_row(payload: bytes) -> np.ndarray:
    """The inverse of :func:`encode_share_row`: the row, when ``payload`` is exactly the fixed
    header and SHARE_ROW_LENGTH int64; anything else is read (or refused, ``ValueError``) by
    :func:`protocols.channels.decode_array`, so the checks on the row are the same."""
    if (
        isinstance(payload, bytes)
        and len(payload) == len(_ROW_HEADER) + _ROW_BYTES
        and payload.startswith(_ROW_HEADER)
    ):
        return np.frombuffer(payload, dtype="<i8", offset=len(_ROW_HEADER)).astype(np.int64)
    return decode_array(payload)


def integer_vector(value: object, space, length: int, name: str) -> np.ndarray:
    """``value`` as ``length`` elements of ``space`` (F_p or Z_{2^b}), or ValueError saying why
    not (not an integer numpy vector, wrong length, entries out of range)."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "iu":
        shape = getattr(value, "shape", None)
        kind = getattr(getattr(value, "dtype", None), "name", type(value).__name__)
        raise ValueError(f"{name} must be a 1-D integer array, got {kind} of shape {shape}")
    if value.size != length:
        raise ValueError(f"{name} has {value.size} elements; {length} expected")
    return space.asarray(value, name)


@dataclass(frozen=True)
class UnmaskResponse:
    """A client's answer in UNMASK: share rows of survivors' self-mask seeds and of dropped
    clients' mask-agreement keys, keyed by the owner's id."""

    self_mask_shares: dict[int, np.ndarray]
    secret_key_shares: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        rows = list(self.self_mask_shares.values()) + list(self.secret_key_shares.values())
        return sum(8 + row.size * 8 for row in rows)

def shamir_scheme(config: SecAggConfig, recipients: int) -> PackedShamir:
    """Plain Shamir (k = 1) among ``recipients`` neighbours: ``threshold`` shares reconstruct."""
    return _cached_scheme(recipients, config.threshold - 1, config.field)


@functools.lru_cache(maxsize=16)
def _cached_ring(bits: int, prg: MaskPRG = MaskPRG.CHACHA20) -> RingZ2k:
    return RingZ2k(bits, prg)


@functools.lru_cache(maxsize=16)
def _cached_field(field_: MersenneField, prg: MaskPRG) -> KeyedField:
    return KeyedField(field_.exponent, prg)


@functools.lru_cache(maxsize=64)
def _cached_scheme(members: int, privacy: int, field_: MersenneField) -> PackedShamir:
    # one instance per shape, so its share and Lagrange matrices are computed once
    return PackedShamir(n=members, t=privacy, k=1, field=field_)

