"""The client half of SecAgg+ over Flower messages (:mod:`strategies.secagg_messages`): a
ClientApp's stage handlers, the client state it keeps between stages (sealed under its own
secret) and the packing of that state."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsim.engine.client_registry import enrolled
from fedsim.randomness import NODE_SECRET_KEY, PartySecret, Purpose, client_secret
from fedsim.record_codec import to_record
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    TRANSITIONS,
    Stage,
)
from strategies.secagg_messages import (
    ACTIONS,
    ENVELOPES_KEY,
    KEYS_KEY,
    MASKED_KEY,
    NEIGHBOURS_KEY,
    REFUSED_KEY,
    ROUND_KEY,
    SETUP_KEY,
    STATE_KEY,
    SURVIVORS_KEY,
    UNMASK_KEY,
    config_from,
    envelopes_from,
    envelopes_record,
    unmask_record,
)

_STATE_LABEL = b"fedsim/secagg/client-state/v2"



def _secret(context: Context) -> tuple[PartySecret, bool]:
    """The client's secret and whether it persists across messages (the runtime gave it)."""
    return client_secret(context.node_config), NODE_SECRET_KEY in context.node_config


def _save(
    context: Context, server_round: int, client: SecAggClient, values: np.ndarray | None
) -> None:
    arrays = dict(client.to_state())
    arrays["round"] = np.array(server_round, dtype=np.int64)
    if values is not None:
        arrays["input"] = narrowest(values)
    payload = pack_arrays(arrays)
    secret, persistent = _secret(context)
    record = ConfigRecord({"round": server_round, "sealed": persistent})
    record["state"] = secret.seal(payload, _STATE_LABEL) if persistent else payload
    context.state[STATE_KEY] = record


def _load(context: Context) -> tuple[int, SecAggClient, np.ndarray | None]:
    record = context.state.get(STATE_KEY)
    if not isinstance(record, ConfigRecord) or "state" not in record:
        raise RuntimeError("no SecAgg+ round in progress on this client")
    secret, persistent = _secret(context)
    if bool(record["sealed"]) != persistent:
        raise RuntimeError("this client's secret changed in the middle of a SecAgg+ round")
    payload = secret.open(record["state"], _STATE_LABEL) if persistent else record["state"]
    arrays = unpack_arrays(payload)
    values = arrays.pop("input", None)
    return int(arrays.pop("round")), SecAggClient.from_state(arrays), values


_STATE_DTYPES = (np.int8, np.int16, np.int32, np.int64)


def narrowest(values) -> np.ndarray:
    """Signed integers in the narrowest of int8..int64 that holds them all (a DDGauss encoding
    of ~12 bits is stored in 2 bytes an entry, not 8)."""
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        raise ValueError(f"the input must hold integers, got dtype {values.dtype}")
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for dtype in _STATE_DTYPES:
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype, copy=False)
    raise ValueError(f"the input has entries in [{low}, {high}], outside int64")


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named integer arrays as bytes: a 4-byte length, a JSON index of (name, dtype, shape),
    then each array's C-ordered bytes (no zip, no pickle, no per-array header to parse)."""
    index, parts = [], []
    for name, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.kind not in "iu":
            raise ValueError(f"state array {name!r} has dtype {value.dtype}; integers only")
        index.append([name, value.dtype.str, list(value.shape)])
        parts.append(value.tobytes(order="C"))
    head = json.dumps(index).encode()
    return len(head).to_bytes(4, "little") + head + b"".join(parts)


