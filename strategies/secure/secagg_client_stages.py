"""The client half of SecAgg+ over Flower messages (:mod:`strategies.secure.secagg_messages`): a
ClientApp's stage entry points, which decode each message, run the protocol's stage handler
(:data:`protocols.secagg.stages.HANDLERS`) on the state the client keeps between stages
(sealed under its own secret) and encode the reply; and the packing of that state. A client
app gets them through the registry (:meth:`strategies.secure.SecAggSum.register_client_stages`,
:func:`strategies.secure.register_client_stages`)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsim.engine.client_registry import enrolled, enrolled_name
from fedsim.randomness import NODE_SECRET_KEY, PartySecret, Purpose, client_secret
from fedsim.record_codec import to_record
from protocols.kit import StageError
from protocols.secagg.common import SecAggKeys, Stage
from protocols.secagg.stages import (
    REFUSALS,
    AdvertiseKeys,
    MaskedInput,
    StageRefused,
    aborted,
    begin,
    handle,
)
from protocols.secagg.state import ClientState
from strategies.secure.secagg_messages import (
    ACTIONS,
    envelopes_from,
    envelopes_record,
    keys_record,
    refused_record,
    share_keys_from,
    unmask_from,
    unmask_record,
)

K = SecAggKeys
_STATE_LABEL = b"fedsim/secagg/client-state/v2"


def _secret(context: Context) -> tuple[PartySecret, bool]:
    """The client's secret and whether it persists across messages (the runtime gave it)."""
    return client_secret(context.node_config), NODE_SECRET_KEY in context.node_config


def _save(context: Context, state: ClientState, own: tuple[PartySecret, bool] | None = None):
    """Store ``state`` in ``context.state`` (sealed under the client's secret if it persists;
    ``own``: :func:`_secret` of ``context``, when the caller has it already)."""
    payload = pack_arrays(state.to_arrays())
    secret, persistent = own or _secret(context)
    record = ConfigRecord({K.STORED_ROUND: state.server_round, K.STORED_SEALED: persistent})
    record[K.STORED_BLOB] = secret.seal(payload, _STATE_LABEL) if persistent else payload
    context.state[K.STATE] = record


def _load(context: Context, own: tuple[PartySecret, bool] | None = None) -> ClientState:
    record = context.state.get(K.STATE)
    if not isinstance(record, ConfigRecord) or K.STORED_BLOB not in record:
        raise RuntimeError("no SecAgg+ round in progress on this client")
    secret, persistent = own or _secret(context)
    if bool(record[K.STORED_SEALED]) != persistent:
        raise RuntimeError("this client's secret changed in the middle of a SecAgg+ round")
    blob = record[K.STORED_BLOB]
    payload = secret.open(blob, _STATE_LABEL) if persistent else blob
    return ClientState.from_arrays(unpack_arrays(payload))


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
    layout, parts = [], []
    for name, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.kind not in "iu":
            raise ValueError(f"state array {name!r} has dtype {value.dtype}; integers only")
        layout.append((name, value.dtype.str, value.shape))
        if value.size:  # an empty array adds no bytes; a C-ordered one is its own buffer
            parts.append(value if value.flags.c_contiguous else np.ascontiguousarray(value))
    return b"".join([_head(tuple(layout)), *parts])  # the one copy


@functools.lru_cache(maxsize=256)
def _head(layout: tuple[tuple[str, str, tuple[int, ...]], ...]) -> bytes:
    """A pack's 4-byte length and JSON index, encoded once per distinct layout."""
    head = json.dumps([[name, code, list(shape)] for name, code, shape in layout]).encode()
    return len(head).to_bytes(4, "little") + head


@functools.lru_cache(maxsize=256)
def _index(head: bytes) -> tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]:
    """The checked (name, dtype, shape, entries) of each array in a pack's JSON index, parsed
    once per distinct index: every client at a stage of a round stores the same one."""
    out = []
    for name, code, shape in json.loads(head):
        dtype = np.dtype(code)
        if dtype.kind not in "iu" or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"array {name!r}: dtype {dtype}, shape {shape}")
        out.append((str(name), dtype, tuple(shape), math.prod(shape)))
    return tuple(out)


