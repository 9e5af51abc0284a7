"""The client's side of SecAgg+ (Bell et al., CCS 2020) as a state machine that can be stored
between messages; the protocol itself is described in :mod:`protocols.secagg`.

**Whose randomness.** Every secret of a client in a round -- its channel and mask-agreement
X25519 private keys, its self-mask seed b_i and the randomness of its Shamir shares -- is derived
by HKDF-SHA256 (RFC 5869) from one 32-byte seed that belongs to the client
(``SecAggClient(seed=...)``: derived by the caller from the client's own secret, or drawn from
the OS CSPRNG). Replaying a stage from the same stored state therefore seals the same bytes
under the same nonce. The session id (the HKDF salt of the pairwise seeds and channels) is public
and chosen by the server.

**State between messages.** :meth:`SecAggClient.to_state` writes the protocol state as a
:class:`~protocols.secagg.state.SecAggClientState` (named integer arrays, no pickle; the seed
included, so the caller seals it) and :meth:`SecAggClient.from_state` restores it, so the
client side runs as a sequence of message exchanges (:mod:`protocols.secagg.stages`). What
SHARE_KEYS derived is kept there too -- the channel receive keys from the neighbours and the
pairwise seeds s_ij (one X25519 agreement per neighbour and key, which also checks the key) --
so that MASKED_INPUT opens the shares and masks without agreeing again; these are the client's own
secrets, derivable from its seed, and stored only where the seed is. The server numbers the
clients of a round (protocol ids below 2^63 - 1) and tells each its number with its neighbours'
keys in SHARE_KEYS.

**Hostile messages.** Each handler checks its stage transition (:class:`StageError`) and what it
is given -- the parameters, its neighbours' ids and keys (distinct, usable X25519 points: an
unusable one is a :class:`~protocols.channels.ChannelError` in ``connect``), the envelopes (from
neighbours only, one each, bound to this round and stage, a share row of the right length in the
field), the survivor lists (ids, disjoint, at least ``survivors_needed``) -- and refuses a bad
one by moving to ABORTED and raising (``ValueError``, ``TypeError``, ``ChannelError``,
:class:`TooManyDropoutsError`).

**Keys bound at enrolment.** An enrolled client signs its two keys with its identity
(:meth:`SecAggClient.key_proof`, :meth:`protocols.enrolment.Identity.prove`) and, given its
enrolment's :class:`~protocols.enrolment.KeyVerifier`, shares its secrets only with neighbours
whose keys distinct enrolled parties other than itself signed for this session: a server that
substitutes keys to collect shares of b_i and of the agreement key (and so unmask y_i) meets a
:class:`~protocols.channels.KeySubstitution` in SHARE_KEYS, before anything is sealed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocols.channels import PUBLIC_KEY_BYTES, SERVER_ID, ChannelError, Endpoint, Envelope
from protocols.enrolment import Identity, KeyVerifier
from protocols.kit import RoundAborted, TooManyDropoutsError
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    PROTOCOL,
    SEED_BYTES,
    SHARE_ROW_LENGTH,
    TRANSITIONS,
    RingZ2k,
    SecAggConfig,
    Stage,
    UnmaskResponse,
    check_transition,
    decode_share_row,
    encode_share_row,
    integer_vector,
    key_problem,
    pairwise_seed,
    prg,
    raw_private_key,
    raw_public_key,
    secret_to_elements,
    shamir_scheme,
)
from protocols.secagg.state import SecAggClientState

_DERIVE_LABEL = b"fedsim/secagg/client/v2/"


def _derive(seed: bytes, label: bytes) -> bytes:
    """HKDF-SHA256(seed, info = label): one of a client's secrets, 32 bytes."""
    return HKDF(
        algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=_DERIVE_LABEL + label
    ).derive(seed)


