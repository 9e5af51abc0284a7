"""The server's side of SecAgg+ (Bell et al., CCS 2020) and an in-process round; the protocol
itself is described in :mod:`protocols.secagg`.

**Hostile messages.** Every handler checks its stage transition (:class:`StageError`) and each
client's message on its own -- types, lengths, field ranges, key validity (an unusable X25519
key is a :class:`~protocols.channels.ChannelError` in ``connect``), keys repeated across
clients, membership, neighbourhood, the round and stage an envelope claims, the size of a sealed
share -- and a bad message drops that client for the rest of the round, named with the stage and
reason in :attr:`SecAggServer.rejected`; the round goes on with the rest. A rejected masked input
counts as a dropout (its pairwise masks are removed); shares that a degree check names as wrong
reject their sender and the others are used. When fewer clients remain than the round needs, or
shares of a secret disagree and the wrong ones cannot be named (exactly ``threshold`` shares
cannot be checked, except that a rebuilt agreement key must match its public key), the server
moves to ABORTED and raises :class:`RoundAborted` (:class:`TooManyDropoutsError` when too few
answered): nothing is released. Keys, seeds and shares of the clients never reach the server in
the clear. Public keys relayed by the server are bound at enrolment: the server relays each
client's proof with its keys (:meth:`SecAggServer.advertise_keys`, :meth:`SecAggServer.proofs_for`)
and enrolled clients check them before they share (:mod:`protocols.secagg.client`); clients
enrolled nowhere take the keys as relayed.

**Opened is released.** A round that aborts in UNMASK may abort after the server already holds
enough to determine the sum: ``threshold`` shares of every survivor's self-mask seed and of
every mask key it must remove. Shares that disagree only hide which subset is right, and the
server can try every subset (a rebuilt agreement key must match its public key, an unmasked sum
must fit the encoding). :attr:`SecAggServer.opened` says so, set as UNMASK's responses arrive,
so that the caller accounts the sum of the survivors' inputs whatever the round is then called.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocols.channels import NONCE_BYTES, SERVER_ID, Envelope, Relay, Transcript, new_session_id
from protocols.enrolment import Identity, KeyVerifier
from protocols.kit import RoundAborted, TooManyDropoutsError
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    SHARE_CIPHERTEXT_BYTES,
    RingZ2k,
    SecAggConfig,
    Stage,
    UnmaskResponse,
    check_transition,
    elements_to_secret,
    integer_vector,
    key_problem,
    neighbour_graph,
    pairwise_seed,
    prg,
    raw_public_key,
    shamir_scheme,
    sum_vectors,
)


@dataclass
class ServerView:
    """Everything the server received or derived, for audits and tests."""

    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    proofs: dict[int, bytes] = field(default_factory=dict)
    masked_inputs: dict[int, np.ndarray] = field(default_factory=dict)
    responses: dict[int, UnmaskResponse] = field(default_factory=dict)
    recovered_self_masks: dict[int, bytes] = field(default_factory=dict)
    recovered_secret_keys: dict[int, bytes] = field(default_factory=dict)


class _Culprits(Exception):
    """Responders whose shares a degree check singled out as wrong."""

    def __init__(self, responders: tuple[int, ...]) -> None:
        super().__init__(responders)
        self.responders = responders


def _client_key(client: object) -> Any:
    """A client id as the int it is, or its repr when it is no id at all (for ``rejected``)."""
    if isinstance(client, int | np.integer) and not isinstance(client, bool):
        return int(client)
    return repr(client)


def _items(messages: Mapping[Any, Any], what: str) -> list[tuple[Any, Any]]:
    if not isinstance(messages, Mapping):
        raise TypeError(f"{what} must map client ids to their messages")
    return list(messages.items())


class SecAggServer:
    """The server's side of SecAgg+: relays, bookkeeping, checks, and the final unmasking.

    ``session_id`` is the public per-round salt (HKDF) shared with the clients; the neighbour
    graph is drawn from ``graph_rng``. :attr:`rejected` names every client dropped for a bad
    message, with the stage and the reason.
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
        if any(not 0 <= i < SERVER_ID for i in self.client_ids):
            raise ValueError("client_ids must be protocol ids in [0, 2^63 - 1)")
        self.graph = neighbour_graph(self.client_ids, config.degree, graph_rng)
        self.relay = relay if relay is not None else Relay()
        self.view = ServerView()
        self.stage = Stage.SETUP
        self.rejected: dict[Any, str] = {}
        self.advertised: tuple[int, ...] = ()
        self.excluded: tuple[int, ...] = ()
        self.shared: tuple[int, ...] = ()
        self.survivors: tuple[int, ...] = ()
        self.dropped: tuple[int, ...] = ()
        self._alive: frozenset[int] = frozenset()  # survivors, for membership tests
        self._gone: frozenset[int] = frozenset()  # dropped, for membership tests
        #: the unmasking shares held determine the survivors' sum (released, even on abort)
        self.opened = False
        self._recipients: dict[int, tuple[int, ...]] = {}

    @property
    def transcript(self) -> Transcript:
        return self.relay.transcript

    def _enter(self, target: Stage) -> None:
        check_transition(self.stage, target, "server")
        self.stage = target

    def _abort(self, error: RoundAborted) -> RoundAborted:
        """Move to ABORTED and return ``error`` for the caller to raise."""
        self._enter(Stage.ABORTED)
        return error

    def reject(self, client: object, stage: Stage, reason: str) -> None:
        """Drop ``client`` for the rest of the round for a bad message (first reason kept)."""
        self.rejected.setdefault(_client_key(client), f"{stage.name}: {reason}")

    def _require(self, count: int, stage: Stage, what: str) -> None:
        if count < self.config.survivors_needed:
            raise self._abort(
                TooManyDropoutsError(
                    f"round {self.config.round} aborted in {stage.name}: {what} {count} "
                    f"clients, at least {self.config.survivors_needed} needed"
                )
            )

    def _member(self, client: object) -> int | None:
        key = _client_key(client)
        if isinstance(key, int) and key in self.graph and key not in self.rejected:
            return key
        return None

    def advertise_keys(
        self,
        public_keys: Mapping[int, tuple[bytes, bytes]],
        proofs: Mapping[int, bytes] | None = None,
    ) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """ADVERTISE_KEYS: collect public keys (and the enrolment ``proofs`` that came with
        them, relayed as given: :meth:`proofs_for`); return, per live client, its live
        neighbours' keys. A client whose keys are malformed, unusable or repeat another
        client's is rejected; clients left with fewer than ``threshold`` live neighbours are
        excluded."""
        self._enter(Stage.ADVERTISE_KEYS)
        self.view.proofs = {
            int(c): p for c, p in (proofs or {}).items() if isinstance(p, bytes)
        }
        holders: dict[bytes, set[int]] = {}
        for client, keys in _items(public_keys, "public_keys"):
            problem = self._keys_problem(client, keys)
            if problem is not None:
                self.reject(client, Stage.ADVERTISE_KEYS, problem)
                continue
            self.view.public_keys[int(client)] = (keys[0], keys[1])
            for key in keys:
                holders.setdefault(key, set()).add(int(client))
            proof = len(self.view.proofs.get(int(client), b""))  # travels with the keys
            self.transcript.record(int(client), SERVER_ID, Stage.ADVERTISE_KEYS, 64 + 8 + proof)
        for clients in holders.values():
            if len(clients) > 1:
                for client in clients:
                    self.view.public_keys.pop(client, None)
                    others = sorted(clients - {client})
                    self.reject(client, Stage.ADVERTISE_KEYS, f"a key repeats client {others}'s")
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
            proofs = sum(len(self.view.proofs.get(j, b"")) for j in neighbours)
            self.transcript.record(
                SERVER_ID, client, Stage.ADVERTISE_KEYS, 72 * len(neighbours) + proofs
            )
        return routed

    def proofs_for(self, client: int) -> dict[int, bytes]:
        """The proofs of ``client``'s neighbours' keys (those that came with one)."""
        proofs = self.view.proofs
        return {j: proofs[j] for j in self._recipients.get(client, ()) if j in proofs}

    def _keys_problem(self, client: object, keys: object) -> str | None:
        if self._member(client) is None:
            return f"client {client!r} is not a member of this round"
        if int(client) in self.view.public_keys:
            return "a second set of public keys"
        if not isinstance(keys, tuple | list) or len(keys) != 2:
            return "public keys must be a (channel, agreement) pair"
        for key in keys:
            problem = key_problem(key)
            if problem is not None:
                return problem
        return None

    def share_keys(self, envelopes: Mapping[int, list[Envelope]]) -> dict[int, list[Envelope]]:
        """SHARE_KEYS: relay the sealed share rows (one to each neighbour the client was given,
        bound to this round and stage, of the right size); returns each live client's incoming
        envelopes. A client told not to contribute answers with no envelopes."""
        self._enter(Stage.SHARE_KEYS)
        senders = []
        for sender, batch in _items(envelopes, "envelopes"):
            problem = self._batch_problem(sender, batch)
            if problem is not None:
                self.reject(sender, Stage.SHARE_KEYS, problem)
                continue
            if batch:
                senders.append(int(sender))
                for envelope in batch:
                    self.relay.post(envelope)
        self.shared = tuple(sorted(senders))
        self._require(len(self.shared), Stage.SHARE_KEYS, "shares arrived from")
        # excluded clients contribute nothing but hold their neighbours' shares
        delivered = {client: self.relay.deliver(client) for client in self.advertised}
        return {c: batch for c, batch in delivered.items() if c not in self.rejected}

    def _batch_problem(self, sender: object, batch: object) -> str | None:
        client = self._member(sender)
        if client is None or client not in self._recipients:
            return f"client {sender!r} did not advertise keys this round (or was rejected)"
        if isinstance(batch, bytes | str) or not isinstance(batch, list | tuple):
            return "shares must come as a list of envelopes"
        if client in self.excluded:
            return None if not batch else "told not to contribute, yet it sent shares"
        expected = list(self._recipients[client])
        receivers = [getattr(envelope, "receiver", None) for envelope in batch]
        ids = all(isinstance(r, int | np.integer) and not isinstance(r, bool) for r in receivers)
        if not ids or sorted(receivers) != expected:
            return f"must send one envelope to each of {expected}, got receivers {receivers}"
        for envelope in batch:
            if not isinstance(envelope, Envelope):
                return f"a share is a {type(envelope).__name__}, not an Envelope"
            if envelope.sender != client or envelope.round != self.config.round:
                return (
                    f"an envelope claims sender {envelope.sender!r}, round {envelope.round!r}; "
                    f"expected sender {client}, round {self.config.round}"
                )
            if envelope.stage != Stage.SHARE_KEYS.name:
                return f"an envelope is bound to stage {envelope.stage!r}, not SHARE_KEYS"
            if not isinstance(envelope.nonce, bytes) or len(envelope.nonce) != NONCE_BYTES:
                return f"a nonce must be {NONCE_BYTES} bytes"
            if (
                not isinstance(envelope.ciphertext, bytes)
                or len(envelope.ciphertext) != SHARE_CIPHERTEXT_BYTES
            ):
                return f"a sealed share must be {SHARE_CIPHERTEXT_BYTES} bytes"
        return None

    def masked_input(self, masked_inputs: Mapping[int, np.ndarray]) -> tuple[tuple, tuple]:
        """MASKED_INPUT: collect y_i from clients that shared (integer vectors of
        ``vector_length`` in the masking space); returns (survivors, dropped). A rejected input
        counts as a dropout: its client's pairwise masks are removed in UNMASK."""
        self._enter(Stage.MASKED_INPUT)
        space = self.config.masking
        for client, masked in _items(masked_inputs, "masked_inputs"):
            member = self._member(client)
            if member is None or member not in self.shared or member in self.view.masked_inputs:
                self.reject(client, Stage.MASKED_INPUT, "it shared no keys this round")
                continue
            try:
                masked = integer_vector(
                    masked, space, self.config.vector_length, f"the masked input of {member}"
                )
            except ValueError as error:
                self.reject(member, Stage.MASKED_INPUT, str(error))
                continue
            self.view.masked_inputs[member] = masked
            self.transcript.record(
                member, SERVER_ID, Stage.MASKED_INPUT, masked.size * space.bytes_per_element
            )
        self.survivors = tuple(sorted(self.view.masked_inputs))
        self.dropped = tuple(sorted(set(self.shared) - set(self.survivors)))
        self._alive, self._gone = frozenset(self.survivors), frozenset(self.dropped)
        self._require(len(self.survivors), Stage.MASKED_INPUT, "masked inputs arrived from")
        for client in self.survivors + self.excluded:
            self.transcript.record(
                SERVER_ID, client, Stage.MASKED_INPUT, 8 * (len(self.survivors) + len(self.dropped))
            )
        return self.survivors, self.dropped

    def unmask(self, responses: Mapping[int, UnmaskResponse]) -> np.ndarray:
        """UNMASK: reconstruct survivors' self-mask seeds and dropped clients' agreement keys
        from the neighbours' shares; return sum_{i in survivors} x_i (mod p). A response with
        a share it may not give (of a non-neighbour, of the wrong kind, misshapen) is rejected
        whole; shares a degree check names as wrong reject their sender and the rest are used."""
        self._enter(Stage.UNMASK)
        for responder, response in _items(responses, "responses"):
            problem = self._response_problem(responder, response)
            if problem is not None:
                self.reject(responder, Stage.UNMASK, problem)
                continue
            self.view.responses[int(responder)] = response
            self.transcript.record(int(responder), SERVER_ID, Stage.UNMASK, response.nbytes)
        self.opened = self._determined()
        while True:
            try:
                total = self._unmasked_sum()
            except _Culprits as found:
                for responder in found.responders:
                    self.view.responses.pop(responder, None)
                    self.reject(responder, Stage.UNMASK, "a share failed the degree check")
                continue
            self._enter(Stage.DONE)
            return total

    def _determined(self) -> bool:
        """Whether the responses held give ``threshold`` shares of every secret the sum needs:
        each survivor's self-mask seed and each dropped client's mask key that a survivor's
        input holds (right or wrong shares alike: the server may try every subset)."""
        needed = [(owner, "self_mask_shares") for owner in self.survivors]
        needed += [
            (owner, "secret_key_shares")
            for owner in self.dropped
            if not self._alive.isdisjoint(self._recipients[owner])
        ]
        held = {kind: Counter() for kind in ("self_mask_shares", "secret_key_shares")}
        for response in self.view.responses.values():  # one pass: who holds a share of whom
            for kind, counts in held.items():
                counts.update(getattr(response, kind).keys())
        for owner, kind in needed:
            scheme = shamir_scheme(self.config, len(self._recipients[owner]))
            if held[kind][owner] < scheme.threshold:
                return False
        return True

    def _response_problem(self, responder: object, response: object) -> str | None:
        client = self._member(responder)
        if client is None or (client not in self._alive and client not in self.excluded):
            return (
                f"client {responder!r} is neither a survivor nor a share holder that was "
                "excluded from contributing"
            )
        if client in self.view.responses:
            return "a second response"
        if not isinstance(response, UnmaskResponse):
            return f"the response is a {type(response).__name__}, not an UnmaskResponse"
        for kind, owners in (
            ("self_mask_shares", self._alive),
            ("secret_key_shares", self._gone),
        ):
            shares = getattr(response, kind)
            if not isinstance(shares, dict):
                return f"{kind} must be a dict"
            for owner, row in shares.items():
                if owner not in owners or client not in self._recipients.get(owner, ()):
                    return f"a share in {kind} of {owner!r}, which it may not give"
                try:
                    integer_vector(row, self.config.field, CHUNKS_PER_SECRET, "a share")
                except ValueError as error:
                    return str(error)
        return None

    def _unmasked_sum(self) -> np.ndarray:
        """The survivors' masked inputs less every self mask and every pairwise mask a
        dropped client left in them (in Z_2^k all keystreams go through one buffer)."""
        space = self.config.masking
        total = sum_vectors(space, [self.view.masked_inputs[i] for i in self.survivors])
        order = {responder: k for k, responder in enumerate(self.view.responses)}
        seeds: list[tuple[bytes, int]] = []  # (mask seed, +1 to add its mask / -1 to take it)
        for owner, seed in self._recover_all(self.survivors, "self_mask_shares", order):
            self.view.recovered_self_masks[owner] = seed
            seeds.append((seed, -1))
        linked = [o for o in self.dropped if not self._alive.isdisjoint(self._recipients[o])]
        for owner, raw_key in self._recover_all(linked, "secret_key_shares", order):
            partners = [j for j in self._recipients[owner] if j in self._alive]
            key = X25519PrivateKey.from_private_bytes(raw_key)
            if raw_public_key(key) != self.view.public_keys[owner][1]:
                raise self._abort(
                    RoundAborted(
                        f"round {self.config.round} aborted in UNMASK: client {owner}'s "
                        "mask-agreement key rebuilt from its neighbours' shares does not match "
                        "its public key (shares were altered; with threshold shares nobody can "
                        "be named)"
                    )
                )
            self.view.recovered_secret_keys[owner] = raw_key
            for partner in partners:
                seed = pairwise_seed(
                    key, self.view.public_keys[partner][1], self.session_id, owner, partner
                )
                # the partner added +mask if partner < owner, else -mask: undo it
                seeds.append((seed, -1 if partner < owner else 1))
        if isinstance(space, RingZ2k):
            return space.masked_sum(total, seeds)
        length = self.config.vector_length
        for seed, sign in seeds:
            mask = prg(space, seed, length)
            total = space.add(total, mask) if sign > 0 else space.sub(total, mask)
        return total

    def _recover_all(
        self, owners: Iterable[int], kind: str, order: dict[int, int]
    ) -> Iterator[tuple[int, bytes]]:
        """(owner, secret) of each of ``owners`` in order, as :meth:`_recover` gives them (and
        raising what it raises, at the same owner). The owners whose answering neighbours sit
        at the same places share one batched decoding
        (:meth:`protocols.shamir.PackedShamir.decode_agreeing`); an owner whose shares do not
        all agree, or that has too few, goes through :meth:`_recover` alone."""
        groups: dict[tuple, list[tuple[int, np.ndarray]]] = defaultdict(list)
        for owner in owners:
            members, rows = self._shares_of(owner, kind, order)
            ranked = sorted(range(len(members)), key=members.__getitem__)
            key = (len(self._recipients[owner]), tuple(members[i] for i in ranked))
            groups[key].append((owner, np.stack([rows[i] for i in ranked]) if rows else None))
        decoded: dict[int, np.ndarray] = {}
        for (recipients, members), group in groups.items():
            scheme = shamir_scheme(self.config, recipients)
            if len(members) < scheme.threshold:
                continue
            shares = np.stack([rows for _, rows in group], axis=1)
            values, agree = scheme.decode_agreeing(shares, members, CHUNKS_PER_SECRET)
            decoded.update((owner, values[i]) for i, (owner, _) in enumerate(group) if agree[i])
        for owner in owners:
            if owner in decoded:
                yield owner, elements_to_secret(decoded[owner])
            else:
                yield owner, self._recover(owner, kind, order)

    def _shares_of(
        self, owner: int, kind: str, order: dict[int, int]
    ) -> tuple[list[int], list[np.ndarray]]:
        """The owner's share rows held, in ``order``, and their senders' places among its
        recipients."""
        members, rows = [], []
        recipients = self._recipients[owner]
        responses = self.view.responses
        for responder in sorted((r for r in recipients if r in responses), key=order.__getitem__):
            share = getattr(responses[responder], kind).get(owner)
            if share is not None:
                members.append(recipients.index(responder))
                rows.append(share)
        return members, rows

    def _recover(self, owner: int, kind: str, order: dict[int, int] | None = None) -> bytes:
        """The owner's secret from its recipients' shares (``order``: each responder's place
        among the UNMASK responses, the order the shares are decoded in; None: computed)."""
        recipients = self._recipients[owner]
        if order is None:
            order = {responder: k for k, responder in enumerate(self.view.responses)}
        members, rows = self._shares_of(owner, kind, order)
        scheme = shamir_scheme(self.config, len(recipients))
        what = "self-mask seed" if kind == "self_mask_shares" else "mask-agreement key"
        if len(members) < scheme.threshold:
            raise self._abort(
                TooManyDropoutsError(
                    f"round {self.config.round} aborted in UNMASK: client {owner}'s {what} "
                    f"needs {scheme.threshold} shares, {len(members)} neighbours answered"
                )
            )
        # Plain unique decoding (max_faulty = the radius), unlike the committee protocols: a
        # neighbour that lies in UNMASK can at worst spoil the sum, which a malicious client can
        # do anyway through its masked input, and being named only drops its shares.
        radius = (len(members) - scheme.threshold) // 2
        try:
            decoding = scheme.decode(
                np.stack(rows), members, CHUNKS_PER_SECRET, max_faulty=radius
            )
        except ValueError as error:  # incl. InconsistentSharesError: beyond the radius
            problem = str(error)
        else:
            if decoding.corrected:
                raise _Culprits(tuple(recipients[m] for m in decoding.corrected))
            return elements_to_secret(decoding.values)
        raise self._abort(
            RoundAborted(
                f"round {self.config.round} aborted in UNMASK: the shares of client {owner}'s "
                f"{what} disagree and the wrong ones cannot be named ({problem})"
            )
        )


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
    identities: Mapping[int, Identity] | None = None,
    verifier: KeyVerifier | None = None,
    server_class: type | None = None,
) -> SecAggResult:
    """One full round in process: every client's handlers and the server's, with clients that
    stop answering at a given stage (``dropouts[stage]``: they skip that stage and all later
    ones); client secrets from the OS CSPRNG. ``identities[i]``: client i's enrolled identity
    (it signs its keys); ``verifier``: the enrolment every client checks its neighbours' keys
    against (None: taken as relayed); ``server_class``: the server's class (a subclass plays
    an active server). Raises :class:`TooManyDropoutsError` when recovery is impossible, and
    :class:`protocols.channels.KeySubstitution` when a client refuses a relayed key."""
    dropouts = {stage: set(ids) for stage, ids in (dropouts or {}).items()}
    for stage in dropouts:
        if stage not in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK):
            raise ValueError(f"dropouts has stage {stage.name}; clients drop in stages 1-4")
    session_id = new_session_id()
    server = (server_class or SecAggServer)(config, inputs.keys(), session_id, graph_rng)
    clients = {i: SecAggClient(session_id) for i in inputs}
    identities = dict(identities or {})
    gone: set[int] = set()

    def live(stage: Stage, candidates: Iterable[int]) -> list[int]:
        gone.update(dropouts.get(stage, ()))
        return [i for i in candidates if i not in gone]

    keys = {i: clients[i].advertise_keys() for i in live(Stage.ADVERTISE_KEYS, clients)}
    proofs = {i: clients[i].key_proof(identities[i]) for i in keys if i in identities}
    routed = server.advertise_keys(keys, proofs)
    excluded = set(server.excluded)
    outgoing = {
        i: clients[i].share_keys(
            i,
            config,
            routed[i],
            contribute=i not in excluded,
            proofs=server.proofs_for(i),
            verifier=verifier,
            own=identities[i].name if i in identities else None,
        )
        for i in live(Stage.SHARE_KEYS, routed)
    }
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
