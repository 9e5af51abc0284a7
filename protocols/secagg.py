"""SecAgg+ secure aggregation as explicit state machines (client and server).

Implements the protocol of Bell, Bonawitz, Gascon, Lepoint & Raykova, "Secure Single-Server
Aggregation with (Poly)Logarithmic Overhead", CCS 2020 (SecAgg+), itself the sparse-graph
version of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, for an honest-but-curious server, over F_p (p = 2^61 - 1 by default):

* the server draws a random ``degree``-regular neighbour graph (a Harary graph on a random
  permutation of the clients, seeded by the caller's ``numpy.random.Generator``);
* each client advertises two X25519 public keys: one for its channels (protocols.channels), one
  for mask agreement;
* each client Shamir-shares (threshold ``threshold`` among its neighbours) a fresh 32-byte
  self-mask seed b_i and its mask-agreement private key, sending each neighbour its share over
  an authenticated encrypted channel relayed by the server;
* each client sends y_i = x_i + PRG(b_i) + sum_{j in N(i)} sign(i, j) PRG(s_ij) (mod p), where
  s_ij = HKDF(X25519(s_i, S_j)) and sign is + for i < j, - otherwise;
* the server announces who survived; each neighbour returns its share of b_j for survivors and of
  s_j for clients that dropped after sharing (never both for one client); the server
  reconstructs, removes the self-masks of survivors and the pairwise masks survivors share with
  dropped clients, and obtains sum_{i in survivors} x_i (mod p).

The PRG is the ChaCha20 keystream (RFC 8439) of the seed, read as 64-bit words masked to e bits
with the single value 2^e - 1 rejected, so masks are uniform in F_p. With
``SecAggConfig.ring_bits = b`` the inputs, masks and aggregate live in the ring Z_{2^b} instead
(:class:`RingZ2k`, as in the original SecAgg): masks are raw keystream words (uniform, nothing
rejected), arithmetic is native unsigned wrap-around, and an element travels in ceil(b/8)
bytes. The seeds and key shares stay in F_p. A sum of signed values decodes correctly in
Z_{2^b} iff it lies in [-2^(b-1), 2^(b-1)), the same bit budget DDGauss plans for
(:func:`protocols.encoding.sum_headroom_bits` with ``bits=b``). Keys, seeds and shares come
from the OS CSPRNG; only the graph is drawn from the passed generator.

Stages run in the order of :class:`Stage`; every handler checks its transition and raises
:class:`StageError` on an out-of-order call.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocols.channels import SERVER_ID, Endpoint, Envelope, Relay, Transcript, new_session_id
from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.shamir import PackedShamir

SEED_BYTES = 32
_CHUNK_BITS = 16
_CHUNKS_PER_SECRET = SEED_BYTES * 8 // _CHUNK_BITS
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


class StageError(RuntimeError):
    """A handler was called out of order."""


class TooManyDropoutsError(RuntimeError):
    """Too few parties answered for the round to complete; the round is aborted."""


def check_move(
    transitions: Mapping[Any, frozenset[Any]], current: Any, target: Any, who: str
) -> None:
    """Raise :class:`StageError` unless ``current -> target`` is in ``transitions``
    (the check every protocol state machine here makes before it changes stage)."""
    if target not in transitions[current]:
        allowed = sorted(stage.name for stage in transitions[current]) or ["none (final)"]
        raise StageError(
            f"{who} is in stage {current.name}; cannot move to {target.name} "
            f"(allowed: {', '.join(allowed)})"
        )


def check_transition(current: Stage, target: Stage, who: str) -> None:
    """Raise :class:`StageError` unless ``current -> target`` is in :data:`TRANSITIONS`."""
    check_move(TRANSITIONS, current, target, who)


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of a round.

    ``degree``: neighbours per client (even, or num_clients - 1 for the complete graph);
    ``threshold``: shares needed to recover a client's secrets, with
    degree/2 < threshold <= degree (a majority, so a server cannot collect both of a client's
    secrets from two disjoint groups of neighbours); ``min_survivors``: fewest clients whose
    inputs may be summed (default ``threshold``), so that an aggregate never exposes a
    handful of inputs; ``vector_length``: field elements per input; ``ring_bits``: mask and
    sum in Z_{2^ring_bits} instead of F_p (None: the field).
    """

    num_clients: int
    degree: int
    threshold: int
    vector_length: int
    round: int = 0
    min_survivors: int | None = None
    field: MersenneField = DEFAULT_FIELD
    ring_bits: int | None = None

    def __post_init__(self) -> None:
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
        return self.field if self.ring_bits is None else _cached_ring(self.ring_bits)

    @property
    def survivors_needed(self) -> int:
        return self.threshold if self.min_survivors is None else self.min_survivors


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


