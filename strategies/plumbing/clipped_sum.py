"""The clipped sum of client updates: the reducer the central-DP strategies share.

:class:`ClippedSum` is a :class:`~fedsim.worker_reduce.Reducer` over the replies to one train
instruction: ``sum_i clip(x_i - g, C)`` (flattened L2 norm), plus the count of updates it
summed (:data:`CLIENTS_KEY`) and of those it clipped (:data:`CLIPPED_KEY`), so adaptive
clipping's bits need no extra message. Each worker can fold its clients' replies into one
partial sum, and the strategy applies the same reducer to whatever it receives, so the result
is the same with or without worker-side reduction. DP-FedAvg
(:mod:`strategies.methods.dp_fedavg.strategy`) and the central matrix mechanism
(:mod:`strategies.methods.matrix_mechanism`) sum with it, through
:class:`~strategies.plumbing.dp_shell.ClippedSumShell`.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedsim.record_codec import to_numpy, to_record
from fedsim.worker_reduce import (
    Accumulator,
    MetricSums,
    Reducer,
    ReductionError,
    folded_reply,
    is_partial,
    refuse,
    reserved_keys,
    single,
)

#: the clipped sum's bookkeeping metrics: clients summed, clients clipped
CLIENTS_KEY = "fedsim.clients"
CLIPPED_KEY = "fedsim.clipped"
BOOKKEEPING = (CLIENTS_KEY, CLIPPED_KEY)


def clip_factor(norm: float, clipping_norm: float) -> float:
    """``min(1, C / norm)``, with 1 for a zero update."""
    return 1.0 if norm <= clipping_norm else clipping_norm / norm


class ClippedSum(Reducer):
    """``sum_i clip(x_i - g, C)`` over raw replies, plus the sums in partial replies.

    A partial reply (a :class:`~fedsim.worker_reduce.PartialReply`, which only an
    accumulator makes) carries float64 sums and the metrics ``fedsim.clients``
    (updates folded) and ``fedsim.clipped`` (how many had norm > C). Every other
    reply is a client's and is clipped; one that carries a reserved ``fedsim.*``
    key, or arrays that are not finite and shaped like the global model's, is
    refused (its node is listed in the fold's ``rejected``). Client metrics are
    folded as weighted means (weight ``weight_key``).
    """

    params = ("clipping_norm", "weight_key")

    def __init__(self, clipping_norm: float, weight_key: str = "num-examples") -> None:
        if not clipping_norm > 0:
            raise ValueError(f"clipping_norm = {clipping_norm!r}; it must be > 0")
        self.clipping_norm = float(clipping_norm)
        self.weight_key = weight_key

    def accumulator(self, instruction: RecordDict) -> Accumulator:
        return _ClippedSumAccumulator(self, instruction)


class _ClippedSumAccumulator(Accumulator):
    def __init__(self, reducer: ClippedSum, instruction: RecordDict) -> None:
        self.reducer = reducer
        self.global_key, global_record = single(instruction, ArrayRecord)
        self.reference = to_numpy(global_record)
        self.total = {k: np.zeros(v.shape, dtype=np.float64) for k, v in self.reference.items()}
        self.clients = 0
        self.clipped = 0
        self.rejected: list[int] = []
        self.metrics = MetricSums()
        self.metric_key = "metrics"
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        if self.template is None:
            self.template = reply
        if is_partial(reply):
            self._add_partial(reply)
            return
        checked = self._check_raw(reply)
        if isinstance(checked, str):
            refuse(self.rejected, reply, checked)
            return
        deltas, metrics, weight = checked
        norm = float(np.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values())))
        factor = clip_factor(norm, self.reducer.clipping_norm)
        for k in self.total:
            self.total[k] += factor * deltas[k]
        self.clients += 1
        self.clipped += int(norm > self.reducer.clipping_norm)
        self.metrics.add(metrics, weight=weight, skip=(*BOOKKEEPING, self.reducer.weight_key))

    def _add_partial(self, reply: Message) -> None:
        _, arrays = single(reply.content, ArrayRecord)
        self.metric_key, metrics = single(reply.content, MetricRecord)
        values = to_numpy(arrays)
        if values.keys() != self.total.keys():
            raise ReductionError("partial sum arrays do not match the global model's keys")
        for k in self.total:
            self.total[k] += values[k]
        self.clients += int(metrics[CLIENTS_KEY])
        self.clipped += int(metrics[CLIPPED_KEY])
        self.rejected.extend(reply.rejected)
        weight = metrics.get(self.reducer.weight_key, 1)
        self.metrics.add(
            metrics,
            weight=float(weight) if isinstance(weight, (int, float)) else 1.0,
            skip=(*BOOKKEEPING, self.reducer.weight_key),
        )

    def _check_raw(self, reply: Message) -> tuple[dict[str, np.ndarray], MetricRecord, float] | str:
        """A client reply's update ``x_i - g``, metrics and weight, or why it is refused."""
        reserved = reserved_keys(reply.content)
        if reserved:
            return f"it carries keys reserved for the engine: {', '.join(reserved)}"
        try:
            _, arrays = single(reply.content, ArrayRecord)
            _, record = single(reply.content, MetricRecord)
            values = to_numpy(arrays)
        except (ReductionError, ValueError, TypeError) as err:
            return str(err)
        if values.keys() != self.total.keys():
            return f"its arrays {sorted(values)} are not the global model's {sorted(self.total)}"
        for key, value in values.items():
            expected = self.reference[key].shape
            if value.shape != expected or value.dtype.kind not in "iuf":
                return f"array {key!r} is {value.dtype}{list(value.shape)}, not {list(expected)}"
            if not np.isfinite(value).all():
                return f"array {key!r} holds NaN or infinite values"
        weight = record.get(self.reducer.weight_key, 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            0 <= weight < math.inf
        ):
            return f"its weight {self.reducer.weight_key!r} = {weight!r} is not a number >= 0"
        deltas = {k: values[k].astype(np.float64) - self.reference[k] for k in self.total}
        return deltas, record, float(weight)

    def result(self) -> Message:
        if self.template is None:
            raise ReductionError("nothing to reduce")
        folded = self.metrics.record(self.reducer.weight_key)
        folded[CLIENTS_KEY] = self.clients
        folded[CLIPPED_KEY] = self.clipped
        content = RecordDict({self.global_key: to_record(self.total), self.metric_key: folded})
        return folded_reply(self.template, content, self.rejected)
