"""Public keys bound at enrolment, for the channels of :mod:`protocols.channels`.

The server that relays public keys could hand a party its own keys in
place of its peers' and open what is sealed to them. Keys are therefore bound at enrolment
(Bonawitz et al., CCS 2017, Sec. 6, "active adversary": keys signed under a PKI): an
:class:`EnrolmentAuthority` (an Ed25519 key, RFC 8032, held where parties are registered, never by
the relay) issues each party a :class:`Certificate` binding its enrolled name to its long-term
Ed25519 identity key; a party signs every X25519 key it announces with that identity
(:meth:`Identity.prove`: a :func:`key_statement` over the label, protocol, session, channel id
and the keys); a receiver checks the proof against the authority's public key, which it holds
from enrolment, before it seals anything (:class:`KeyVerifier`). A substituted, unsigned,
re-used or misbound key raises :class:`KeySubstitution` naming the party.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocols.channels import PUBLIC_KEY_BYTES, KeySubstitution, check_party

CERTIFICATE_LABEL = b"fedsim/enrolment/certificate/v1"
KEY_LABEL = b"fedsim/enrolment/keys/v1"
SIGNATURE_BYTES = 64
NO_PARTY = 2**64 - 1
"""The channel id a key statement binds when the id is assigned only later (SecAgg+)."""
_KNOWN_CERTIFICATES = 1 << 16
"""Verified certificates, and verified signatures, a :class:`KeyVerifier` remembers (then it
starts afresh)."""


def _raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _signing_key(seed: bytes, what: str) -> Ed25519PrivateKey:
    if not isinstance(seed, bytes) or len(seed) != 32:
        raise ValueError(f"{what} must be 32 bytes of its owner's secret")
    return Ed25519PrivateKey.from_private_bytes(seed)


def _name_bytes(name: str) -> bytes:
    if not isinstance(name, str) or not 0 < len(name.encode()) < 2**16:
        raise ValueError(f"an enrolled name must be a non-empty str, got {name!r}")
    return struct.pack(">H", len(name.encode())) + name.encode()


def key_statement(
    protocol: bytes, session_id: bytes, party_id: int | None, keys: tuple[bytes, ...]
) -> bytes:
    """What an identity signs for the X25519 ``keys`` it announces: the label, the protocol,
    the session, the channel id (``None``: assigned later, :data:`NO_PARTY`) and the keys."""
    party = NO_PARTY if party_id is None else check_party("party_id", party_id)
    if not keys or any(not isinstance(k, bytes) or len(k) != PUBLIC_KEY_BYTES for k in keys):
        raise ValueError(f"keys must be {PUBLIC_KEY_BYTES}-byte public keys")
    return (
        KEY_LABEL
        + struct.pack(">H", len(protocol))
        + protocol
        + struct.pack(">H", len(session_id))
        + session_id
        + struct.pack(">QH", party, len(keys))
        + b"".join(keys)
    )


@dataclass(frozen=True)
class Certificate:
    """The enrolment authority's signature binding ``name`` to the Ed25519 ``identity`` key."""

    name: str
    identity: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        return _name_bytes(self.name) + self.identity + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        """The certificate :meth:`to_bytes` wrote; :class:`KeySubstitution` if malformed."""
        if not isinstance(data, bytes) or len(data) < 2:
            raise KeySubstitution("a certificate must be bytes")
        size = int.from_bytes(data[:2], "big")
        if len(data) != 2 + size + PUBLIC_KEY_BYTES + SIGNATURE_BYTES:
            raise KeySubstitution(f"a certificate of {len(data)} bytes is malformed")
        try:
            name = data[2 : 2 + size].decode()
        except UnicodeDecodeError:
            raise KeySubstitution("a certificate's name is not UTF-8") from None
        rest = data[2 + size :]
        return cls(name, rest[:PUBLIC_KEY_BYTES], rest[PUBLIC_KEY_BYTES:])


class EnrolmentAuthority:
    """Enrols parties: signs (name, identity key) certificates with its Ed25519 key, made from
    32 bytes of the authority's own secret. It lives with the registry, never with the relay;
    parties hold only :attr:`public_key`."""

    def __init__(self, secret: bytes) -> None:
        self._key = _signing_key(secret, "the enrolment authority's secret")
        self.public_key = _raw(self._key)

    def __reduce__(self):
        raise TypeError("an EnrolmentAuthority holds its signing key: it is never pickled")

    def enrol(self, name: str, identity: bytes) -> Certificate:
        """The certificate of party ``name`` with Ed25519 public key ``identity``."""
        if not isinstance(identity, bytes) or len(identity) != PUBLIC_KEY_BYTES:
            raise ValueError(f"identity must be a {PUBLIC_KEY_BYTES}-byte Ed25519 public key")
        body = CERTIFICATE_LABEL + _name_bytes(name) + identity
        return Certificate(name, identity, self._key.sign(body))

    def identity(self, name: str, seed: bytes) -> Identity:
        """Enrol party ``name`` whose identity key is made from its own 32-byte ``seed``."""
        key = _signing_key(seed, "an identity seed")
        return Identity(key, self.enrol(name, _raw(key)))


