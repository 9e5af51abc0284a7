"""The population of virtual clients: node ids, partition ids and node configs.

A federation of ``N`` registered clients is described by ``N`` alone: client
(partition) ``k`` has Flower node id ``NODE_ID_OFFSET + k``. Nothing is stored
per client, so registering 10^6 clients costs nothing and every lookup is O(1).
Node ids start at 2^32 so they never collide with the SuperLink's node id (1)
or the ServerApp context's node id (0).

**Enrolment.** Registering a party also binds its keys (:mod:`protocols.channels`,
"Authenticated keys"): the registry's :class:`Enrolment` authority certifies each party's
Ed25519 identity, made from that party's own secret (``secret.seed_bytes("enrolment",
"identity")``). The authority's signing key is derived from the run's root on the party side
(where the root is read: the engine's workers and committee hosts), never held by the server
that relays keys; each client gets the authority's public key and its own certificate in its
``node_config`` (:data:`AUTHORITY_KEY`, :data:`CERTIFICATE_KEY`) and checks every relayed key
against it before it seals. Nothing is stored per client: certificates are issued when a
party is first used.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsim.config import require
from fedsim.randomness import PartySecret, RunSecret, Stream, public_generator
from protocols.enrolment import Certificate, EnrolmentAuthority, Identity, KeyVerifier

PARTITION_ID_KEY = "partition-id"
NUM_PARTITIONS_KEY = "num-partitions"
"""Flower's node_config keys (``flwr.common.constant``), spelled here so that enrolment needs
no Flower import."""
NODE_ID_OFFSET = 1 << 32
AUTHORITY_KEY = "fedsim.enrolment-authority"
"""``node_config`` key of the enrolment authority's Ed25519 public key (hex): the party's pin."""
CERTIFICATE_KEY = "fedsim.enrolment-certificate"
"""``node_config`` key of the party's own certificate (hex of :class:`Certificate` bytes)."""
AUTHORITY_SEAT = -1
"""The root derives the authority's secret as ``RunSecret.member(AUTHORITY_SEAT)`` (no committee
member has a negative seat), then ``seed_bytes("enrolment-authority")``."""


@dataclass(frozen=True, slots=True)
class ClientRegistry:
    """``num_clients`` virtual clients with node ids ``NODE_ID_OFFSET + k``."""

    num_clients: int

    def __post_init__(self) -> None:
        require(
            isinstance(self.num_clients, int) and self.num_clients >= 1,
            "num_clients",
            self.num_clients,
            "an integer >= 1",
        )

    def node_ids(self) -> range:
        """All node ids, as a ``range`` (O(1) memory, supports ``len`` and ``in``)."""
        return range(NODE_ID_OFFSET, NODE_ID_OFFSET + self.num_clients)

    def node_id(self, partition_id: int) -> int:
        """The node id of client ``partition_id``."""
        if not 0 <= partition_id < self.num_clients:
            raise ValueError(
                f"partition id {partition_id} is outside the population [0, {self.num_clients - 1}]"
            )
        return NODE_ID_OFFSET + int(partition_id)

    def node_ids_of(self, partition_ids: np.ndarray) -> list[int]:
        """Node ids of many partitions at once."""
        return (np.asarray(partition_ids, dtype=np.int64) + NODE_ID_OFFSET).tolist()

    def partition_id(self, node_id: int) -> int:
        """The partition (client index) behind ``node_id``; a clear error if unknown."""
        partition = node_id - NODE_ID_OFFSET
        if not 0 <= partition < self.num_clients:
            raise ValueError(
                f"message addressed to node id {node_id}, which is not a registered "
                f"client; node ids are {NODE_ID_OFFSET}..{NODE_ID_OFFSET + self.num_clients - 1}"
            )
        return partition

    def node_config(self, node_id: int) -> dict[str, int]:
        """The ``node_config`` Flower's simulation gives each node."""
        return {PARTITION_ID_KEY: self.partition_id(node_id), NUM_PARTITIONS_KEY: self.num_clients}


def client_name(partition_id: int) -> str:
    """The enrolled name of client ``partition_id`` (also its name as a DMM member)."""
    return f"client/{int(partition_id)}"


def public_committee(seed: int, round_: int, population: int, n: int) -> list[int]:
    """The committee drawn for server round ``round_``: ``n`` distinct clients of
    ``population``, seat order, from the public stream ``(seed, round_, Stream.COMMITTEE)``;
    anyone who knows the run's seed recomputes it (DMM clients and dealers do, before they
    seal)."""
    rng = public_generator(seed, round_, Stream.COMMITTEE)
    return [int(c) for c in rng.choice(int(population), size=int(n), replace=False)]


def public_names(seed: int, population: int, n: int, round_: int) -> list[str]:
    """The enrolled names (``client/c``), seat order, of :func:`public_committee`."""
    return [client_name(c) for c in public_committee(seed, round_, population, n)]


def member_name(member_id: int) -> str:
    """The enrolled name of committee member ``member_id`` (members that are not clients)."""
    return f"member/{int(member_id)}"