class SecAggClient:
    """One client's side of SecAgg+: one handler per stage, called in order.

    ``session_id``: the round's public salt (at least 16 bytes); ``seed``: 32 bytes of the
    client's own secret for this session, from which every secret it uses is derived (None:
    drawn from the OS CSPRNG). The server gives the client its protocol id in SHARE_KEYS.
    """

    def __init__(self, session_id: bytes, *, seed: bytes | None = None) -> None:
        if not isinstance(session_id, bytes) or len(session_id) < 16:
            raise ValueError(f"session_id must be at least 16 bytes, got {session_id!r}")
        if seed is None:
            seed = os.urandom(SEED_BYTES)
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes of the client's own secret")
        self.session_id = session_id
        self._seed = seed
        self.stage = Stage.SETUP
        self.client_id: int | None = None
        self.config: SecAggConfig | None = None
        self.contributes = True
        self._endpoint: Endpoint | None = None
        self._restored_keys: dict[int, bytes] = {}  # receive keys read back, not yet in use
        self._neighbour_keys: dict[int, tuple[bytes, bytes]] = {}
        self._mask_seeds: dict[int, bytes] = {}
        self._held_shares: dict[int, np.ndarray] = {}

    def __reduce__(self):
        raise TypeError("a SecAggClient holds secrets: store to_state() sealed, never a pickle")

    @functools.cached_property
    def _agreement_key(self) -> X25519PrivateKey:
        return X25519PrivateKey.from_private_bytes(_derive(self._seed, b"agreement"))

    @functools.cached_property
    def _channel_key(self) -> bytes:
        return _derive(self._seed, b"channel")

    @functools.cached_property
    def _channel_private(self) -> X25519PrivateKey:
        """The channel key pair, loaded once for :attr:`public_keys` and the endpoint."""
        return X25519PrivateKey.from_private_bytes(self._channel_key)

    @functools.cached_property
    def _self_mask_seed(self) -> bytes:
        return _derive(self._seed, b"self-mask")

    @functools.cached_property
    def public_keys(self) -> tuple[bytes, bytes]:
        """(channel, mask-agreement) X25519 public keys (derived once per client)."""
        return raw_public_key(self._channel_private), raw_public_key(self._agreement_key)

    def key_proof(self, identity: Identity) -> bytes:
        """The enrolment proof of :attr:`public_keys` by the client's ``identity`` (bound to
        this protocol and session; the protocol id is assigned later)."""
        return identity.prove(PROTOCOL, self.session_id, None, self.public_keys)

    @property
    def _recipients(self) -> tuple[int, ...]:
        return tuple(sorted(self._neighbour_keys))

    def _who(self) -> str:
        return "client" if self.client_id is None else f"client {self.client_id}"

    def _enter(self, target: Stage) -> None:
        check_transition(self.stage, target, self._who())
        self.stage = target

    def abort(self) -> None:
        self._enter(Stage.ABORTED)

    def _refuse(self, error: Exception) -> Exception:
        """Move to ABORTED and return ``error`` for the caller to raise."""
        if Stage.ABORTED in TRANSITIONS[self.stage]:
            self.stage = Stage.ABORTED
        return error

    def advertise_keys(self) -> tuple[bytes, bytes]:
        """ADVERTISE_KEYS: the channel and mask-agreement public keys."""
        self._enter(Stage.ADVERTISE_KEYS)
        return self.public_keys

    def share_keys(
        self,
        client_id: int,
        config: SecAggConfig,
        neighbour_keys: Mapping[int, tuple[bytes, bytes]],
        *,
        contribute: bool = True,
        proofs: Mapping[int, bytes] | None = None,
        verifier: KeyVerifier | None = None,
        own: str | None = None,
    ) -> list[Envelope]:
        """SHARE_KEYS: take the protocol id ``client_id`` and the round's ``config``, connect to
        the neighbours whose keys arrived and, if contributing, share b_i and the agreement key
        among them (one sealed share row per neighbour). A client told not to contribute (too
        few live neighbours to protect its secrets) sends nothing but still holds and returns
        its neighbours' shares. With ``verifier`` (the client's enrolment; ``own``: its enrolled
        name) every neighbour's keys must carry ``proofs[j]`` by a distinct enrolled party."""
        self._enter(Stage.SHARE_KEYS)
        try:
            if verifier is not None:
                self._check_proofs(neighbour_keys, proofs or {}, verifier, own)
            self._accept_neighbours(client_id, config, neighbour_keys, contribute)
        except (ValueError, TypeError, RoundAborted) as error:
            raise self._refuse(error) from None
        if not contribute:
            return []
        secrets_ = np.concatenate(
            [
                secret_to_elements(self._self_mask_seed),
                secret_to_elements(raw_private_key(self._agreement_key)),
            ]
        )
        recipients = self._recipients
        share_rng = np.random.default_rng(
            np.random.SeedSequence(int.from_bytes(_derive(self._seed, b"shares"), "little"))
        )
        shares = shamir_scheme(config, len(recipients)).share(secrets_, rng=share_rng)
        return [
            self._endpoint.seal(
                peer, config.round, Stage.SHARE_KEYS, encode_share_row(shares[member])
            )
            for member, peer in enumerate(recipients)
        ]

    def _check_proofs(self, neighbour_keys, proofs, verifier: KeyVerifier, own) -> None:
        """:class:`~protocols.channels.KeySubstitution` unless each neighbour's (channel,
        agreement) keys were signed for this session by a distinct enrolled party, not us."""
        if not isinstance(neighbour_keys, Mapping) or not isinstance(proofs, Mapping):
            raise TypeError("neighbour keys and proofs must map neighbour ids")
        entries = []
        for peer, keys in sorted(neighbour_keys.items(), key=lambda item: str(item[0])):
            if not isinstance(keys, tuple | list) or len(keys) != 2:
                raise ValueError(f"neighbour {peer}'s keys must be a (channel, agreement) pair")
            entries.append((f"neighbour {peer}", None, tuple(keys), proofs.get(peer), None))
        verifier.check_all(entries, protocol=PROTOCOL, session_id=self.session_id, own=own)

    def _accept_neighbours(
        self,
        client_id: int,
        config: SecAggConfig,
        neighbour_keys: Mapping[int, tuple[bytes, bytes]],
        contribute: bool,
    ) -> None:
        if not isinstance(config, SecAggConfig):
            raise TypeError(f"config must be a SecAggConfig, got {type(config).__name__}")
        if not isinstance(client_id, int | np.integer) or not 0 <= client_id < SERVER_ID:
            raise ValueError(f"client_id must be an integer in [0, 2^63 - 1), got {client_id!r}")
        if not isinstance(neighbour_keys, Mapping):
            raise TypeError("neighbour_keys must map neighbour ids to (channel, agreement) keys")
        self.client_id, self.config, self.contributes = int(client_id), config, bool(contribute)
        if len(neighbour_keys) > config.degree:
            raise ValueError(
                f"{len(neighbour_keys)} neighbour keys arrived; the round's degree is "
                f"{config.degree}"
            )
        own = set(self.public_keys)
        seen: set[bytes] = set()
        endpoint = Endpoint(self.client_id, self.session_id, PROTOCOL, self._channel_private)
        for peer, keys in neighbour_keys.items():
            if not isinstance(peer, int | np.integer) or not 0 <= peer < SERVER_ID:
                raise ValueError(f"neighbour id {peer!r} is not a protocol id")
            if not isinstance(keys, tuple | list) or len(keys) != 2:
                raise ValueError(f"neighbour {peer}'s keys must be a (channel, agreement) pair")
            for key in keys:
                if key in own or key in seen:
                    raise ValueError(f"neighbour {peer}'s key repeats another party's key")
                seen.add(key)
            endpoint.connect(int(peer), keys[0])  # ChannelError (a ValueError) if unusable
            # the mask agreement itself checks the key (X25519 refuses an all-zero or
            # low-order point): one agreement, kept for MASKED_INPUT, where a check and a
            # second agreement took two
            self._mask_seeds[int(peer)] = self._agree(int(peer), keys[1])
            self._neighbour_keys[int(peer)] = (keys[0], keys[1])
        self._endpoint = endpoint
        if contribute and len(self._neighbour_keys) < config.threshold:
            raise TooManyDropoutsError(
                f"client {self.client_id} has {len(self._neighbour_keys)} live neighbours; "
                f"sharing needs threshold={config.threshold}"
            )

    def _agree(self, peer: int, public_key: object) -> bytes:
        """s_ij with ``peer`` (:func:`protocols.secagg.common.pairwise_seed`), or a ChannelError
        naming the neighbour when its agreement key is unusable."""
        if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
            raise ChannelError(f"neighbour {peer}'s agreement key: {key_problem(public_key)}")
        try:
            return pairwise_seed(
                self._agreement_key, public_key, self.session_id, self.client_id, peer
            )
        except ValueError as error:
            raise ChannelError(
                f"neighbour {peer}'s agreement key: unusable X25519 public key (all-zero or "
                f"low-order point): {error}"
            ) from None

    def masked_input(self, envelopes: Iterable[Envelope], values) -> np.ndarray | None:
        """MASKED_INPUT: open the neighbours' shares, then return
        y = x + PRG(b) + sum_j sign(i, j) PRG(s_ij) over neighbours that shared
        (None, with ``values=None``, for a client that does not contribute)."""
        self._enter(Stage.MASKED_INPUT)
        config = self.config
        try:
            if self.contributes:
                values = self._own_input(values)
            elif values is not None:
                raise ValueError(f"{self._who()} does not contribute; values must be None")
            self._open_shares(envelopes)
        except (ValueError, TypeError) as error:
            raise self._refuse(error) from None
        if not self.contributes:
            return None
        space = config.masking
        seeds = [(self._self_mask_seed, 1)]
        for peer in sorted(self._held_shares):
            seed = self._mask_seeds.get(peer)
            if seed is None:
                seed = self._agree(peer, self._neighbour_keys[peer][1])
            seeds.append((seed, 1 if self.client_id < peer else -1))
        if isinstance(space, RingZ2k):
            return space.masked_sum(values, seeds)
        masked = values
        for seed, sign in seeds:
            mask = prg(space, seed, values.size)
            masked = space.add(masked, mask) if sign > 0 else space.sub(masked, mask)
        return masked

    def _own_input(self, values) -> np.ndarray:
        """``values`` checked as the round's input; the error never echoes an entry."""
        try:
            return integer_vector(
                np.asarray(values).ravel(), self.config.masking, self.config.vector_length, "x"
            )
        except (ValueError, TypeError):
            raise ValueError(
                f"values must be {self.config.vector_length} integers in the masking space "
                f"{self.config.masking!r}"
            ) from None

    def _connected(self) -> Endpoint:
        """The endpoint, able to open from every neighbour whose keys it holds: the channels
        restored from the state's receive keys, the others connected (a ChannelError, a
        ValueError, for an unusable key)."""
        if self._endpoint is None:
            self._endpoint = Endpoint(self.client_id, self.session_id, PROTOCOL, self._channel_key)
            for peer, key in self._restored_keys.items():
                self._endpoint.accept_receive_key(peer, self._neighbour_keys[peer][0], key)
        connected = set(self._endpoint.senders)
        for peer, (channel, _) in self._neighbour_keys.items():
            if peer not in connected:
                self._endpoint.connect(peer, channel)
        return self._endpoint

    def _open_shares(self, envelopes: Iterable[Envelope]) -> None:
        if isinstance(envelopes, bytes | str) or not isinstance(envelopes, Iterable):
            raise TypeError("envelopes must be a list of Envelope objects")
        endpoint = None  # connected at the first envelope
        for envelope in envelopes:
            if not isinstance(envelope, Envelope):
                raise TypeError(f"envelopes holds a {type(envelope).__name__}, not an Envelope")
            sender = envelope.sender
            if sender not in self._neighbour_keys or sender in self._held_shares:
                raise ValueError(
                    f"{self._who()} got a share from sender={sender!r}: not a neighbour, or "
                    "a second one"
                )
            if endpoint is None:
                endpoint = self._connected()
            row = endpoint.open_array(
                envelope,
                round_=self.config.round,
                stage=Stage.SHARE_KEYS,
                sender=sender,
                decode=decode_share_row,
            )
            self._held_shares[sender] = integer_vector(
                row, self.config.field, SHARE_ROW_LENGTH, f"the share from {sender}"
            )

    def unmask(self, survivors: Iterable[int], dropped: Iterable[int]) -> UnmaskResponse:
        """UNMASK: for each neighbour that shared with us, return the share of its self-mask
        seed if it survived, of its agreement key if it dropped, never both; refuse to answer
        when fewer than ``survivors_needed`` clients survived."""
        self._enter(Stage.UNMASK)
        try:
            survivors, dropped = _id_set(survivors, "survivors"), _id_set(dropped, "dropped")
        except (ValueError, TypeError) as error:
            raise self._refuse(error) from None
        both = survivors & dropped
        if both:
            raise self._refuse(
                ValueError(
                    f"{self._who()} refuses to unmask: clients {sorted(both)} are listed as "
                    "both survived and dropped (that would reveal their inputs)"
                )
            )
        if len(survivors) < self.config.survivors_needed:
            raise self._refuse(
                TooManyDropoutsError(
                    f"{self._who()} refuses to unmask a sum of {len(survivors)} inputs; at "
                    f"least {self.config.survivors_needed} needed"
                )
            )
        self_mask, secret_key = {}, {}
        for owner, share in self._held_shares.items():
            if owner in survivors:
                self_mask[owner] = share[:CHUNKS_PER_SECRET]
            elif owner in dropped:
                secret_key[owner] = share[CHUNKS_PER_SECRET:]
        self._enter(Stage.DONE)
        return UnmaskResponse(self_mask, secret_key)

    def to_state(self) -> SecAggClientState:
        """The client's whole protocol state (its seed included: seal it)."""
        owners = sorted(self._held_shares)
        neighbours = self._recipients
        return SecAggClientState(
            seed=self._seed,
            session=self.session_id,
            stage=self.stage,
            client_id=self.client_id,
            contributes=self.contributes,
            config=self.config,
            neighbours=np.array(neighbours, dtype=np.int64),
            neighbour_keys=np.frombuffer(
                b"".join(b"".join(self._neighbour_keys[j]) for j in neighbours), dtype=np.uint8
            ).reshape(len(neighbours), 2 * PUBLIC_KEY_BYTES),
            receive_keys=self._receive_keys(neighbours),
            mask_seeds=self._seed_rows(neighbours),
            share_owners=np.array(owners, dtype=np.int64),
            shares=np.array([self._held_shares[j] for j in owners], dtype=np.int64).reshape(
                len(owners), SHARE_ROW_LENGTH
            ),
        )

    def _receive_keys(self, neighbours: tuple[int, ...]) -> np.ndarray:
        """The channel receive keys from ``neighbours`` (one 32-byte row each), so that a
        restored client opens their envelopes without redoing the X25519 agreements; no rows
        until every neighbour is connected."""
        endpoint = self._endpoint
        if endpoint is None:  # restored, never opened from: the keys as they were read
            held = self._restored_keys
            if not neighbours or set(neighbours) - set(held):
                return np.zeros((0, 32), dtype=np.uint8)
            keys = b"".join(held[j] for j in neighbours)
            return np.frombuffer(keys, dtype=np.uint8).reshape(len(neighbours), 32)
        if not neighbours or set(neighbours) - set(endpoint.senders):
            return np.zeros((0, 32), dtype=np.uint8)
        keys = b"".join(endpoint.receive_key(j) for j in neighbours)
        return np.frombuffer(keys, dtype=np.uint8).reshape(len(neighbours), 32)

    def _seed_rows(self, neighbours: tuple[int, ...]) -> np.ndarray:
        """The pairwise seeds s_ij agreed in SHARE_KEYS (one 32-byte row per neighbour), so
        that MASKED_INPUT needs no X25519; no rows until all are agreed."""
        if not neighbours or set(neighbours) - set(self._mask_seeds):
            return np.zeros((0, SEED_BYTES), dtype=np.uint8)
        seeds = b"".join(self._mask_seeds[j] for j in neighbours)
        return np.frombuffer(seeds, dtype=np.uint8).reshape(len(neighbours), SEED_BYTES)

    @classmethod
    def from_state(cls, state: SecAggClientState) -> SecAggClient:
        """The client :meth:`to_state` wrote; ``ValueError`` if it is not such a state."""
        if not isinstance(state, SecAggClientState):
            raise TypeError(f"state must be a SecAggClientState, got {type(state).__name__}")
        try:
            state.check()
            return cls._restore(state)
        except (KeyError, TypeError, ValueError, OverflowError, IndexError) as error:
            message = str(error)
            prefix = "not a SecAgg+ client state: "
            raise ValueError(message if message.startswith(prefix) else prefix + message) from None

    @classmethod
    def _restore(cls, state: SecAggClientState) -> SecAggClient:
        client = cls(state.session, seed=state.seed)
        client.stage = state.stage
        client.contributes = state.contributes
        if state.client_id is None:
            return client
        client.client_id, client.config = state.client_id, state.config
        neighbours = state.neighbours.astype(np.int64).tolist()
        # the receive keys from the neighbours come back from the state (MASKED_INPUT opens
        # with them, no X25519); the endpoint is built when a stage first opens (_connected)
        for peer, raw in zip(neighbours, _rows(state.neighbour_keys)):
            client._neighbour_keys[peer] = (raw[:PUBLIC_KEY_BYTES], raw[PUBLIC_KEY_BYTES:])
        for peer, key in zip(neighbours, _rows(state.receive_keys)):
            if not 0 <= peer < SERVER_ID or peer == client.client_id:
                raise ValueError(f"neighbour id {peer} is not another party's protocol id")
            client._restored_keys[peer] = key
        client._mask_seeds = dict(zip(neighbours, _rows(state.mask_seeds)))
        owners = state.share_owners.astype(np.int64).tolist()
        client._held_shares = dict(zip(owners, state.shares.astype(np.int64)))
        return client


def _rows(table: np.ndarray) -> list[bytes]:
    """Each row of a 2-D table of bytes as ``bytes`` (one copy of the table, then slices)."""
    flat = np.ascontiguousarray(table, dtype=np.uint8).tobytes()
    count, width = table.shape
    if not width:
        return [b""] * count
    return [flat[i : i + width] for i in range(0, width * count, width)]


def _id_set(ids: object, name: str) -> set[int]:
    """``ids`` as a set of client ids; TypeError unless a collection, ValueError naming the
    first entry that is not an int in [0, SERVER_ID) (a bool is not an id). A cohort's list
    is checked by its types and its extremes, not entry by entry."""
    if isinstance(ids, bytes | str) or not isinstance(ids, Iterable):
        raise TypeError(f"{name} must be a collection of client ids")
    items = ids.tolist() if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu" else list(ids)
    if set(map(type, items)) <= {int} and (
        not items or (min(items) >= 0 and max(items) < SERVER_ID)
    ):
        return set(items)
    for i in items:
        if not isinstance(i, int | np.integer) or isinstance(i, bool) or not 0 <= i < SERVER_ID:
            raise ValueError(f"{name} holds {i!r}, not a client id")
    return {int(i) for i in items}
