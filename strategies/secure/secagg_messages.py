"""SecAgg+ (Bell et al., CCS 2020; :mod:`protocols.secagg`) as Flower message exchanges.

A secure-aggregation strategy runs one SecAgg+ round per FL round. Its train instruction
carries the round's public ``session`` id; each client trains, draws its protocol secrets from
its own secret and answers with its two public keys only (:func:`start_client`, ADVERTISE_KEYS).
The strategy then drives three more exchanges through the Grid it was given
(:func:`run_over_grid`), one per stage, each a ``query`` message the client app answers with
:func:`register_client_stages`'s handlers:

=============================  =====================================  ========================
message (server -> client)     content                                reply (client -> server)
=============================  =====================================  ========================
``query.secagg_share_keys``    its protocol id, the round's           one sealed share row per
                               parameters, its neighbours' keys       neighbour (envelopes)
``query.secagg_masked_input``  the envelopes addressed to it          y_i, the masked input
``query.secagg_unmask``        survivors and dropped (shared)         shares of their secrets
=============================  =====================================  ========================

so the server holds only public keys, envelopes it relays, masked inputs and its own state
(:class:`protocols.secagg.server.SecAggServer`). Protocol ids are 1..n in the order of the
clients' node ids (Flower's node ids may exceed the channels' 2^63 - 1).

**Client state.** Between messages a client keeps its protocol state and its input in
``context.state[SecAggKeys.STATE]``. When the runtime gives the client a persistent secret
(``node_config[NODE_SECRET_KEY]``, as fedsim's engine does) the state is sealed with it
(:meth:`fedsim.randomness.PartySecret.seal`), so a state store held by the server opens
nothing; otherwise (Flower's own runtime, where ``context.state`` stays in the node's own
memory) it is stored as is. The protocol seed is ``secret.seed_bytes(round, Purpose.KEYS,
session)``. A client answers a round's train instruction once: an instruction for a round it
has already begun is refused.

**Keys bound at enrolment.** A client enrolled by its runtime (``node_config`` carries the
registry's authority key and its certificate, :func:`fedsim.engine.client_registry.enrolled`)
signs its two keys (``proof`` in its ADVERTISE_KEYS reply); the server relays each neighbour's
proof with its keys, and the enrolled client checks them all before it shares anything
(:meth:`protocols.secagg.client.SecAggClient.share_keys`): a substituted key makes it refuse the
round, and a round that aborts for it says so (``aborted`` names the refusals). A client its
runtime enrolled nowhere takes the keys as relayed.

**Checks.** Every reply is checked at this boundary before the protocol sees it: it must answer
a message of this stage, come from a node asked in it (once), and hold exactly the records of
the stage with the right types; anything else rejects that client for the round, named with the
reason, and the server state machine checks the rest (:mod:`protocols.secagg.server`). A client
refuses a bad, replayed or out-of-order message by answering ``secagg.refused`` and storing itself
ABORTED for the round; refusals and error replies count as dropouts. With fedsim's grid each
exchange is declared as phase ``(round, PHASE_KIND[stage])``: clients' states are filed under
the round, and injected faults are drawn per exchange, so a client can also drop out inside
SecAgg+.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedsim.record_codec import to_numpy, to_record
from protocols.channels import Envelope
from protocols.kit import RoundAborted
from protocols.secagg.common import (
    CHUNKS_PER_SECRET,
    SecAggConfig,
    SecAggKeys,
    Stage,
    UnmaskResponse,
)
from protocols.secagg.server import SecAggServer
from protocols.secagg.stages import AdvertisedKeys, ShareKeys, Unmask

K = SecAggKeys
"""SecAgg+'s record and entry names (:class:`protocols.secagg.common.SecAggKeys`)."""

ACTIONS = {
    Stage.SHARE_KEYS: "secagg_share_keys",
    Stage.MASKED_INPUT: "secagg_masked_input",
    Stage.UNMASK: "secagg_unmask",
}
MESSAGE_TYPES = {stage: f"query.{action}" for stage, action in ACTIONS.items()}
PHASE_KIND = {Stage.SHARE_KEYS: 2, Stage.MASKED_INPUT: 3, Stage.UNMASK: 4}
"""fedsim phase kinds of the exchanges (0 and 1 are training and evaluation)."""