def expand_mask(seed: bytes, length: int, field_: MersenneField) -> np.ndarray:
    """PRG(seed): ``length`` uniform elements of F_p from the ChaCha20 keystream of ``seed``."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"seed must be {SEED_BYTES} bytes, got {len(seed)}")
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    mask = np.uint64(field_.modulus)
    out = np.empty(length, dtype=np.int64)
    filled = 0
    while filled < length:
        need = length - filled
        words = np.frombuffer(stream.update(bytes(8 * need)), dtype="<u8") & mask
        words = words[words != mask]
        out[filled : filled + words.size] = words.astype(np.int64)
        filled += words.size
    return out


class RingZ2k:
    """The ring Z_{2^bits} (1 <= bits <= 64) on unsigned numpy arrays (uint32 for bits <= 32,
    else uint64): the masking space of SecAgg+ when ``SecAggConfig.ring_bits`` is set.

    Offers the element-wise methods SecAgg+ uses on a field (asarray, add, sub, sum) plus
    :meth:`expand` (the PRG) and the signed encoding in [-2^(bits-1), 2^(bits-1)).
    """

    def __init__(self, bits: int) -> None:
        if not isinstance(bits, int | np.integer) or not 1 <= bits <= 64:
            raise ValueError(f"ring_bits must be an integer in [1, 64], got {bits!r}")
        self.bits = int(bits)
        self.dtype = np.dtype(np.uint32 if self.bits <= 32 else np.uint64)
        self._width = self.dtype.itemsize * 8
        self._mask = self.dtype.type((1 << self.bits) - 1)
        self.modulus = 1 << self.bits

    def __repr__(self) -> str:
        return f"RingZ2k(bits={self.bits})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RingZ2k) and other.bits == self.bits

    def __hash__(self) -> int:
        return hash(("RingZ2k", self.bits))

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
        """PRG(seed): ``length`` uniform ring elements, the ChaCha20 keystream as words."""
        if len(seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes, got {len(seed)}")
        stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
        words = np.frombuffer(stream.update(bytes(self.dtype.itemsize * length)), self.dtype)
        return self._wrap(words.copy()) if self.bits < self._width else words

    def encode_signed(self, integers) -> np.ndarray:
        """Signed integers in [-2^(bits-1), 2^(bits-1)) to their residues."""
        array = np.asarray(integers)
        if array.dtype.kind not in "iu":
            raise ValueError(f"integers must hold integers, got dtype {array.dtype}")
        array = array.astype(np.int64, copy=False)
        half = 1 << (self.bits - 1)
        if array.size and (int(array.min()) < -half or int(array.max()) >= half):
            raise ValueError(
                f"integers has entries outside [-2^{self.bits - 1}, 2^{self.bits - 1}): "
                f"[{int(array.min())}, {int(array.max())}] would wrap in Z_2^{self.bits}"
            )
        return self._wrap(array.astype(np.uint64).astype(self.dtype))

    def decode_signed(self, elements) -> np.ndarray:
        """Ring elements to their representative in [-2^(bits-1), 2^(bits-1)), as int64."""
        values = self.asarray(elements, "elements").astype(np.uint64)
        if self.bits == 64:
            return values.view(np.int64)
        signed = values.astype(np.int64)
        return np.where(signed >= 1 << (self.bits - 1), signed - (1 << self.bits), signed)


def _expand(space, seed: bytes, length: int) -> np.ndarray:
    """The mask PRG in the masking space: F_p (:func:`expand_mask`) or a :class:`RingZ2k`."""
    if isinstance(space, RingZ2k):
        return space.expand(seed, length)
    return expand_mask(seed, length, space)


def _sum_vectors(space, vectors: list[np.ndarray]) -> np.ndarray:
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


def _secret_to_elements(secret: bytes) -> np.ndarray:
    return np.frombuffer(secret, dtype="<u2").astype(np.int64)


def _elements_to_secret(elements: np.ndarray) -> bytes:
    if np.any(elements >= 2**_CHUNK_BITS):
        raise ValueError("reconstructed key chunks exceed 16 bits: shares are inconsistent")
    return elements.astype("<u2").tobytes()


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


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


class SecAggClient:
    """One client's side of SecAgg+: one handler per stage, called in order."""

    def __init__(self, client_id: int, config: SecAggConfig, session_id: bytes) -> None:
        self.client_id = int(client_id)
        self.config = config
        self.session_id = session_id
        self.stage = Stage.SETUP
        self._endpoint: Endpoint | None = None
        self._agreement_key: X25519PrivateKey | None = None
        self._self_mask_seed: bytes | None = None
        self._recipients: tuple[int, ...] = ()
        self._agreement_keys: dict[int, bytes] = {}
        self._held_shares: dict[int, np.ndarray] = {}
        self.contributes = True

    def _enter(self, target: Stage) -> None:
        check_transition(self.stage, target, f"client {self.client_id}")
        self.stage = target

    def abort(self) -> None:
        self._enter(Stage.ABORTED)

    def advertise_keys(self) -> tuple[bytes, bytes]:
        """ADVERTISE_KEYS: fresh channel and mask-agreement key pairs; returns the public keys."""
        self._enter(Stage.ADVERTISE_KEYS)
        self._endpoint = Endpoint(self.client_id, self.session_id)
        self._agreement_key = X25519PrivateKey.generate()
        return self._endpoint.public_key, _raw_public(self._agreement_key)

    def share_keys(
        self, neighbour_keys: Mapping[int, tuple[bytes, bytes]], *, contribute: bool = True
    ) -> list[Envelope]:
        """SHARE_KEYS: connect to the neighbours whose keys arrived; if contributing, draw the
        self-mask seed and share it and the agreement key among them (one sealed share row per
        neighbour). A client told not to contribute (too few live neighbours to protect its
        secrets) sends nothing but still holds and returns its neighbours' shares."""
        self._enter(Stage.SHARE_KEYS)
        recipients = tuple(sorted(int(j) for j in neighbour_keys))
        self._recipients = recipients
        self.contributes = contribute
        for peer, (channel_key, agreement_key) in neighbour_keys.items():
            self._endpoint.connect(int(peer), channel_key)
            self._agreement_keys[int(peer)] = agreement_key
        if not contribute:
            return []
        if len(recipients) < self.config.threshold:
            self._enter(Stage.ABORTED)
            raise TooManyDropoutsError(
                f"client {self.client_id} has {len(recipients)} live neighbours; sharing needs "
                f"threshold={self.config.threshold}"
            )
        self._self_mask_seed = os.urandom(SEED_BYTES)
        secrets_ = np.concatenate(
            [
                _secret_to_elements(self._self_mask_seed),
                _secret_to_elements(_raw_private(self._agreement_key)),
            ]
        )
        scheme = _scheme(self.config, len(recipients))
        shares = scheme.share(secrets_, secure=True)
        return [
            self._endpoint.seal_array(peer, self.config.round, Stage.SHARE_KEYS, shares[member])
            for member, peer in enumerate(recipients)
        ]

    def masked_input(self, envelopes: Iterable[Envelope], values) -> np.ndarray | None:
        """MASKED_INPUT: open the neighbours' shares, then return
        y = x + PRG(b) + sum_j sign(i, j) PRG(s_ij) over neighbours that shared
        (None, with ``values=None``, for a client that does not contribute)."""
        self._enter(Stage.MASKED_INPUT)
        field_ = self.config.field
        space = self.config.masking
        if self.contributes:
            values = space.asarray(values, "values").ravel()
            if values.size != self.config.vector_length:
                raise ValueError(
                    f"values has {values.size} elements; vector_length={self.config.vector_length}"
                )
        elif values is not None:
            raise ValueError(
                f"client {self.client_id} does not contribute this round; values must be None"
            )
        for envelope in envelopes:
            if envelope.sender not in self._recipients:
                raise ValueError(
                    f"client {self.client_id} got shares from sender={envelope.sender}, "
                    f"not one of its neighbours {list(self._recipients)}"
                )
            self._held_shares[envelope.sender] = field_.asarray(
                self._endpoint.open_array(
                    envelope, round_=self.config.round, stage=Stage.SHARE_KEYS
                ),
                "share",
            )
        if not self.contributes:
            return None
        masked = space.add(values, _expand(space, self._self_mask_seed, values.size))
        for peer in sorted(self._held_shares):
            seed = pairwise_seed(
                self._agreement_key,
                self._agreement_keys[peer],
                self.session_id,
                self.client_id,
                peer,
            )
            mask = _expand(space, seed, values.size)
            if self.client_id < peer:
                masked = space.add(masked, mask)
            else:
                masked = space.sub(masked, mask)
        return masked

    def unmask(self, survivors: Iterable[int], dropped: Iterable[int]) -> UnmaskResponse:
        """UNMASK: for each neighbour that shared with us, return the share of its self-mask
        seed if it survived, of its agreement key if it dropped, never both."""
        self._enter(Stage.UNMASK)
        survivors, dropped = set(survivors), set(dropped)
        both = survivors & dropped
        if both:
            self._enter(Stage.ABORTED)
            raise ValueError(
                f"client {self.client_id} refuses to unmask: clients {sorted(both)} are listed "
                "as both survived and dropped (that would reveal their inputs)"
            )
        self_mask, secret_key = {}, {}
        for owner, share in self._held_shares.items():
            if owner in survivors:
                self_mask[owner] = share[:_CHUNKS_PER_SECRET]
            elif owner in dropped:
                secret_key[owner] = share[_CHUNKS_PER_SECRET:]
        self._enter(Stage.DONE)
        return UnmaskResponse(self_mask, secret_key)


