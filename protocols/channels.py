"""Authenticated encrypted channels between parties, relayed by an untrusted server.

Each party holds an X25519 key pair (RFC 7748) generated from the OS CSPRNG. Two parties derive,
from their X25519 shared secret, one 256-bit key per direction with HKDF-SHA256 (RFC 5869;
salt = the session id, info = protocol label, both ids and both public keys). Messages are
sealed with ChaCha20-Poly1305 (RFC 8439) under the sender->receiver key, with:

* nonce: 4 zero bytes + a 64-bit big-endian counter, unique per directional key (the sender
  increments it; a key is never used by anyone else);
* associated data: (protocol, session, round, stage, sender, receiver). The receiver opens an
  envelope only against the round and stage *it expects* (and, where it knows it, the sender):
  the header the relay shows is checked against them and the AAD is rebuilt from the expected
  values, so a ciphertext replayed in another round, stage, protocol or session, or redirected
  to another receiver, fails; an exact replay of an opened message is refused by the receiver's
  record of seen counters, which is kept per directional key and never cleared.
* nonce uniqueness: a directional key is fixed by the two public keys, and its counter is kept
  for the endpoint's whole life, so re-connecting a peer to an earlier key (A -> B -> A) resumes
  that key's counter instead of restarting it. A new session (round) uses a new endpoint, i.e.
  a fresh key pair: no key outlives its session.
* public keys: an all-zero or low-order X25519 key (no contributory shared secret) is refused
  with :class:`ChannelError` naming the peer, so one bad key drops that peer, not the protocol.

The :class:`Relay` stands for the server: it only ever holds :class:`Envelope` objects
(ciphertext plus routing header) and counts every message's bytes in a :class:`Transcript`.

Keys bound at enrolment are :mod:`protocols.enrolment`'s.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PROTOCOL_LABEL = b"fedsim/channels/v1"
NONCE_BYTES = 12
TAG_BYTES = 16
PUBLIC_KEY_BYTES = 32
_MAX_COUNTER = 2**64 - 1
SERVER_ID = 2**63 - 1
"""Party id of the server in transcripts."""


class ChannelError(ValueError):
    """A message could not be opened: wrong key, tampered, misbound or misdelivered."""


class ReplayError(ChannelError):
    """A message that was already opened was presented again."""


class KeySubstitution(ChannelError):
    """A relayed public key is not bound to an enrolled party: no proof, a proof that does not
    verify under the enrolment authority, or one enrolled name standing for two parties."""


def stage_label(stage: str | Enum) -> str:
    """The text a stage is bound under: an Enum member's name, or the string itself."""
    if isinstance(stage, Enum):
        return stage.name
    if isinstance(stage, str) and stage:
        return stage
    raise ValueError(f"stage must be a non-empty str or an Enum member, got {stage!r}")


_INTEGERS = (int, np.integer)
"""The types an id may have (a tuple: ``isinstance`` with it needs no union built per call)."""


def check_party(name: str, value: int) -> int:
    if type(value) is int and 0 <= value < 2**63:  # the usual case, no further checks
        return value
    if not isinstance(value, _INTEGERS) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be an integer in [0, 2^63), got {value!r}")
    return int(value)


def associated_data(
    protocol: bytes, session_id: bytes, sender: int, receiver: int, round_: int, stage: str | Enum
) -> bytes:
    """The bytes every ciphertext is bound to: the channel label, the protocol, the session
    (run), sender, receiver, round and stage."""
    return _aad_prefix(protocol, session_id) + _aad_tail(sender, receiver, round_, stage)


def _aad_prefix(protocol: bytes, session_id: bytes) -> bytes:
    """The part of :func:`associated_data` that is the same for every message of a session."""
    return (
        PROTOCOL_LABEL
        + struct.pack(">H", len(protocol))
        + protocol
        + struct.pack(">H", len(session_id))
        + session_id
    )


def _aad_tail(sender: int, receiver: int, round_: int, stage: str | Enum) -> bytes:
    label = stage_label(stage).encode()
    return struct.pack(">QQQH", sender, receiver, check_party("round", round_), len(label)) + label