_REPLY_RECORDS = {
    Stage.SHARE_KEYS: {K.ENVELOPES: ConfigRecord},
    Stage.MASKED_INPUT: {K.MASKED: ArrayRecord},
    Stage.UNMASK: {K.UNMASK: ArrayRecord},
}
MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, SyntaxError)
"""What decoding an untrusted record may raise; each is a malformed reply."""


class MalformedReply(ValueError):
    """A reply that does not have the form its stage requires."""


# ----------------------------------------------------------------------------- wire formats
def envelopes_record(envelopes: Iterable[Envelope]) -> ConfigRecord:
    """Envelopes as a ConfigRecord of parallel lists (no pickle)."""
    envelopes = list(envelopes)
    columns = [
        [getattr(e, attribute) for e in envelopes]
        for attribute in ("sender", "receiver", "round", "stage", "nonce", "ciphertext")
    ]
    return ConfigRecord(dict(zip(K.ENVELOPE_ENTRIES, columns)))


def envelopes_from(record: object) -> list[Envelope]:
    """The envelopes of :func:`envelopes_record`; :class:`MalformedReply` if it is not one."""
    if not isinstance(record, ConfigRecord) or set(record) != set(K.ENVELOPE_ENTRIES):
        raise MalformedReply(f"envelopes must be a ConfigRecord with {list(K.ENVELOPE_ENTRIES)}")
    columns = [record[name] for name in K.ENVELOPE_ENTRIES]
    if any(not isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
        raise MalformedReply("the envelope lists must be lists of one length")
    types = (int, int, int, str, bytes, bytes)
    for name, column, kind in zip(K.ENVELOPE_ENTRIES, columns, types):
        if any(not isinstance(v, kind) or isinstance(v, bool) for v in column):
            raise MalformedReply(f"envelope field {name} must hold {kind.__name__} values")
    return [Envelope(*values) for values in zip(*columns)]


def setup_record(config: SecAggConfig, client_id: int, contribute: bool) -> ConfigRecord:
    """SHARE_KEYS' ``secagg.setup`` record: the round's parameters, the client's protocol id
    and whether it contributes."""
    record = ConfigRecord(config.to_record())
    record.update({K.CLIENT_ID: client_id, K.CONTRIBUTE: contribute})
    return record


def share_keys_from(content: RecordDict) -> ShareKeys:
    """The typed SHARE_KEYS message of a ``query.secagg_share_keys`` content (the client's
    own enrolment is added by the caller); ValueError / KeyError naming what is malformed."""
    setup = content[K.SETUP]
    config = SecAggConfig.from_record(setup)
    client_id, contribute = setup[K.CLIENT_ID], setup[K.CONTRIBUTE]
    if not isinstance(client_id, int) or not isinstance(contribute, bool):
        raise ValueError(
            f"{K.CLIENT_ID}={client_id!r}, {K.CONTRIBUTE}={contribute!r}; allowed: an "
            "integer and a bool"
        )
    neighbours = content[K.NEIGHBOURS]
    ids, channel, agreement = (neighbours[k] for k in K.NEIGHBOUR_ENTRIES[:3])
    if not (isinstance(ids, list) and len(ids) == len(channel) == len(agreement)):
        raise ValueError("neighbour ids and keys must be lists of one length")
    keys = {j: (c, a) for j, c, a in zip(ids, channel, agreement)}
    if len(keys) != len(ids):
        raise ValueError("a neighbour id is repeated")
    proofs = neighbours.get(K.NEIGHBOUR_ENTRIES[3], [])
    if not isinstance(proofs, list) or len(proofs) not in (0, len(ids)):
        raise ValueError("neighbour proofs must be a list, one per neighbour")
    proof_of = {j: p for j, p in zip(ids, proofs) if isinstance(p, bytes) and p}
    return ShareKeys(client_id, config, contribute, keys, proof_of)


def _neighbours_record(neighbours: Mapping[int, tuple], relayed: Mapping[int, bytes]):
    columns = (
        list(neighbours),
        [neighbours[j][0] for j in neighbours],
        [neighbours[j][1] for j in neighbours],
        [relayed.get(j, b"") for j in neighbours],
    )
    return ConfigRecord(dict(zip(K.NEIGHBOUR_ENTRIES, columns)))


def keys_record(keys: AdvertisedKeys) -> ConfigRecord:
    """ADVERTISE_KEYS' reply record (:attr:`SecAggKeys.KEYS`): channel, agreement, and proof if
    any."""
    record = ConfigRecord({K.CHANNEL: keys.channel, K.AGREEMENT: keys.agreement})
    if keys.proof is not None:
        record[K.PROOF] = keys.proof
    return record


def keys_from(record: object) -> tuple:
    """The (channel, agreement[, proof]) of a :func:`keys_record` reply record, as the server
    takes them (what the keys are is the protocol's to check); ValueError if it is not one."""
    if not isinstance(record, ConfigRecord) or set(record) - {K.PROOF} != {
        K.CHANNEL,
        K.AGREEMENT,
    }:
        raise ValueError(
            f"public keys must be '{K.CHANNEL}' and '{K.AGREEMENT}' (and '{K.PROOF}')"
        )
    if K.PROOF in record:
        return (record[K.CHANNEL], record[K.AGREEMENT], record[K.PROOF])
    return (record[K.CHANNEL], record[K.AGREEMENT])


def survivors_record(survivors, dropped) -> ConfigRecord:
    """UNMASK's ``secagg.survivors`` record."""
    return ConfigRecord(dict(zip(K.SURVIVOR_ENTRIES, (list(survivors), list(dropped)))))


def unmask_from(content: RecordDict) -> Unmask:
    """The typed UNMASK message of a ``query.secagg_unmask`` content."""
    listing = content[K.SURVIVORS]
    survivors, dropped = (listing[k] for k in K.SURVIVOR_ENTRIES)
    return Unmask(survivors, dropped)


def header_record(server_round: int, session: bytes, stage: Stage) -> ConfigRecord:
    """The ``secagg`` header of every stage's message: the round, session and stage."""
    return ConfigRecord(dict(zip(K.HEADER_ENTRIES, (server_round, session, stage.name))))


def refused_record(stage: Stage, reason: str) -> ConfigRecord:
    """A refusing client's reply record (:attr:`SecAggKeys.REFUSED`)."""
    return ConfigRecord(dict(zip(K.REFUSED_ENTRIES, (stage.name, reason))))


def unmask_record(response: UnmaskResponse) -> ArrayRecord:
    arrays = {}
    for name, shares in zip(
        K.UNMASK_PARTS, (response.self_mask_shares, response.secret_key_shares)
    ):
        owners = sorted(shares)
        arrays[f"{name}-owners"] = np.array(owners, dtype=np.int64)
        arrays[f"{name}-shares"] = np.array(
            [shares[o] for o in owners], dtype=np.int64
        ).reshape(len(owners), CHUNKS_PER_SECRET)
    return to_record(arrays)


def _unmask_from(record: ArrayRecord) -> UnmaskResponse:
    arrays = to_numpy(record)
    names = {f"{n}-{p}" for n in K.UNMASK_PARTS for p in ("owners", "shares")}
    if set(arrays) != names:
        raise MalformedReply(f"an unmask reply holds exactly the arrays {sorted(names)}")
    parts = []
    for name in K.UNMASK_PARTS:
        owners, shares = arrays[f"{name}-owners"], arrays[f"{name}-shares"]
        if (
            owners.ndim != 1
            or owners.dtype.kind not in "iu"
            or shares.ndim != 2
            or shares.shape[0] != owners.size
            or len(set(owners.tolist())) != owners.size
        ):
            raise MalformedReply(f"{name} owners and shares must be one row per distinct owner")
        parts.append({int(o): np.array(row) for o, row in zip(owners.tolist(), shares)})
    return UnmaskResponse(*parts)


# ----------------------------------------------------------------------------- server side
@dataclass
class SecAggOutcome:
    """One SecAgg+ round over a Grid, in node ids: the aggregate (in the round's masking
    space; None if the round aborted), the nodes whose inputs it sums, the nodes rejected for
    a bad reply with the reasons, why the round aborted (None if it completed), the server
    state machine's final stage, how many messages each exchange sent, the nodes that
    refused a stage (dropouts) with their reasons, and ``opened``: when the round aborted
    after the server held enough to determine the sum (:attr:`SecAggServer.opened`), the nodes
    whose inputs that sum holds -- a release all the same."""

    aggregate: np.ndarray | None
    survivors: tuple[int, ...]
    rejected: dict[int, str]
    aborted: str | None
    config: SecAggConfig | None = None
    stage: Stage = Stage.SETUP
    messages: dict[str, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    opened: tuple[int, ...] = ()


@dataclass
class _Exchange:
    """The server's bookkeeping of one SecAgg+ round over a Grid."""

    grid: Grid
    server_round: int
    session: bytes
    timeout: float | None
    silent: Mapping[Stage, set[int]]
    server: SecAggServer
    node_of: dict[int, int]
    messages: dict[str, int] = field(default_factory=dict)
    foreign: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def message(self, node: int, stage: Stage, content: RecordDict) -> Message:
        return Message(
            content=content,
            dst_node_id=node,
            message_type=MESSAGE_TYPES[stage],
            group_id=str(self.server_round),
        )

    def send(self, stage: Stage, targets: dict[int, dict[str, Any]]) -> dict[int, RecordDict]:
        """Send each protocol id in ``targets`` its records (skipping clients scheduled to be
        silent in ``stage``); return the accepted replies' contents by protocol id and reject
        the clients whose replies do not have the stage's form."""
        silent = self.silent.get(stage, set())
        header = header_record(self.server_round, self.session, stage)
        contents: dict[int, RecordDict] = {}  # by id(records): clients given the same records
        for records in targets.values():  # share one content, serialised and shipped once
            if id(records) not in contents:
                contents[id(records)] = RecordDict({K.HEADER: header, **records})
        outgoing = [
            self.message(self.node_of[c], stage, contents[id(records)])
            for c, records in targets.items()
            if self.node_of[c] not in silent
        ]
        declare = getattr(self.grid, "begin_phase", None)  # fedsim's grid files it by round
        if declare is not None:
            declare(self.server_round, PHASE_KIND[stage])
        replies = list(self.grid.send_and_receive(outgoing, timeout=self.timeout))
        self.messages[stage.name] = len(outgoing)
        asked = {m.metadata.dst_node_id for m in outgoing}
        client_of = {node: c for c, node in self.node_of.items()}
        accepted: dict[int, RecordDict] = {}
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                continue  # the client failed or refused: a dropout
            problem = reply_problem(reply, stage, asked, accepted, client_of)
            if problem is not None and node in client_of:
                self.server.reject(client_of[node], stage, problem)
            elif problem is not None:
                self.foreign[node] = f"{stage.name}: {problem}"
            if problem is not None:
                continue
            if K.REFUSED in reply.content:
                reason = reply.content[K.REFUSED].get(K.REFUSED_ENTRIES[1])
                self.refused[node] = str(reason)[:500]
                continue
            accepted[client_of[node]] = reply.content
        return accepted


def reply_problem(
    reply: Message,
    stage: Stage,
    asked: set[int],
    accepted: Mapping[int, Any],
    client_of: Mapping[int, int],
) -> str | None:
    """Why ``reply`` is no answer to this stage (None if its form is right)."""
    node = int(reply.metadata.src_node_id)
    if node not in asked or node not in client_of:
        return f"node {node} was not asked in {stage.name}"
    if client_of[node] in accepted:
        return "a second reply"
    if reply.metadata.message_type != MESSAGE_TYPES[stage]:
        return f"a {reply.metadata.message_type!r} reply in stage {stage.name}"
    expected = _REPLY_RECORDS[stage]
    content = reply.content
    if set(content.keys()) == {K.REFUSED} and isinstance(content[K.REFUSED], ConfigRecord):
        return None  # the client refused the stage: a dropout
    if set(content.keys()) != set(expected) or any(
        not isinstance(content[k], kind) for k, kind in expected.items()
    ):
        return f"the reply must hold exactly {sorted(expected)}, got {sorted(content.keys())}"
    return None


def run_over_grid(
    grid: Grid,
    *,
    server_round: int,
    session: bytes,
    public_keys: Mapping[int, object],
    config_for: Callable[[int], SecAggConfig],
    graph_rng: np.random.Generator,
    timeout: float | None,
    silent: Mapping[Stage, set[int]] | None = None,
) -> SecAggOutcome:
    """SHARE_KEYS, MASKED_INPUT and UNMASK over ``grid`` for the nodes whose ADVERTISE_KEYS
    replies gave ``public_keys`` (node id -> (channel, agreement) or (channel, agreement,
    proof), unchecked: the clients check the proofs); ``config_for(n)``
    gives the round's parameters for n clients. ``silent[stage]``: nodes that stop answering
    from that stage on (simulated protocol dropouts). Never raises for a client's reply: a bad
    one is rejected, and a round that cannot complete ends ABORTED with no aggregate (its
    ``opened`` nodes say when the server held enough to determine it all the same)."""
    silent = {stage: set(nodes) for stage, nodes in (silent or {}).items()}
    nodes = sorted(public_keys)
    node_of = {index + 1: node for index, node in enumerate(nodes)}
    try:
        config = config_for(len(nodes))
    except ValueError as error:
        return SecAggOutcome(None, (), {}, f"round {server_round} not run: {error}")
    server = SecAggServer(config, node_of, session, graph_rng)
    exchange = _Exchange(grid, server_round, session, timeout, silent, server, node_of)
    gone = silent.get(Stage.ADVERTISE_KEYS, set())
    given = {c: public_keys[n] for c, n in node_of.items() if n not in gone}
    keys = {c: _pair(v) for c, v in given.items()}
    proofs = {c: v[2] for c, v in given.items() if isinstance(v, tuple | list) and len(v) == 3}
    aggregate, aborted = None, None
    try:
        aggregate = _run_stages(exchange, config, keys, proofs)
    except RoundAborted as error:
        aborted = str(error)
        if exchange.refused:  # name why the clients refused (a substituted key, ...)
            node, reason = sorted(exchange.refused.items())[0]
            aborted += f"; {len(exchange.refused)} clients refused, node {node}: {reason}"
    rejected = dict(exchange.foreign)
    rejected.update({node_of[c]: why for c, why in server.rejected.items() if c in node_of})
    summed = tuple(node_of[c] for c in server.survivors)
    return SecAggOutcome(
        aggregate,
        summed if aggregate is not None else (),
        rejected,
        aborted,
        config,
        server.stage,
        exchange.messages,
        exchange.refused,
        summed if aggregate is None and server.opened else (),
    )


def _pair(keys: object) -> object:
    """The (channel, agreement) pair of an ADVERTISE_KEYS payload (the server checks it)."""
    if isinstance(keys, tuple | list) and len(keys) == 3:
        return (keys[0], keys[1])
    return keys


def _run_stages(
    exchange: _Exchange,
    config: SecAggConfig,
    keys: dict[int, object],
    proofs: Mapping[int, bytes] | None = None,
) -> np.ndarray:
    server = exchange.server
    routed = server.advertise_keys(keys, proofs)
    excluded = set(server.excluded)
    setups = {}
    for c, neighbours in routed.items():
        relayed = server.proofs_for(c)
        setups[c] = {
            K.SETUP: setup_record(config, c, c not in excluded),
            K.NEIGHBOURS: _neighbours_record(neighbours, relayed),
        }
    envelopes = {}
    for c, content in exchange.send(Stage.SHARE_KEYS, setups).items():
        try:
            envelopes[c] = envelopes_from(content[K.ENVELOPES])
        except MalformedReply as error:
            server.reject(c, Stage.SHARE_KEYS, str(error))
    incoming = server.share_keys(envelopes)
    answered = {c for c in envelopes if c not in server.rejected}
    deliveries = {
        c: {K.ENVELOPES: envelopes_record(incoming[c])} for c in incoming if c in answered
    }
    masked, holders = {}, []
    for c, content in exchange.send(Stage.MASKED_INPUT, deliveries).items():
        try:
            arrays = to_numpy(content[K.MASKED])
        except MALFORMED as error:
            server.reject(c, Stage.MASKED_INPUT, f"malformed masked input: {error}")
            continue
        if list(arrays) != [K.MASKED_ENTRY]:
            server.reject(c, Stage.MASKED_INPUT, "the reply must hold one array, 'masked'")
            continue
        value = arrays[K.MASKED_ENTRY]
        if c in excluded and isinstance(value, np.ndarray) and value.size == 0:
            holders.append(c)  # excluded: holds shares, contributes nothing
        else:
            masked[c] = value
    survivors, dropped = server.masked_input(masked)
    listing = {K.SURVIVORS: survivors_record(survivors, dropped)}  # one content for all
    asked = {c: listing for c in (*survivors, *holders)}
    responses = {}
    for c, content in exchange.send(Stage.UNMASK, asked).items():
        try:
            responses[c] = _unmask_from(content[K.UNMASK])
        except MALFORMED as error:
            server.reject(c, Stage.UNMASK, f"malformed unmask reply: {error}")
    return server.unmask(responses)