@dataclass
class ServerView:
    """Everything the server received or derived, for audits and tests."""

    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    masked_inputs: dict[int, np.ndarray] = field(default_factory=dict)
    responses: dict[int, UnmaskResponse] = field(default_factory=dict)
    recovered_self_masks: dict[int, bytes] = field(default_factory=dict)
    recovered_secret_keys: dict[int, bytes] = field(default_factory=dict)


class SecAggServer:
    """The server's side of SecAgg+: relays, bookkeeping, and the final unmasking.

    ``session_id`` is the public per-round salt (HKDF) shared with the clients; the neighbour
    graph is drawn from ``graph_rng``.
    """

    def __init__(
        self,
        config: SecAggConfig,
        client_ids: Iterable[int],
        session_id: bytes,
        graph_rng: np.random.Generator,
        relay: Relay | None = None,
    ) -> None:
        self.config = config
        self.session_id = session_id
        self.client_ids = tuple(int(i) for i in client_ids)
        if len(self.client_ids) != config.num_clients:
            raise ValueError(
                f"client_ids has {len(self.client_ids)} ids; num_clients={config.num_clients}"
            )
        self.graph = neighbour_graph(self.client_ids, config.degree, graph_rng)
        self.relay = relay if relay is not None else Relay()
        self.view = ServerView()
        self.stage = Stage.SETUP
        self.advertised: tuple[int, ...] = ()
        self.excluded: tuple[int, ...] = ()
        self.shared: tuple[int, ...] = ()
        self.survivors: tuple[int, ...] = ()
        self.dropped: tuple[int, ...] = ()
        self._recipients: dict[int, tuple[int, ...]] = {}

    @property
    def transcript(self) -> Transcript:
        return self.relay.transcript

    def _enter(self, target: Stage) -> None:
        check_transition(self.stage, target, "server")
        self.stage = target

    def _require(self, count: int, stage: Stage, what: str) -> None:
        if count < self.config.survivors_needed:
            self._enter(Stage.ABORTED)
            raise TooManyDropoutsError(
                f"round {self.config.round} aborted in {stage.name}: {what} {count} clients, "
                f"at least {self.config.survivors_needed} needed"
            )

    def advertise_keys(
        self, public_keys: Mapping[int, tuple[bytes, bytes]]
    ) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """ADVERTISE_KEYS: collect public keys; return, per live client, its live neighbours'
        keys. Clients left with fewer than ``threshold`` live neighbours are excluded."""
        self._enter(Stage.ADVERTISE_KEYS)
        for client, keys in public_keys.items():
            if client not in self.graph:
                raise ValueError(f"public_keys has unknown client id {client}")
            self.view.public_keys[int(client)] = keys
            self.transcript.record(int(client), SERVER_ID, Stage.ADVERTISE_KEYS, 64 + 8)
        live = set(self.view.public_keys)
        self.advertised = tuple(sorted(live))
        self.excluded = tuple(
            i
            for i in self.advertised
            if len(live.intersection(self.graph[i])) < self.config.threshold
        )
        self._require(len(live) - len(self.excluded), Stage.ADVERTISE_KEYS, "keys usable from")
        routed = {}
        for client in self.advertised:
            neighbours = {j: self.view.public_keys[j] for j in self.graph[client] if j in live}
            self._recipients[client] = tuple(sorted(neighbours))
            routed[client] = neighbours
            self.transcript.record(SERVER_ID, client, Stage.ADVERTISE_KEYS, 72 * len(neighbours))
        return routed

    def share_keys(self, envelopes: Mapping[int, list[Envelope]]) -> dict[int, list[Envelope]]:
        """SHARE_KEYS: relay the sealed share rows; returns each client's incoming envelopes."""
        self._enter(Stage.SHARE_KEYS)
        senders = []
        for sender, batch in envelopes.items():
            if sender not in self._recipients or sender in self.excluded:
                raise ValueError(
                    f"envelopes from client {sender}, which did not advertise keys or was "
                    "told not to contribute"
                )
            receivers = sorted(envelope.receiver for envelope in batch)
            if receivers != list(self._recipients[sender]) or any(
                envelope.sender != sender for envelope in batch
            ):
                raise ValueError(
                    f"client {sender} must send one envelope to each of "
                    f"{list(self._recipients[sender])}, got receivers {receivers}"
                )
            senders.append(int(sender))
            for envelope in batch:
                self.relay.post(envelope)
        self.shared = tuple(sorted(senders))
        self._require(len(self.shared), Stage.SHARE_KEYS, "shares arrived from")
        # excluded clients contribute nothing but hold their neighbours' shares
        return {client: self.relay.deliver(client) for client in self.advertised}

    def masked_input(self, masked_inputs: Mapping[int, np.ndarray]) -> tuple[tuple, tuple]:
        """MASKED_INPUT: collect y_i from clients that shared; returns (survivors, dropped)."""
        self._enter(Stage.MASKED_INPUT)
        field_ = self.config.masking
        for client, masked in masked_inputs.items():
            if client not in self.shared:
                raise ValueError(f"masked input from client {client}, which shared no keys")
            masked = field_.asarray(masked, f"masked_inputs[{client}]").ravel()
            if masked.size != self.config.vector_length:
                raise ValueError(
                    f"masked_inputs[{client}] has {masked.size} elements; "
                    f"vector_length={self.config.vector_length}"
                )
            self.view.masked_inputs[int(client)] = masked
            self.transcript.record(
                int(client), SERVER_ID, Stage.MASKED_INPUT, masked.size * field_.bytes_per_element
            )
        self.survivors = tuple(sorted(self.view.masked_inputs))
        self.dropped = tuple(sorted(set(self.shared) - set(self.survivors)))
        self._require(len(self.survivors), Stage.MASKED_INPUT, "masked inputs arrived from")
        for client in self.survivors + self.excluded:
            self.transcript.record(
                SERVER_ID, client, Stage.MASKED_INPUT, 8 * (len(self.survivors) + len(self.dropped))
            )
        return self.survivors, self.dropped

    def unmask(self, responses: Mapping[int, UnmaskResponse]) -> np.ndarray:
        """UNMASK: reconstruct survivors' self-mask seeds and dropped clients' agreement keys
        from the neighbours' shares; return sum_{i in survivors} x_i (mod p)."""
        self._enter(Stage.UNMASK)
        field_ = self.config.masking
        for client, response in responses.items():
            if client not in self.survivors and client not in self.excluded:
                raise ValueError(
                    f"unmask response from client {client}, neither a survivor nor a share "
                    "holder that was excluded from contributing"
                )
            self.view.responses[int(client)] = response
            self.transcript.record(int(client), SERVER_ID, Stage.UNMASK, response.nbytes)
        total = _sum_vectors(field_, [self.view.masked_inputs[i] for i in self.survivors])
        length = self.config.vector_length
        for owner in self.survivors:
            seed = self._recover(owner, "self_mask_shares")
            self.view.recovered_self_masks[owner] = seed
            total = field_.sub(total, _expand(field_, seed, length))
        for owner in self.dropped:
            partners = [j for j in self._recipients[owner] if j in self.survivors]
            if not partners:
                continue
            raw_key = self._recover(owner, "secret_key_shares")
            self.view.recovered_secret_keys[owner] = raw_key
            key = X25519PrivateKey.from_private_bytes(raw_key)
            for partner in partners:
                seed = pairwise_seed(
                    key, self.view.public_keys[partner][1], self.session_id, owner, partner
                )
                mask = _expand(field_, seed, length)
                # the partner added +mask if partner < owner, else -mask: undo it
                if partner < owner:
                    total = field_.sub(total, mask)
                else:
                    total = field_.add(total, mask)
        self._enter(Stage.DONE)
        return total

    def _recover(self, owner: int, kind: str) -> bytes:
        members, rows = [], []
        recipients = self._recipients[owner]
        for responder, response in self.view.responses.items():
            share = getattr(response, kind).get(owner)
            if share is not None:
                if responder not in recipients:
                    raise ValueError(
                        f"client {responder} returned a share of {owner}'s secret "
                        "without being one of its recipients"
                    )
                members.append(recipients.index(responder))
                rows.append(share)
        scheme = _scheme(self.config, len(recipients))
        if len(members) < scheme.threshold:
            self._enter(Stage.ABORTED)
            what = "self-mask seed" if kind == "self_mask_shares" else "mask-agreement key"
            raise TooManyDropoutsError(
                f"round {self.config.round} aborted in UNMASK: client {owner}'s {what} needs "
                f"{scheme.threshold} shares, {len(members)} neighbours answered"
            )
        try:
            elements = scheme.reconstruct(np.stack(rows), members, _CHUNKS_PER_SECRET)
        except ValueError:
            self._enter(Stage.ABORTED)
            raise
        return _elements_to_secret(elements)