@dataclass(frozen=True)
class Envelope:
    """A sealed message as the server sees it: routing header, nonce and ciphertext."""

    sender: int
    receiver: int
    round: int
    stage: str
    nonce: bytes
    ciphertext: bytes

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: header (3 x 8-byte ids, 2-byte stage length, stage), nonce,
        ciphertext including the 16-byte tag."""
        return 26 + len(self.stage.encode()) + len(self.nonce) + len(self.ciphertext)


@dataclass
class Transcript:
    """Counts of messages and bytes per (sender, receiver, stage)."""

    counts: dict[tuple[int, int, str], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0])
    )

    def record(
        self, sender: int, receiver: int, stage: str | Enum, nbytes: int, messages: int = 1
    ) -> None:
        """Count ``messages`` messages of ``nbytes`` bytes in all (``messages=0``: bytes that
        travel in a message already counted, such as a key's enrolment proof)."""
        entry = self.counts[(sender, receiver, stage_label(stage))]
        entry[0] += messages
        entry[1] += nbytes

    def messages(self, *, sender=None, receiver=None, stage=None) -> int:
        """Number of messages matching the given filters (None matches all)."""
        return sum(entry[0] for key, entry in self._matching(sender, receiver, stage))

    def nbytes(self, *, sender=None, receiver=None, stage=None) -> int:
        """Bytes of the messages matching the given filters (None matches all)."""
        return sum(entry[1] for key, entry in self._matching(sender, receiver, stage))

    def rows(self) -> list[dict]:
        """One JSON-ready row per (sender, receiver, stage)."""
        return [
            {"sender": s, "receiver": r, "stage": st, "messages": m, "bytes": b}
            for (s, r, st), (m, b) in sorted(self.counts.items())
        ]

    def _matching(self, sender, receiver, stage):
        label = None if stage is None else stage_label(stage)
        for key, entry in self.counts.items():
            if sender is not None and key[0] != sender:
                continue
            if receiver is not None and key[1] != receiver:
                continue
            if label is not None and key[2] != label:
                continue
            yield key, entry


class Endpoint:
    """One party: an X25519 key pair (from the OS CSPRNG) and its directional channel keys."""

    def __init__(
        self,
        party_id: int,
        session_id: bytes,
        protocol: bytes = b"fedsim",
        private_key: bytes | None = None,
    ) -> None:
        """``protocol`` names the protocol the channel serves (bound into every AAD);
        ``private_key``: 32 bytes of the party's own secret randomness for the X25519 key pair
        (reproducible simulation; the key is loaded when first used, so an endpoint that only
        restores receive keys never loads it), the party's loaded X25519 key, or None for a
        key from the OS CSPRNG."""
        self.party_id = check_party("party_id", party_id)
        if not isinstance(session_id, bytes) or len(session_id) < 16:
            raise ValueError(
                f"session_id must be at least 16 bytes (e.g. os.urandom(32)), got {session_id!r}"
            )
        if not isinstance(protocol, bytes) or not 0 < len(protocol) < 2**16:
            raise ValueError(f"protocol must be a non-empty label in bytes, got {protocol!r}")
        self.session_id = session_id
        self.protocol = protocol
        self._aad = _aad_prefix(protocol, session_id)
        self._info = PROTOCOL_LABEL + struct.pack(">H", len(protocol)) + protocol
        self._private_bytes: bytes | None = None
        self._loaded_key: X25519PrivateKey | None = None
        if private_key is None:
            self._loaded_key = X25519PrivateKey.generate()
        elif isinstance(private_key, X25519PrivateKey):
            self._loaded_key = private_key
        elif isinstance(private_key, bytes) and len(private_key) == 32:
            self._private_bytes = private_key
        else:
            raise ValueError(
                "private_key must be None, an X25519PrivateKey or 32 bytes of the party's secret"
            )
        self._public_key: bytes | None = None  # computed when first used (not to receive only)
        self._send: dict[int, tuple[bytes, ChaCha20Poly1305]] = {}
        self._receive: dict[int, tuple[bytes, ChaCha20Poly1305]] = {}
        self._receive_keys: dict[int, bytes] = {}
        # per directional key (its peer public key): counters and opened counters, never reset
        self._counters: dict[tuple[int, bytes], int] = {}
        self._seen: dict[tuple[int, bytes], set[int]] = defaultdict(set)

    @property
    def _private_key(self) -> X25519PrivateKey:
        """The X25519 key, loaded from the party's 32 bytes on first use."""
        if self._loaded_key is None:
            self._loaded_key = X25519PrivateKey.from_private_bytes(self._private_bytes)
        return self._loaded_key

    @property
    def public_key(self) -> bytes:
        """This party's X25519 public key (32 raw bytes)."""
        if self._public_key is None:
            self._public_key = self._private_key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        return self._public_key

    def connect(self, peer_id: int, peer_public_key: bytes) -> None:
        """Derive the send key (self -> peer) and receive key (peer -> self).

        Connecting again with a different public key switches to new directional keys (messages
        under the old one no longer authenticate); switching back to an earlier key resumes
        that key's nonce counter and record of opened messages, so no nonce repeats. A
        malformed, all-zero or low-order key raises :class:`ChannelError` naming the peer."""
        peer_id = check_party("peer_id", peer_id)
        if peer_id == self.party_id:
            raise ValueError(f"peer_id={peer_id} is this endpoint's own id")
        try:
            shared = self._private_key.exchange(_load_public_key(peer_public_key))
        except ValueError as err:
            raise ChannelError(
                f"party {peer_id}'s public key is unusable (malformed, all-zero or low-order "
                f"X25519 point): {err}"
            ) from None
        send = self._directional_key(
            shared, self.party_id, self.public_key, peer_id, peer_public_key
        )
        receive = self._directional_key(
            shared, peer_id, peer_public_key, self.party_id, self.public_key
        )
        self._send[peer_id] = (peer_public_key, ChaCha20Poly1305(send))
        self._receive[peer_id] = (peer_public_key, ChaCha20Poly1305(receive))
        self._receive_keys[peer_id] = receive
        self._counters.setdefault((peer_id, peer_public_key), 0)

    def receive_key(self, peer_id: int) -> bytes:
        """The 32-byte receive key (peer -> self) :meth:`connect` derived: a secret of this
        party, for its own sealed state only (:meth:`accept_receive_key` restores it)."""
        if peer_id not in self._receive_keys:
            raise ValueError(f"peer_id={peer_id} has no receive key at party {self.party_id}")
        return self._receive_keys[peer_id]

    def accept_receive_key(self, peer_id: int, peer_public_key: bytes, key: bytes) -> None:
        """Restore the channel from ``peer_id`` (whose public key is ``peer_public_key``) with
        the receive key :meth:`receive_key` gave for it, read back from this party's own sealed
        state: :meth:`open` then works as after :meth:`connect`, without the X25519 agreement.
        Nothing can be sealed to the peer (no send key, so no nonce counter to restore); a
        seen-counter record starts empty, as for any new endpoint."""
        peer_id = check_party("peer_id", peer_id)
        if peer_id == self.party_id:
            raise ValueError(f"peer_id={peer_id} is this endpoint's own id")
        if not isinstance(peer_public_key, bytes) or len(peer_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"peer_public_key must be {PUBLIC_KEY_BYTES} bytes")
        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("a receive key is 32 bytes")
        self._receive[peer_id] = (peer_public_key, ChaCha20Poly1305(key))
        self._receive_keys[peer_id] = key

    def _directional_key(
        self, shared: bytes, sender: int, sender_key: bytes, receiver: int, receiver_key: bytes
    ) -> bytes:
        info = (
            self._info
            + struct.pack(">QQ", sender, receiver)
            + sender_key
            + receiver_key
        )
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=self.session_id, info=info).derive(
            shared
        )

    @property
    def peers(self) -> list[int]:
        return sorted(self._send)

    @property
    def senders(self) -> list[int]:
        """The peers whose envelopes this endpoint can open."""
        return sorted(self._receive)

    def seal(self, receiver: int, round_: int, stage: str | Enum, plaintext: bytes) -> Envelope:
        """Encrypt ``plaintext`` for ``receiver``, bound to (self, receiver, round, stage)."""
        receiver = check_party("receiver", receiver)
        if receiver not in self._send:
            raise ValueError(
                f"receiver={receiver} is not connected to party {self.party_id}; "
                f"connected: {self.peers}"
            )
        peer_key, cipher = self._send[receiver]
        counter = self._counters[(receiver, peer_key)]
        if counter >= _MAX_COUNTER:
            raise RuntimeError(f"nonce counter for receiver={receiver} exhausted; rekey")
        self._counters[(receiver, peer_key)] = counter + 1
        nonce = bytes(4) + counter.to_bytes(8, "big")
        label = stage_label(stage)
        aad = self._aad + _aad_tail(self.party_id, receiver, round_, label)
        ciphertext = cipher.encrypt(nonce, bytes(plaintext), aad)
        return Envelope(self.party_id, receiver, int(round_), label, nonce, ciphertext)

    def open(
        self, envelope: Envelope, *, round_: int, stage: str | Enum, sender: int | None = None
    ) -> bytes:
        """Decrypt an envelope addressed to this party for the ``round_`` and ``stage`` the
        receiver expects (and from ``sender`` when given); raise :class:`ChannelError` if it
        was tampered with, bound to another protocol/session/round/stage/receiver, comes from
        an unexpected sender, or was already opened (:class:`ReplayError`)."""
        if not isinstance(envelope, Envelope):
            raise ChannelError(f"envelope must be an Envelope, got {type(envelope).__name__}")
        if not _well_formed(envelope):
            raise ChannelError(
                "malformed envelope: ids and round must be integers, the stage a string, "
                "nonce and ciphertext bytes"
            )
        label = stage_label(stage)
        if envelope.receiver != self.party_id:
            raise ChannelError(
                f"envelope addressed to party {envelope.receiver} was delivered to party "
                f"{self.party_id}"
            )
        if sender is not None and envelope.sender != sender:
            raise ChannelError(
                f"envelope from sender={envelope.sender} where party {self.party_id} expects "
                f"sender={sender}"
            )
        if envelope.round != round_ or envelope.stage != label:
            raise ChannelError(
                f"envelope from sender={envelope.sender} is for round {envelope.round}, stage "
                f"{envelope.stage}; party {self.party_id} expects round {round_}, stage {label}"
            )
        entry = self._receive.get(envelope.sender)
        if entry is None:
            raise ChannelError(f"no channel from sender={envelope.sender} to party {self.party_id}")
        peer_key, cipher = entry
        if len(envelope.nonce) != NONCE_BYTES or envelope.nonce[:4] != bytes(4):
            raise ChannelError(f"malformed nonce in the envelope from sender={envelope.sender}")
        aad = self._aad + _aad_tail(envelope.sender, self.party_id, round_, label)
        try:
            plaintext = cipher.decrypt(envelope.nonce, envelope.ciphertext, aad)
        except InvalidTag:
            raise ChannelError(
                f"authentication failed for the message from sender={envelope.sender} to "
                f"party {self.party_id} (round {round_}, stage {label}): wrong key, tampered "
                "ciphertext, or bound to another protocol/session/round/stage/receiver"
            ) from None
        # authentic; now refuse an exact replay of a message already opened
        counter = int.from_bytes(envelope.nonce[4:], "big")
        seen = self._seen[(envelope.sender, peer_key)]
        if counter in seen:
            raise ReplayError(
                f"message {counter} from sender={envelope.sender} (round {round_}, "
                f"stage {label}) was already opened"
            )
        seen.add(counter)
        return plaintext

    def seal_array(self, receiver: int, round_: int, stage: str | Enum, array) -> Envelope:
        """Seal a numpy array (numeric dtypes only; no pickle)."""
        return self.seal(receiver, round_, stage, encode_array(array))

    def open_array(
        self,
        envelope: Envelope,
        *,
        round_: int,
        stage: str | Enum,
        sender: int | None = None,
        decode=None,
    ) -> np.ndarray:
        """:meth:`open` and decode a numeric array (``decode``: a faster decoder of the same
        bytes, default :func:`decode_array`); a malformed payload is a :class:`ChannelError`."""
        payload = self.open(envelope, round_=round_, stage=stage, sender=sender)
        try:
            return (decode_array if decode is None else decode)(payload)
        except (ValueError, OSError, EOFError) as err:
            raise ChannelError(
                f"the payload from sender={envelope.sender} is not a numeric array: {err}"
            ) from None