def unpack_arrays(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays :func:`pack_arrays` wrote, as read-only views of ``payload``; ValueError if
    the bytes are not such a pack (bad index, a non-integer dtype, sizes that disagree)."""
    try:
        size = int.from_bytes(payload[:4], "little")
        index = json.loads(payload[4 : 4 + size])
        offset, out = 4 + size, {}
        for name, dtype, shape in index:
            dtype = np.dtype(dtype)
            if dtype.kind not in "iu" or any(not isinstance(n, int) or n < 0 for n in shape):
                raise ValueError(f"array {name!r}: dtype {dtype}, shape {shape}")
            count = math.prod(shape)
            if offset + count * dtype.itemsize > len(payload):
                raise ValueError(f"array {name!r} runs past the end of the state")
            flat = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
            out[str(name)] = flat.reshape(tuple(shape))
            offset += count * dtype.itemsize
    except (TypeError, ValueError, json.JSONDecodeError) as error:
        raise ValueError(f"not a SecAgg+ client state: {error}") from None
    if offset != len(payload):
        raise ValueError("not a SecAgg+ client state: trailing bytes")
    return out


def start_client(context: Context, server_round: int, session: bytes, values) -> RecordDict:
    """ADVERTISE_KEYS on the client: draw the round's protocol seed from the client's own
    secret, keep the signed integer input ``values`` in the client's state, and return the
    reply content (its two public keys). Refuses a round it has already begun."""
    previous = context.state.get(STATE_KEY)
    if isinstance(previous, ConfigRecord) and int(previous.get("round", -1)) >= server_round:
        raise RuntimeError(
            f"this client already began round {previous['round']}; it answers round "
            f"{server_round}'s instruction only once"
        )
    if not isinstance(session, bytes) or len(session) < 16:
        raise ValueError("the instruction's SecAgg+ session must be at least 16 bytes")
    secret, _ = _secret(context)
    seed = secret.seed_bytes(server_round, Purpose.KEYS, session.hex())
    client = SecAggClient(session, seed=seed)
    channel, agreement = client.advertise_keys()
    record = ConfigRecord({"channel": channel, "agreement": agreement})
    enrolment = enrolled(context.node_config, secret)
    if enrolment is not None:
        record["proof"] = client.key_proof(enrolment[0])
    _save(context, server_round, client, values)
    return RecordDict({KEYS_KEY: record})


def _stage_of(
    stage: Stage, message: Message, context: Context
) -> tuple[int, SecAggClient, Any]:
    """The stored round, client and input, after checking the message is for them."""
    server_round, client, values = _load(context)
    header = message.content.get(ROUND_KEY)
    if (
        not isinstance(header, ConfigRecord)
        or header.get("server-round") != server_round
        or header.get("session") != client.session_id
        or header.get("stage") != stage.name
    ):
        raise RuntimeError(
            f"a SecAgg+ message for another round or session, or stage (this client is in "
            f"round {server_round}, answering {stage.name})"
        )
    return server_round, client, values


def _share_keys(
    message: Message, client: SecAggClient, server_round: int, context: Context
) -> RecordDict:
    config, client_id, contribute = config_from(message.content[SETUP_KEY])
    if config.round != server_round:
        raise ValueError(f"the parameters are for round {config.round}, not {server_round}")
    neighbours = message.content[NEIGHBOURS_KEY]
    ids, channel, agreement = (neighbours[k] for k in ("ids", "channel-keys", "agreement-keys"))
    if not (isinstance(ids, list) and len(ids) == len(channel) == len(agreement)):
        raise ValueError("neighbour ids and keys must be lists of one length")
    keys = {j: (c, a) for j, c, a in zip(ids, channel, agreement)}
    if len(keys) != len(ids):
        raise ValueError("a neighbour id is repeated")
    proofs = neighbours.get("proofs", [])
    if not isinstance(proofs, list) or len(proofs) not in (0, len(ids)):
        raise ValueError("neighbour proofs must be a list, one per neighbour")
    proof_of = {j: p for j, p in zip(ids, proofs) if isinstance(p, bytes) and p}
    enrolment = enrolled(context.node_config, _secret(context)[0])
    envelopes = client.share_keys(
        client_id,
        config,
        keys,
        contribute=contribute,
        proofs=proof_of,
        verifier=None if enrolment is None else enrolment[1],
        own=None if enrolment is None else enrolment[0].name,
    )
    return RecordDict({ENVELOPES_KEY: envelopes_record(envelopes)})


def _masked_input(message: Message, client: SecAggClient, values: np.ndarray) -> RecordDict:
    envelopes = envelopes_from(message.content[ENVELOPES_KEY])
    own = None
    if client.contributes and client.stage is Stage.SHARE_KEYS:
        try:
            own = client.config.masking.encode_signed(values)
        except ValueError:
            raise ValueError("this client's input does not fit the round's masking space") from None
    masked = client.masked_input(envelopes, own)
    out = np.zeros(0, dtype=np.int64) if masked is None else masked
    return RecordDict({MASKED_KEY: to_record({"masked": out})})


def _unmask(message: Message, client: SecAggClient) -> RecordDict:
    listing = message.content[SURVIVORS_KEY]
    response = client.unmask(listing["survivors"], listing["dropped"])
    return RecordDict({UNMASK_KEY: unmask_record(response)})


def _answer(stage: Stage, message: Message, context: Context) -> RecordDict:
    """Run the client's handler of ``stage`` on its stored state and store the result. A
    message the handler refuses (bad, replayed, out of order) leaves the client ABORTED for
    the round -- stored, so that no later message of the round can resume it -- and the reply
    says so (REFUSED_KEY); the input is kept only until it is masked."""
    server_round, client, values = _stage_of(stage, message, context)
    try:
        if stage is Stage.SHARE_KEYS:
            content = _share_keys(message, client, server_round, context)
        elif stage is Stage.MASKED_INPUT:
            content, values = _masked_input(message, client, values), None
        else:
            content = _unmask(message, client)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        if Stage.ABORTED in TRANSITIONS[client.stage]:
            client.abort()
        _save(context, server_round, client, None)
        reason = f"{type(error).__name__}: {error}"
        return RecordDict({REFUSED_KEY: ConfigRecord({"stage": stage.name, "reason": reason})})
    _save(context, server_round, client, values)
    return content


def register_client_stages(app: ClientApp) -> None:
    """Add the client's SecAgg+ stage handlers (``query.secagg_*``) to ``app``."""
    for stage, action in ACTIONS.items():

        def answer(message: Message, context: Context, stage: Stage = stage) -> Message:
            return Message(content=_answer(stage, message, context), reply_to=message)

        app.query(action)(answer)