def _scheme(config: SecAggConfig, recipients: int) -> PackedShamir:
    """Plain Shamir (k = 1) among ``recipients`` neighbours: ``threshold`` shares reconstruct."""
    return _cached_scheme(recipients, config.threshold - 1, config.field)


@functools.lru_cache(maxsize=16)
def _cached_ring(bits: int) -> RingZ2k:
    return RingZ2k(bits)


@functools.lru_cache(maxsize=64)
def _cached_scheme(members: int, privacy: int, field_: MersenneField) -> PackedShamir:
    # one instance per shape, so its share and Lagrange matrices are computed once
    return PackedShamir(n=members, t=privacy, k=1, field=field_)


@dataclass
class SecAggResult:
    """Outcome of :func:`run_secagg`."""

    aggregate: np.ndarray
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    excluded: tuple[int, ...]
    server: SecAggServer
    clients: dict[int, SecAggClient]


def run_secagg(
    config: SecAggConfig,
    inputs: Mapping[int, np.ndarray],
    graph_rng: np.random.Generator,
    dropouts: Mapping[Stage, Iterable[int]] | None = None,
) -> SecAggResult:
    """One full round in process: every client's handlers and the server's, with clients that
    stop answering at a given stage (``dropouts[stage]``: they skip that stage and all later
    ones). Raises :class:`TooManyDropoutsError` when recovery is impossible."""
    dropouts = {stage: set(ids) for stage, ids in (dropouts or {}).items()}
    for stage in dropouts:
        if stage not in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK):
            raise ValueError(f"dropouts has stage {stage.name}; clients drop in stages 1-4")
    session_id = new_session_id()
    server = SecAggServer(config, inputs.keys(), session_id, graph_rng)
    clients = {i: SecAggClient(i, config, session_id) for i in inputs}
    gone: set[int] = set()

    def live(stage: Stage, candidates: Iterable[int]) -> list[int]:
        gone.update(dropouts.get(stage, ()))
        return [i for i in candidates if i not in gone]

    keys = {i: clients[i].advertise_keys() for i in live(Stage.ADVERTISE_KEYS, clients)}
    routed = server.advertise_keys(keys)
    excluded = set(server.excluded)
    outgoing = {}
    for i in live(Stage.SHARE_KEYS, routed):
        envelopes = clients[i].share_keys(routed[i], contribute=i not in excluded)
        if i not in excluded:
            outgoing[i] = envelopes
    incoming = server.share_keys(outgoing)
    masked = {}
    for i in live(Stage.MASKED_INPUT, incoming):
        contribution = clients[i].masked_input(incoming[i], None if i in excluded else inputs[i])
        if contribution is not None:
            masked[i] = contribution
    survivors, dropped = server.masked_input(masked)
    holders = [i for i in incoming if i in survivors or i in excluded]
    responses = {i: clients[i].unmask(survivors, dropped) for i in live(Stage.UNMASK, holders)}
    aggregate = server.unmask(responses)
    return SecAggResult(aggregate, survivors, dropped, server.excluded, server, clients)