def _well_formed(envelope: Envelope) -> bool:
    """Whether an envelope's fields have the types a sealed one has (whatever their values)."""
    return (
        _is_id(envelope.sender)
        and _is_id(envelope.receiver)
        and _is_id(envelope.round)
        and isinstance(envelope.stage, str)
        and isinstance(envelope.nonce, bytes)
        and isinstance(envelope.ciphertext, bytes)
    )


def _is_id(value: object) -> bool:
    return type(value) is int or (isinstance(value, _INTEGERS) and not isinstance(value, bool))


def encode_array(array) -> bytes:
    """A numeric numpy array as .npy bytes (no pickled objects)."""
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"array must have a numeric dtype, got {array.dtype}")
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def decode_array(payload: bytes) -> np.ndarray:
    """The numeric array in .npy bytes (format 1.0 or 2.0, as :func:`encode_array` writes),
    or ``ValueError``: a malformed header, a dtype other than bool/int/uint/float, or a data
    length that disagrees with the header (checked before anything is allocated, so a header
    promising a huge array costs nothing)."""
    if not isinstance(payload, bytes):
        raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
    stream = io.BytesIO(payload)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, TypeError, SyntaxError, RecursionError, KeyError) as err:
        raise ValueError(f"not a .npy array: {err}") from None
    if dtype.kind not in "biuf" or dtype.hasobject:
        raise ValueError(f"array dtype {dtype} is not numeric")
    if any(size < 0 for size in shape):
        raise ValueError(f"array shape {shape} has a negative size")
    count, offset = math.prod(shape), stream.tell()
    if count * dtype.itemsize != len(payload) - offset:
        raise ValueError(
            f"array header promises {count} x {dtype.itemsize} bytes, the payload carries "
            f"{len(payload) - offset}"
        )
    flat = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C").copy()


