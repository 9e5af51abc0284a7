"""``secagg``: SecAgg+ (Bell et al., CCS 2020) over the Grid, as a :class:`SecureSum`.

The train instruction carries the round's public SecAgg+ session id (``<prefix>session``);
each client masks before anything leaves its ClientApp: its first reply holds only its two
public keys (``secagg.keys``, :func:`strategies.secure.secagg_client_stages.start_client`), and the
server then runs SHARE_KEYS, MASKED_INPUT and UNMASK as three more message exchanges through the
round's Grid (:func:`strategies.secure.secagg_messages.run_over_grid`). The server holds public
keys, sealed share rows it relays, masked inputs and its own protocol state; it learns the modular
sum of the survivors' inputs and nothing else about them, against an honest-but-curious
server (relayed keys are checked by enrolled clients, :mod:`strategies.secure.secagg_messages`).

:class:`~strategies.secure.secagg_plan.SecAggPlan` holds the round's public SecAgg+
parameters (neighbour degree, ring, simulated protocol dropouts drawn from the run seed), shared
with the ``plaintext`` simulation so that both reach the same outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedsim.config import require
from fedsim.randomness import PartySecret, Stream, public_generator
from protocols.channels import new_session_id
from protocols.field import DEFAULT_FIELD
from protocols.secagg.common import SecAggKeys
from protocols.secagg.prg import PRG_ALLOWED, PRG_NAMES
from strategies.secure import secagg_client_stages
from strategies.secure.release import Release, SecureSum, SumArguments, SumOptions
from strategies.secure.secagg_client_stages import start_client
from strategies.secure.secagg_messages import keys_from, run_over_grid
from strategies.secure.secagg_plan import SecAggPlan


def contribute(
    context: Context,
    secret: PartySecret,
    config: ConfigRecord,
    elements: np.ndarray,
    server_round: int,
    prefix: str,
) -> RecordDict:
    """ADVERTISE_KEYS on the client: keep the signed input in the client's state (its
    protocol seed from its own secret) and reply its two public keys only."""
    signed = DEFAULT_FIELD.decode_signed(elements)
    return contribute_signed(context, secret, config, signed, server_round, prefix)


def contribute_signed(
    context: Context,
    secret: PartySecret,
    config: ConfigRecord,
    signed: np.ndarray,
    server_round: int,
    prefix: str,
) -> RecordDict:
    """:func:`contribute` of the signed integers themselves (no round trip through F_p: the
    state keeps them signed, and MASKED_INPUT maps them to the round's masking space)."""
    return start_client(context, server_round, config[prefix + SecAggKeys.SESSION], signed)


@dataclass(frozen=True)
class SecAggOptions(SumOptions):
    """SecAgg+'s ``strategy.options`` under a FedAvg-family strategy: ``secagg_degree``
    (neighbours per client; unset: the complete graph), ``stage_timeout`` (seconds each
    exchange waits) and ``prg`` (the mask PRG, :class:`protocols.secagg.prg.MaskPRG`'s
    names; unset: ``chacha20``). Part of the round's plan, so every secure sum takes them."""

    secagg_degree: int | None = None
    stage_timeout: float | None = None
    prg: str | None = None

    def check(self, where: str) -> None:
        degree = self.secagg_degree
        require(
            degree is None or (degree >= 2 and degree % 2 == 0),
            f"{where}.secagg_degree",
            degree,
            "an even integer >= 2 (neighbours per client; unset: all)",
        )
        require(self.prg is None or self.prg in PRG_NAMES, f"{where}.prg", self.prg, PRG_ALLOWED)

    def arguments(self) -> dict[str, Any]:
        """``secagg_degree`` and ``stage_timeout`` as the wrapper's own keywords; every other
        key of this class is a :class:`SecAggPlan` field of the same name (``secagg_plan``),
        so a new SecAgg+ option is a field here and the plan's field it sets."""
        own = ("secagg_degree", "stage_timeout")
        out = {k: getattr(self, k) for k in own if getattr(self, k) is not None}
        plan = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SecAggOptions)
            if f.name not in own and getattr(self, f.name) is not None
        }
        return {**out, "secagg_plan": plan} if plan else out


class SecAggSum(SecureSum):
    """SecAgg+ over the round's Grid; ``stage_timeout``: seconds each exchange waits."""

    name = "secagg"
    reply_kind = ConfigRecord
    options_type = SecAggOptions

    def __init__(self, prefix: str, plan: SecAggPlan, stage_timeout: float | None) -> None:
        super().__init__(prefix)
        self.plan = plan
        self.stage_timeout = stage_timeout
        self._session: bytes | None = None
        self._grid: Grid | None = None

    @classmethod
    def from_arguments(cls, arguments: SumArguments) -> SecAggSum:
        return cls(arguments.prefix, arguments.plan, arguments.stage_timeout)

    contribute = staticmethod(contribute)

    @classmethod
    def contribute_signed(cls, context, secret, config, signed, server_round, prefix):
        return contribute_signed(context, secret, config, signed, server_round, prefix)

    @classmethod
    def register_client_stages(cls, app: ClientApp) -> None:
        """SHARE_KEYS, MASKED_INPUT and UNMASK on the client (``query.secagg_*``)."""
        secagg_client_stages.register_client_stages(app)

    @property
    def reply_key(self) -> str:
        return SecAggKeys.KEYS

    def instruct(self, server_round: int, config: ConfigRecord, grid: Grid | None) -> None:
        """A fresh public session id for the round's channels (``<prefix>session``)."""
        self._session = new_session_id()
        config[self.prefix + SecAggKeys.SESSION] = self._session
        super().instruct(server_round, config, grid)

    def payload(self, record: Any, length: int) -> tuple:
        """The client's (channel, agreement[, proof]) public keys; the proof, relayed with
        the keys, is the clients' to check."""
        return keys_from(record)

    def finish(self, server_round: int, payloads: Mapping[int, Any], length: int) -> Release:
        """SHARE_KEYS, MASKED_INPUT and UNMASK over the Grid; the total back in F_p (from the
        ring when ``ring_bits``)."""
        plan = self.plan
        outcome = run_over_grid(
            self._grid,
            server_round=server_round,
            session=self._session,
            public_keys=payloads,
            config_for=lambda count: plan.config(server_round, count, length),
            graph_rng=public_generator(plan.seed, server_round, Stream.COMMITTEE, 1),
            timeout=self.stage_timeout,
            silent=plan.dropouts(server_round, sorted(payloads)),
        )
        total = outcome.aggregate
        if total is not None and outcome.config.ring_bits is not None:
            total = DEFAULT_FIELD.encode_signed(outcome.config.masking.decode_signed(total))
        return Release(
            total,
            outcome.survivors,
            outcome.rejected,
            outcome.aborted,
            outcome.stage.name,
            outcome.refused,
            opened=outcome.opened,
        )
