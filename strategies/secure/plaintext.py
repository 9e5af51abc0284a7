"""``plaintext``: SecAgg+'s outcome simulated with the inputs in the clear, for fast studies.

Each client's input (its field elements) reaches the server in the clear (``<prefix>encoded``),
and the server sums them itself: nothing about the server's view is secure. The sum reproduces
what SecAgg+ (Bell et al., CCS 2020; :mod:`strategies.secure.secagg`) reaches on the complete
graph under the same public protocol dropouts (:class:`~strategies.secure.secagg_plan.SecAggPlan`):
the clients lost before MASKED_INPUT are left out, and a round with too few clients at any
stage releases nothing -- so a study in plaintext mode accounts the same releases as one over
SecAgg+, bit for bit, with the same client secrets and dropouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedsim.randomness import PartySecret
from fedsim.record_codec import to_numpy, to_record
from protocols.field import DEFAULT_FIELD
from protocols.kit import TooManyDropoutsError
from protocols.secagg.common import Stage, integer_vector
from strategies.secure.release import Release, SecureSum, SumArguments
from strategies.secure.secagg_plan import SecAggPlan

_BEFORE_INPUT = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT)


def encoded_key(prefix: str) -> str:
    """The reply record holding a client's elements in the clear."""
    return prefix + "encoded"


def contribute(
    context: Context,
    secret: PartySecret,
    config: ConfigRecord,
    elements: np.ndarray,
    server_round: int,
    prefix: str,
) -> RecordDict:
    """The client's elements, in the clear."""
    key = encoded_key(prefix)
    return RecordDict({key: to_record({key: elements})})


class PlaintextSum(SecureSum):
    """The server sums the clients' elements in the clear, as SecAgg+ would under ``plan``."""

    name = "plaintext"
    hides_inputs = False
    reply_kind = ArrayRecord

    def __init__(self, prefix: str, plan: SecAggPlan) -> None:
        super().__init__(prefix)
        self.plan = plan

    @classmethod
    def from_arguments(cls, arguments: SumArguments) -> PlaintextSum:
        return cls(arguments.prefix, arguments.plan)

    contribute = staticmethod(contribute)

    @property
    def reply_key(self) -> str:
        return encoded_key(self.prefix)

    def payload(self, record: Any, length: int) -> np.ndarray:
        """The client's ``length`` field elements."""
        key = self.reply_key
        if not isinstance(record, ArrayRecord):
            raise ValueError(f"{key} must be an ArrayRecord, not a {type(record).__name__}")
        arrays = to_numpy(record)
        if list(arrays) != [key]:
            raise ValueError(f"the encoding must be one array named {key!r}")
        return integer_vector(arrays[key], DEFAULT_FIELD, length, "the encoding")

    def sum_in_clear(
        self, server_round: int, inputs: Mapping[int, np.ndarray]
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """(sum_i inputs[i] mod p, the contributors): the outcome SecAgg+ reaches on the
        complete graph under the round's protocol dropouts. Raises
        :class:`protocols.kit.TooManyDropoutsError` when the round cannot complete."""
        ids = sorted(inputs)
        dropouts = self.plan.dropouts(server_round, ids)
        config = self.plan.config(server_round, len(ids), inputs[ids[0]].size)
        advertised = [i for i in ids if i not in dropouts.get(Stage.ADVERTISE_KEYS, ())]
        gone = set().union(*(dropouts.get(stage, set()) for stage in _BEFORE_INPUT))
        contributors = [i for i in ids if i not in gone]
        responders = [i for i in contributors if i not in dropouts.get(Stage.UNMASK, ())]
        if (
            len(advertised) - 1 < config.threshold
            or len(contributors) < config.survivors_needed
            or len(responders) < config.threshold
        ):
            raise TooManyDropoutsError(
                f"round {server_round}: {len(contributors)} clients contributed and "
                f"{len(responders)} answered in UNMASK; at least {config.threshold} needed"
            )
        total = DEFAULT_FIELD.sum(np.stack([inputs[i] for i in contributors]), axis=0)
        return total, tuple(contributors)

    def finish(self, server_round: int, payloads: Mapping[int, Any], length: int) -> Release:
        if len(payloads) < 1:
            return Release(None, aborted=f"round {server_round}: no client contributed")
        try:
            total, contributors = self.sum_in_clear(server_round, payloads)
        except TooManyDropoutsError as error:
            return Release(None, aborted=str(error))
        return Release(total, contributors)