def unpack_arrays(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays :func:`pack_arrays` wrote, as read-only views of ``payload``; ValueError if
    the bytes are not such a pack (bad index, a non-integer dtype, sizes that disagree)."""
    try:
        size = int.from_bytes(payload[:4], "little")
        offset, out = 4 + size, {}
        for name, dtype, shape, count in _index(bytes(payload[4 : 4 + size])):
            if offset + count * dtype.itemsize > len(payload):
                raise ValueError(f"array {name!r} runs past the end of the state")
            flat = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
            out[name] = flat if len(shape) == 1 else flat.reshape(shape)
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
    previous = context.state.get(K.STATE)
    if isinstance(previous, ConfigRecord) and int(previous.get(K.STORED_ROUND, -1)) >= server_round:
        raise RuntimeError(
            f"this client already began round {previous[K.STORED_ROUND]}; it answers round "
            f"{server_round}'s instruction only once"
        )
    if not isinstance(session, bytes) or len(session) < 16:
        raise ValueError("the instruction's SecAgg+ session must be at least 16 bytes")
    secret, _ = _secret(context)
    seed = secret.seed_bytes(server_round, Purpose.KEYS, session.hex())
    state = begin(server_round, session, seed, None if values is None else narrowest(values))
    enrolment = enrolled(context.node_config, secret)
    message = AdvertiseKeys(None if enrolment is None else enrolment[0])
    state, keys = handle(Stage.ADVERTISE_KEYS, state, message)
    _save(context, state)
    return RecordDict({K.KEYS: keys_record(keys)})


def _checked(stage: Stage, message: Message, context: Context, own) -> ClientState:
    """The stored state, after checking the message is for its round, session and ``stage``."""
    state = _load(context, own)
    header = message.content.get(K.HEADER)
    expected = (state.server_round, state.protocol.session, stage.name)
    if not isinstance(header, ConfigRecord) or any(
        header.get(name) != value for name, value in zip(K.HEADER_ENTRIES, expected)
    ):
        raise RuntimeError(
            f"a SecAgg+ message for another round or session, or stage (this client is in "
            f"round {state.server_round}, answering {stage.name})"
        )
    return state


def _message(stage: Stage, content: RecordDict, context: Context, secret: PartySecret):
    """The typed message of ``stage`` in ``content`` (SHARE_KEYS with the client's enrolment)."""
    if stage is Stage.SHARE_KEYS:
        message = share_keys_from(content)
        enrolment = enrolled_name(context.node_config)  # SHARE_KEYS signs nothing
        if enrolment is None:
            return message
        return replace(message, verifier=enrolment[1], own=enrolment[0])
    if stage is Stage.MASKED_INPUT:
        return MaskedInput(tuple(envelopes_from(content[K.ENVELOPES])))
    return unmask_from(content)


def _reply(stage: Stage, reply: Any) -> RecordDict:
    """The reply content of a stage handler's ``reply``."""
    if stage is Stage.SHARE_KEYS:
        return RecordDict({K.ENVELOPES: envelopes_record(reply)})
    if stage is Stage.MASKED_INPUT:
        masked = np.zeros(0, dtype=np.int64) if reply is None else reply
        return RecordDict({K.MASKED: to_record({K.MASKED_ENTRY: masked})})
    return RecordDict({K.UNMASK: unmask_record(reply)})


def _answer(stage: Stage, message: Message, context: Context) -> RecordDict:
    """Run the client's handler of ``stage`` (:data:`protocols.secagg.stages.HANDLERS`) on its
    stored state and store the new one. A message the client refuses (bad, replayed, out of
    order) leaves it ABORTED for the round -- stored, so that no later message of the round
    can resume it -- and the reply says so (``secagg.refused``); the input is kept only until
    it is masked."""
    own = _secret(context)  # one secret (and seal key) for the message's load and save
    state = _checked(stage, message, context, own)
    try:
        state, reply = handle(stage, state, _message(stage, message.content, context, own[0]))
    except StageRefused as refusal:
        return _refuse(context, refusal.state, stage, refusal.cause, own)
    except (StageError, *REFUSALS) as error:
        return _refuse(context, aborted(state), stage, error, own)
    _save(context, state, own)
    return _reply(stage, reply)


def _refuse(context: Context, state: ClientState, stage: Stage, error: BaseException, own):
    _save(context, replace(state, values=None), own)
    return RecordDict({K.REFUSED: refused_record(stage, f"{type(error).__name__}: {error}")})


def register_client_stages(app: ClientApp) -> None:
    """Add the client's SecAgg+ stage handlers (``query.secagg_*``) to ``app``."""
    for stage, action in ACTIONS.items():

        def answer(message: Message, context: Context, stage: Stage = stage) -> Message:
            return Message(content=_answer(stage, message, context), reply_to=message)

        app.query(action)(answer)