def _load_public_key(public_key: bytes) -> X25519PublicKey:
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise ChannelError(
            f"peer_public_key must be {PUBLIC_KEY_BYTES} raw bytes, got {public_key!r}"
        )
    return X25519PublicKey.from_public_bytes(public_key)


class Relay:
    """The server: forwards envelopes to mailboxes and counts their bytes; never decrypts.

    It also relays public keys (``publish`` / ``public_keys``), which parties use to connect.
    """

    def __init__(self, transcript: Transcript | None = None) -> None:
        self.transcript = transcript if transcript is not None else Transcript()
        self._mailboxes: dict[int, list[Envelope]] = defaultdict(list)
        self._public_keys: dict[int, bytes] = {}

    def publish(self, party_id: int, public_key: bytes, stage: str | Enum = "keys") -> None:
        """A party announces its public key (counted as a message to the server, id 2^63-1)."""
        _load_public_key(public_key)
        self._public_keys[check_party("party_id", party_id)] = public_key
        self.transcript.record(party_id, SERVER_ID, stage, len(public_key) + 8)

    def public_keys(self) -> dict[int, bytes]:
        return dict(self._public_keys)

    def post(self, envelope: Envelope) -> None:
        if not isinstance(envelope, Envelope):
            raise ValueError(
                f"the relay only forwards Envelope objects, got {type(envelope).__name__}"
            )
        self.transcript.record(envelope.sender, envelope.receiver, envelope.stage, envelope.nbytes)
        self._mailboxes[envelope.receiver].append(envelope)

    def deliver(self, receiver: int) -> list[Envelope]:
        """Hand ``receiver`` everything queued for it, in arrival order."""
        return self._mailboxes.pop(receiver, [])

    def pending(self) -> list[Envelope]:
        """Every queued envelope (what the server holds at this moment)."""
        return [envelope for box in self._mailboxes.values() for envelope in box]


def new_session_id() -> bytes:
    """A fresh 32-byte session id from the OS CSPRNG (the HKDF salt of a run)."""
    return os.urandom(32)


def connect_all(endpoints: list[Endpoint], relay: Relay) -> None:
    """Every endpoint publishes its key through the relay and connects to every other."""
    for endpoint in endpoints:
        relay.publish(endpoint.party_id, endpoint.public_key)
    keys = relay.public_keys()
    for endpoint in endpoints:
        for peer_id, key in keys.items():
            if peer_id != endpoint.party_id:
                endpoint.connect(peer_id, key)


