"""The SecAgg+ client as stage handlers ``handle_<stage>(state, message) -> (state, reply)``
(Bell et al., CCS 2020; the protocol in :mod:`protocols.secagg.common`).

Each handler takes the client's stored state (:class:`~protocols.secagg.state.ClientState`, what
is kept between stages, sealed by the caller) and a typed message, restores the
:class:`~protocols.secagg.client.SecAggClient`, checks the stage move
(:func:`~protocols.secagg.common.check_transition`) before anything else and returns the new
state with the reply. A handler called out of order raises :class:`~protocols.kit.StageError`
and returns no new state; a message the client refuses (bad, replayed, hostile) raises
:class:`StageRefused` carrying the ABORTED state to store in place of the old one. The table
:data:`HANDLERS` maps each :class:`~protocols.secagg.common.Stage` to its handler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from protocols.channels import Envelope
from protocols.enrolment import Identity, KeyVerifier
from protocols.kit import StageError
from protocols.secagg.client import SecAggClient
from protocols.secagg.common import (
    TRANSITIONS,
    SecAggConfig,
    Stage,
    UnmaskResponse,
    check_transition,
)
from protocols.secagg.state import ClientState

REFUSALS = (ValueError, TypeError, KeyError, RuntimeError)
"""What a client's handler raises for a message it refuses (each ends its round ABORTED)."""