def identity_seed(secret: PartySecret) -> bytes:
    """The 32 bytes of ``secret`` that make its owner's Ed25519 identity key."""
    if not isinstance(secret, PartySecret):
        raise ValueError(f"secret is a {type(secret).__name__}; allowed: the party's PartySecret")
    return secret.seed_bytes("enrolment", "identity")


class Enrolment:
    """The registry's enrolment authority of one run (its key from the run's root): it
    certifies parties' identities; :meth:`node_entries` is what a client's ``node_config``
    carries. Held on the party side only, by whoever holds the root (a worker, a committee
    host), never in a module-level cache; never pickled."""

    _CACHE = 4096

    def __init__(self, secrets: RunSecret) -> None:
        if not isinstance(secrets, RunSecret):
            raise ValueError(f"secrets is a {type(secrets).__name__}; allowed: RunSecret")
        seed = secrets.member(AUTHORITY_SEAT).seed_bytes("enrolment-authority")
        self.authority = EnrolmentAuthority(seed)
        self.public_key = self.authority.public_key
        self._certificates: OrderedDict[str, Certificate] = OrderedDict()

    def __reduce__(self):
        raise TypeError("an Enrolment holds the authority's signing key: it is never pickled")

    def identity(self, name: str, secret: PartySecret) -> Identity:
        """Party ``name``'s identity, its key from its own ``secret``, certified here."""
        seed = identity_seed(secret)
        certificate = self._certificates.get(name)
        if certificate is None:
            certificate = self.authority.identity(name, seed).certificate
            self._certificates[name] = certificate
            if len(self._certificates) > self._CACHE:
                self._certificates.popitem(last=False)
        return Identity.from_seed(seed, certificate)

    def verifier(self) -> KeyVerifier:
        return KeyVerifier(self.public_key)

    def node_entries(self, partition_id: int, secret: PartySecret) -> dict[str, str]:
        """The ``node_config`` entries of client ``partition_id``: the authority's public key
        and the client's certificate (both public)."""
        identity = self.identity(client_name(partition_id), secret)
        return {
            AUTHORITY_KEY: self.public_key.hex(),
            CERTIFICATE_KEY: identity.certificate.to_bytes().hex(),
        }


_VERIFIERS: OrderedDict[bytes, KeyVerifier] = OrderedDict()


def _verifier(authority: bytes) -> KeyVerifier:
    """One :class:`KeyVerifier` per authority key in this process, so that the certificates
    it has checked are not checked again in later rounds (a few recent authorities kept)."""
    verifier = _VERIFIERS.get(authority)
    if verifier is None:
        verifier = _VERIFIERS[authority] = KeyVerifier(authority)
        if len(_VERIFIERS) > 8:
            _VERIFIERS.popitem(last=False)
    return verifier


@functools.lru_cache(maxsize=64)
def _certificate(encoded: str) -> Certificate:
    """The certificate in ``encoded`` (hex), kept by that text: a certificate is public and
    frozen (a malformed one raises, and is not kept)."""
    return Certificate.from_bytes(bytes.fromhex(encoded))


def _enrolment_error(authority: object, certificate: object, error: ValueError) -> ValueError:
    return ValueError(
        f"node_config {AUTHORITY_KEY} / {CERTIFICATE_KEY} = {authority!r} / "
        f"{certificate!r}; allowed: the authority's 32-byte key and this party's "
        f"certificate, in hex ({error})"
    )


def enrolled_name(node_config: Mapping[str, Any]) -> tuple[str, KeyVerifier] | None:
    """The party's enrolled name and key verifier from its ``node_config``, both public (None
    when the runtime enrolled it nowhere): what a party that signs nothing needs to check
    relayed keys. Unlike :func:`enrolled` it loads no signing key, so it does not check the
    certificate against the party's secret; :func:`enrolled` does, where the party signs."""
    authority, certificate = node_config.get(AUTHORITY_KEY), node_config.get(CERTIFICATE_KEY)
    if authority is None and certificate is None:
        return None
    try:
        verifier = _verifier(bytes.fromhex(str(authority)))
        return _certificate(str(certificate)).name, verifier
    except ValueError as error:
        raise _enrolment_error(authority, certificate, error) from None


def enrolled(
    node_config: Mapping[str, Any], secret: PartySecret
) -> tuple[Identity, KeyVerifier] | None:
    """The party's identity and key verifier from its ``node_config`` (None when the runtime
    enrolled it nowhere: then relayed keys cannot be checked, and are taken as relayed). A
    certificate that does not match the party's own secret is an error naming the key."""
    authority, certificate = node_config.get(AUTHORITY_KEY), node_config.get(CERTIFICATE_KEY)
    if authority is None and certificate is None:
        return None
    try:
        verifier = _verifier(bytes.fromhex(str(authority)))
        identity = Identity.from_seed(identity_seed(secret), _certificate(str(certificate)))
    except ValueError as error:
        raise _enrolment_error(authority, certificate, error) from None
    return identity, verifier