class Identity:
    """A party's enrolled identity: its Ed25519 key and certificate. :meth:`prove` signs the
    X25519 keys it announces."""

    def __init__(self, key: Ed25519PrivateKey, certificate: Certificate) -> None:
        if _raw(key) != certificate.identity:
            raise ValueError(f"the certificate of {certificate.name!r} is for another key")
        self._key = key
        self.certificate = certificate
        self._encoded = certificate.to_bytes()

    @classmethod
    def from_seed(cls, seed: bytes, certificate: Certificate) -> Identity:
        return cls(_signing_key(seed, "an identity seed"), certificate)

    def __reduce__(self):
        raise TypeError("an Identity holds its signing key: it is never pickled")

    @property
    def name(self) -> str:
        return self.certificate.name

    def prove(
        self, protocol: bytes, session_id: bytes, party_id: int | None, keys: tuple[bytes, ...]
    ) -> bytes:
        """The proof relayed with ``keys``: certificate, then the signature of
        :func:`key_statement`."""
        statement = key_statement(protocol, session_id, party_id, tuple(keys))
        return self._encoded + self._key.sign(statement)


class KeyVerifier:
    """Checks relayed keys against the enrolment authority's public key (held by the party
    from enrolment, never taken from the relay). Verified certificates are remembered, and so
    are verified key signatures: Ed25519 verification is a function of the public key, the
    statement and the signature alone, so a triple that verified once verifies again, and
    the parties of one process that check the same relayed keys (the neighbours of a client
    on one worker) check them once. Triples are remembered by their SHA-256."""

    def __init__(self, authority: bytes) -> None:
        if not isinstance(authority, bytes) or len(authority) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"the enrolment authority's key must be {PUBLIC_KEY_BYTES} bytes, got "
                f"{authority!r}"
            )
        self.authority = authority
        self._authority = Ed25519PublicKey.from_public_bytes(authority)
        self._known: dict[bytes, tuple[str, Ed25519PublicKey]] = {}
        self._verified: set[bytes] = set()

    def check(
        self,
        proof: object,
        *,
        protocol: bytes,
        session_id: bytes,
        party_id: int | None,
        keys: tuple[bytes, ...],
        who: str,
        name: str | None = None,
    ) -> str:
        """The enrolled name behind ``keys``, or :class:`KeySubstitution` naming ``who``: no
        proof, a malformed one, a certificate the authority did not sign, another name than
        ``name`` (when given), or a signature that does not cover exactly these keys for this
        protocol, session and channel id."""
        if not isinstance(proof, bytes) or len(proof) <= SIGNATURE_BYTES:
            raise KeySubstitution(f"{who}'s public key carries no enrolment proof")
        encoded, signature = proof[:-SIGNATURE_BYTES], proof[-SIGNATURE_BYTES:]
        known = self._known.get(encoded)
        if known is None:
            certificate = Certificate.from_bytes(encoded)
            body = CERTIFICATE_LABEL + _name_bytes(certificate.name) + certificate.identity
            try:
                self._authority.verify(certificate.signature, body)
                identity = Ed25519PublicKey.from_public_bytes(certificate.identity)
            except (InvalidSignature, ValueError):
                raise KeySubstitution(
                    f"{who}'s key proof names {certificate.name!r} under a certificate the "
                    "enrolment authority did not sign"
                ) from None
            if len(self._known) >= _KNOWN_CERTIFICATES:
                self._known.clear()
            known = self._known[encoded] = (certificate.name, identity)
        enrolled, identity = known
        if name is not None and enrolled != name:
            raise KeySubstitution(f"{who}'s key is signed by {enrolled!r}, not {name!r}")
        try:
            statement = key_statement(protocol, session_id, party_id, tuple(keys))
        except (ValueError, TypeError):
            raise KeySubstitution(f"{who}'s public keys are malformed") from None
        triple = hashlib.sha256()
        for part in (encoded, signature, statement):
            triple.update(len(part).to_bytes(8, "big") + part)
        if triple.digest() in self._verified:
            return enrolled
        try:
            identity.verify(signature, statement)
        except InvalidSignature:
            raise KeySubstitution(
                f"{who}'s public key is not the one {enrolled!r} signed for this protocol, "
                "session and channel (substituted by the relay)"
            ) from None
        if len(self._verified) >= _KNOWN_CERTIFICATES:
            self._verified.clear()
        self._verified.add(triple.digest())
        return enrolled

    def check_all(self, entries, *, protocol: bytes, session_id: bytes, own: str | None = None):
        """:meth:`check` every ``(who, party_id, keys, proof, name)`` entry and require
        distinct enrolled names, none of them ``own``; returns the names in order."""
        names: list[str] = []
        for who, party_id, keys, proof, name in entries:
            enrolled = self.check(
                proof,
                protocol=protocol,
                session_id=session_id,
                party_id=party_id,
                keys=keys,
                who=who,
                name=name,
            )
            if enrolled == own or enrolled in names:
                raise KeySubstitution(
                    f"{who}'s key is signed by {enrolled!r}, who already stands for another "
                    "party of this round"
                )
            names.append(enrolled)
        return names