class StageRefused(RuntimeError):
    """The client refused a stage's message: ``state`` (ABORTED where that move is allowed) is
    what it stores instead of the old one; ``cause`` is why."""

    def __init__(self, state: ClientState, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.state = state
        self.cause = cause


@dataclass(frozen=True)
class AdvertiseKeys:
    """ADVERTISE_KEYS: ``identity``, the client's own enrolment identity (None: not enrolled),
    with which it signs its keys."""

    identity: Identity | None = None


@dataclass(frozen=True)
class AdvertisedKeys:
    """ADVERTISE_KEYS' reply: the channel and mask-agreement public keys, and the enrolment
    proof of both (None for a client that is not enrolled)."""

    channel: bytes
    agreement: bytes
    proof: bytes | None = None


@dataclass(frozen=True)
class ShareKeys:
    """SHARE_KEYS: the client's protocol id, the round's parameters, whether it contributes,
    its neighbours' (channel, agreement) keys and their proofs as relayed by the server;
    ``verifier`` and ``own`` (its enrolled name) are the client's own enrolment, not the
    server's word (None: not enrolled)."""

    client_id: int
    config: SecAggConfig
    contribute: bool
    neighbour_keys: Mapping[int, tuple[bytes, bytes]]
    proofs: Mapping[int, bytes] = field(default_factory=dict)
    verifier: KeyVerifier | None = None
    own: str | None = None


@dataclass(frozen=True)
class MaskedInput:
    """MASKED_INPUT: the envelopes the server relays to this client."""

    envelopes: tuple[Envelope, ...]


@dataclass(frozen=True)
class Unmask:
    """UNMASK: the clients the server says survived and dropped."""

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


def begin(server_round: int, session: bytes, seed: bytes, values: Any = None) -> ClientState:
    """A client's state before ADVERTISE_KEYS: a fresh :class:`SecAggClient` for ``session``
    with the client's own ``seed``, the round and its input."""
    protocol = SecAggClient(session, seed=seed).to_state()
    return ClientState(int(server_round), protocol, None if values is None else np.asarray(values))


def aborted(state: ClientState) -> ClientState:
    """``state`` moved to ABORTED where that move is allowed (else as it is), input dropped."""
    protocol = state.protocol
    if Stage.ABORTED in TRANSITIONS[protocol.stage]:
        protocol = replace(protocol, stage=Stage.ABORTED)
    return replace(state, protocol=protocol, values=None)


def _entered(state: ClientState, stage: Stage) -> SecAggClient:
    """The client of ``state`` after checking it may enter ``stage`` (StageError if not)."""
    if not isinstance(state, ClientState):
        raise TypeError(f"state must be a ClientState, got {type(state).__name__}")
    client = SecAggClient.from_state(state.protocol)
    check_transition(client.stage, stage, "SecAgg+ client")
    return client


def _run(state: ClientState, stage: Stage, step: Callable[[SecAggClient], Any], keep=False):
    """``step(client)`` on the client of ``state`` in ``stage``: (the new state, the reply), the
    input kept only with ``keep``; a refusal raises :class:`StageRefused` with the state to
    store; a move out of order raises StageError and changes nothing."""
    client = _entered(state, stage)
    try:
        reply = step(client)
    except REFUSALS as error:
        if Stage.ABORTED in TRANSITIONS[client.stage]:
            client.abort()
        raise StageRefused(replace(state, protocol=client.to_state(), values=None), error) from None
    values = state.values if keep else None
    return replace(state, protocol=client.to_state(), values=values), reply


def handle_advertise_keys(
    state: ClientState, message: AdvertiseKeys
) -> tuple[ClientState, AdvertisedKeys]:
    """ADVERTISE_KEYS: the client's two public keys (signed by its identity when enrolled)."""

    def step(client: SecAggClient) -> AdvertisedKeys:
        channel, agreement = client.advertise_keys()
        proof = None if message.identity is None else client.key_proof(message.identity)
        return AdvertisedKeys(channel, agreement, proof)

    return _run(state, Stage.ADVERTISE_KEYS, step, keep=True)


def handle_share_keys(
    state: ClientState, message: ShareKeys
) -> tuple[ClientState, list[Envelope]]:
    """SHARE_KEYS: one sealed share row per neighbour (:meth:`SecAggClient.share_keys`); the
    parameters must be for the state's server round."""

    def step(client: SecAggClient) -> list[Envelope]:
        if message.config.round != state.server_round:
            raise ValueError(
                f"the parameters are for round {message.config.round}, not {state.server_round}"
            )
        return client.share_keys(
            message.client_id,
            message.config,
            message.neighbour_keys,
            contribute=message.contribute,
            proofs=message.proofs,
            verifier=message.verifier,
            own=message.own,
        )

    return _run(state, Stage.SHARE_KEYS, step, keep=True)


def handle_masked_input(
    state: ClientState, message: MaskedInput
) -> tuple[ClientState, np.ndarray | None]:
    """MASKED_INPUT: y = x + masks (:meth:`SecAggClient.masked_input`; None for a client that
    does not contribute); the input leaves the state."""

    def step(client: SecAggClient) -> np.ndarray | None:
        own = None
        if client.contributes:
            try:
                own = client.config.masking.encode_signed(state.values)
            except ValueError:
                raise ValueError(
                    "this client's input does not fit the round's masking space"
                ) from None
        return client.masked_input(message.envelopes, own)

    return _run(state, Stage.MASKED_INPUT, step)


def handle_unmask(state: ClientState, message: Unmask) -> tuple[ClientState, UnmaskResponse]:
    """UNMASK: shares of survivors' self-mask seeds and dropped clients' keys
    (:meth:`SecAggClient.unmask`)."""
    return _run(
        state, Stage.UNMASK, lambda client: client.unmask(message.survivors, message.dropped)
    )


HANDLERS: Mapping[Stage, Callable[[ClientState, Any], tuple[ClientState, Any]]] = {
    Stage.ADVERTISE_KEYS: handle_advertise_keys,
    Stage.SHARE_KEYS: handle_share_keys,
    Stage.MASKED_INPUT: handle_masked_input,
    Stage.UNMASK: handle_unmask,
}
"""The client's stage handlers, by the stage each enters."""


def handle(stage: Stage, state: ClientState, message: Any) -> tuple[ClientState, Any]:
    """:data:`HANDLERS`\\ [stage](state, message); StageError for a stage with no handler."""
    handler = HANDLERS.get(stage)
    if handler is None:
        allowed = ", ".join(s.name for s in HANDLERS)
        raise StageError(f"a SecAgg+ client has no handler for {stage!r}; allowed: {allowed}")
    return handler(state, message)
