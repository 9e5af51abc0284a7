"""Worker-side partial aggregation: the contract between strategies, workloads and the engine.

A strategy whose aggregation is a (weighted) sum can let each worker fold the
replies of the clients it ran into one *partial reply*, so a round ships
O(workers) model-sized messages to the server instead of O(clients).

The interface is one :class:`flwr.app.ConfigRecord` in the instruction's
content, under :data:`REDUCER_KEY`, that names a :class:`Reducer` subclass and
its parameters (:meth:`Reducer.to_config`). The grid finds it and cuts the sorted
messages into fixed fold chunks (:func:`fold_chunk_size`); each worker folds each chunk's
successful replies into an :class:`Accumulator` as they come (:class:`ChunkedFold`), and
the grid folds the chunks' partial replies, in chunk order, into one reply for the
strategy, so the result does not depend on the number of workers. Error replies are never
folded; they come back one per client.

A reducer must be *associative*: ``reduce(P + Q)`` equals
``reduce([reduce(P), reduce(Q)])`` (to float round-off) for any split of the
replies, because the strategy receives partial replies, or raw replies when the
app runs on a runtime without reducers (Flower's own), or a mix. The strategy
may call the same reducer itself on whatever it receives.

:class:`WeightedMean` matches Flower's FedAvg family: a partial reply carries the
weighted mean of its clients' arrays and metrics, with the weight key set to the
sum of their weights, so FedAvg's own ``aggregate_train`` over partial replies
gives the same result as over raw ones. ``strategies.plumbing.worker_reduced.WorkerReduced`` opts
any such strategy in without changing it.

:class:`MetricSums` are weighted metric sums, additive so they can be split and merged
freely: each worker adds the metrics of the replies it produced (weighted by
``num-examples``) so run records show client-weighted means whether or not replies were
folded on the workers, and reducers fold metrics the way Flower's
``aggregate_metricrecords`` does (scalars and lists, weighted means). A metric whose values
disagree in shape between replies (a list of 3 where others sent 2) cannot be averaged: it
is left out of the means from then on (``conflicts``, logged once) rather than failing the
fold for everyone.

Partial sums that skip a per-client step (clipping, counting) are trusted only
as :class:`PartialReply` objects, which only an accumulator makes: a client's
reply is a plain Flower ``Message`` whatever its content says (Flower's runtime
delivers nothing else, and the worker refuses a ClientApp that returns a
PartialReply), so no client can pass its update off as an already-clipped sum.
Keys under ``fedsim.`` are reserved for the engine's own bookkeeping; a raw
reply that carries one is refused (:func:`reserved_keys`).

This module imports nothing of fedsim's but :mod:`fedsim.record_codec` (both flwr and numpy
only), so strategies and workloads use it without importing the engine.
"""

from __future__ import annotations

import importlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedsim.record_codec import R, records_of, to_numpy, to_record

REDUCER_KEY = "fedsim.reducer"
#: set (True) in every client's ``node_config`` by fedsim's workers: they fold the replies to an
#: instruction with a :attr:`Reducer.confidential` reducer inside the worker and never let those
#: raw replies out (Flower's runtime does not set it, so a client there must seal by itself)
FOLDS_KEY = "fedsim.worker-folds"
_CLASS_KEY = "class"
#: names and keys starting with this are the engine's; a client reply carrying one is refused
RESERVED_PREFIX = "fedsim."

#: the metric a reply's weight is read from when no other key is named
WEIGHT_KEY = "num-examples"

log = logging.getLogger(__name__)


class ExactSum:
    """A sum of floats kept exactly, as non-overlapping partials (Shewchuk 1997, the
    algorithm of ``math.fsum``): :meth:`value` is the exact sum rounded once, so it is the
    same bits for any order and any grouping of the terms (:meth:`merge` of sums of any split
    equals adding every term to one). Infinities and NaNs are summed apart (IEEE addition of
    those is associative and commutative)."""

    __slots__ = ("partials", "special")

    def __init__(self) -> None:
        self.partials: list[float] = []
        self.special = 0.0

    def add(self, x: float) -> None:
        x = float(x)
        if not math.isfinite(x):
            self.special += x
            return
        kept = 0
        for y in self.partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                self.partials[kept] = low
                kept += 1
            x = high
        self.partials[kept:] = [x]

    def merge(self, other: ExactSum) -> None:
        for x in other.partials:
            self.add(x)
        self.special += other.special

    def value(self) -> float:
        if self.special or math.isnan(self.special):
            return self.special
        try:
            return math.fsum(self.partials)
        except OverflowError:
            return math.copysign(math.inf, sum(self.partials))

    def __getstate__(self) -> tuple[list[float], float]:
        return self.partials, self.special

    def __setstate__(self, state: tuple[list[float], float]) -> None:
        self.partials, self.special = state


def _exact(values: Iterable[float]) -> ExactSum:
    total = ExactSum()
    for value in values:
        total.add(value)
    return total


@dataclass
class MetricSums:
    """``sum_i w_i m_i`` and ``sum_i w_i`` per metric key (scalars and lists).

    Every sum is an :class:`ExactSum`, so the means do not depend on the order in which
    replies were added or on how the replies were split between sums later merged: a worker's
    batch, a phase's batches in whatever order they finish and the whole cohort at once give
    the same bits (each term ``w_i m_i`` is one product per reply, the same everywhere).
    """

    weighted: dict[str, ExactSum | list[ExactSum]] = field(default_factory=dict)
    weights: dict[str, ExactSum] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    total_sum: ExactSum = field(default_factory=ExactSum)
    conflicts: set[str] = field(default_factory=set)

    @property
    def total(self) -> float:
        """``sum_i w_i`` over every record added."""
        return self.total_sum.value()

    def _drop(self, key: str) -> None:
        self.conflicts.add(key)
        for table in (self.weighted, self.weights, self.shapes):
            table.pop(key, None)

    def _accumulate(
        self, key: str, shape: tuple[int, ...], terms: list[ExactSum], weight: ExactSum
    ) -> None:
        if key in self.conflicts:
            return
        previous = self.shapes.get(key)
        if previous is not None and previous != shape:
            log.warning(
                "metric %r has shape %s in one reply and %s in another; it is left out",
                key,
                shape,
                previous,
            )
            self._drop(key)
            return
        if previous is None:
            self.shapes[key] = shape
            self.weighted[key] = [ExactSum() for _ in terms] if shape else ExactSum()
            self.weights[key] = ExactSum()
        held = self.weighted[key]
        for mine, term in zip(held if isinstance(held, list) else [held], terms, strict=True):
            mine.merge(term)
        self.weights[key].merge(weight)

    def add(
        self, record: MetricRecord, weight: float | None = None, skip: tuple[str, ...] = ()
    ) -> None:
        """Add a record with ``weight`` (default: its ``num-examples``, else 1)."""
        if weight is None:
            value = record.get(WEIGHT_KEY, 1)
            weight = float(value) if isinstance(value, (int, float)) else 1.0
        weight = float(weight)
        self.total_sum.add(weight)
        for key, value in record.items():
            if key == WEIGHT_KEY or key in skip:
                continue
            if isinstance(value, list):
                term = weight * np.asarray(value, dtype=np.float64)
                shape: tuple[int, ...] = term.shape
                terms = [_exact((x,)) for x in term.reshape(-1).tolist()]
            else:
                shape, terms = (), [_exact((weight * float(value),))]
            self._accumulate(key, shape, terms, _exact((weight,)))

    def merge(self, other: MetricSums) -> None:
        self.total_sum.merge(other.total_sum)
        for key in other.conflicts - self.conflicts:
            self._drop(key)
        for key, held in other.weighted.items():
            terms = held if isinstance(held, list) else [held]
            self._accumulate(key, other.shapes[key], terms, other.weights[key])

    def means(self) -> dict[str, float | list[float]]:
        """Weighted mean of each metric (keys with zero total weight are left out)."""
        out: dict[str, float | list[float]] = {}
        for key, held in self.weighted.items():
            weight = self.weights[key].value()
            if weight > 0:
                if isinstance(held, list):
                    mean = np.array([s.value() for s in held]).reshape(self.shapes[key]) / weight
                    out[key] = mean.tolist()
                else:
                    out[key] = held.value() / weight
        return out

    def record(self, weight_key: str) -> MetricRecord:
        """The means as a MetricRecord with ``weight_key`` set to the total weight."""
        record = MetricRecord(self.means())
        total = self.total
        record[weight_key] = int(total) if float(total).is_integer() else total
        return record


class ReductionError(ValueError):
    """The replies cannot be folded; the worker then returns them unreduced."""


class Accumulator(ABC):
    """Folds replies one at a time; :meth:`result` is the partial reply."""

    @abstractmethod
    def add(self, reply: Message) -> None:
        """Fold in one successful reply (raw or partial)."""

    @abstractmethod
    def result(self) -> Message:
        """The partial reply of everything added (ReductionError if nothing was)."""


class Reducer(ABC):
    """Folds client replies (raw or partial) into one partial reply."""

    #: the parameters ``to_config`` writes and ``__init__`` accepts
    params: ClassVar[tuple[str, ...]] = ()
    #: True: raw replies hold what only the fold may see (a secure protocol's inputs, which the
    #: fold seals); a worker never ships them: replies it cannot fold become failed replies,
    #: and its ``bytes_up`` counts the folded reply, the bytes that leave it
    confidential: ClassVar[bool] = False
    #: True: the fold is exact (integer or field arithmetic), so its result is the same for
    #: any split of the replies; the grid then folds whole batches, not fold chunks
    #: (:func:`fold_chunk_size`), which a floating-point fold needs to give the same bits on
    #: every backend
    exact: ClassVar[bool] = False

    def to_config(self) -> ConfigRecord:
        """This reducer as a ConfigRecord: its import path plus its parameters."""
        cls = type(self)
        record = ConfigRecord({_CLASS_KEY: f"{cls.__module__}:{cls.__qualname__}"})
        for name in self.params:
            record[name] = getattr(self, name)
        return record

    @staticmethod
    def from_config(record: ConfigRecord) -> Reducer:
        """Rebuild a reducer from :meth:`to_config`'s record (imports its module)."""
        path = str(record.get(_CLASS_KEY, ""))
        module_name, _, qualname = path.partition(":")
        try:
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError, ValueError) as err:
            raise ReductionError(f"cannot import reducer {path!r}: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, Reducer)):
            raise ReductionError(f"{path!r} is not a fedsim Reducer subclass")
        return cls(**{k: record[k] for k in cls.params if k in record})

    @abstractmethod
    def accumulator(self, instruction: RecordDict) -> Accumulator:
        """A fresh accumulator for replies to the ``instruction`` content."""

    def reduce(self, instruction: RecordDict, replies: Sequence[Message]) -> Message:
        """Fold ``replies`` (at least one) in order."""
        accumulator = self.accumulator(instruction)
        for reply in replies:
            accumulator.add(reply)
        return accumulator.result()


#: a content group's sorted replies are folded in at most this many fixed chunks
FOLD_CHUNKS = 64


def fold_chunk_size(num_messages: int) -> int:
    """Messages per fold chunk for a group of ``num_messages`` instructions (one content).

    The chunks are fixed by the cohort alone: chunk ``k`` is the messages ``k c .. (k+1) c - 1``
    of the group sorted by node id, ``c = ceil(n / FOLD_CHUNKS)``. Every batch holds whole
    chunks; a worker folds each chunk's replies, in order, into one partial reply; the grid
    folds the chunk partials in chunk order. The sequence of floating-point operations is then
    a function of the cohort and of which clients replied, never of how many workers there are
    or how the chunks were spread over batches, so every backend gives the same bits.
    """
    if num_messages < 0:
        raise ValueError(f"num_messages = {num_messages!r}; it must be >= 0")
    return max(1, math.ceil(num_messages / FOLD_CHUNKS))


class ChunkedFold:
    """A worker's fold of one batch: one accumulator per fold chunk (:func:`fold_chunk_size`).

    ``add(position, reply)`` takes the batch's replies in order, ``position`` counted from the
    batch's first message (a chunk boundary; ``chunk`` None: the batch is one chunk);
    :meth:`results` is one partial reply per chunk
    with at least one reply, in chunk order. A :class:`ReductionError` of any chunk reaches
    the caller, who then ships the batch's replies unfolded.
    """

    def __init__(self, reducer: Reducer, instruction: RecordDict, chunk: int | None) -> None:
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk = {chunk!r}; it must be >= 1 (or None: one chunk)")
        self.reducer, self.instruction, self.chunk = reducer, instruction, chunk
        self._folds: dict[int, Accumulator] = {}

    def add(self, position: int, reply: Message) -> None:
        index = 0 if self.chunk is None else position // self.chunk
        accumulator = self._folds.get(index)
        if accumulator is None:
            accumulator = self._folds[index] = self.reducer.accumulator(self.instruction)
        accumulator.add(reply)

    def results(self) -> list[Message]:
        return [self._folds[index].result() for index in sorted(self._folds)]


def reducer_of(content: RecordDict) -> Reducer | None:
    """The reducer an instruction's content opts into, or None."""
    record = content.get(REDUCER_KEY)
    if isinstance(record, ConfigRecord):
        return Reducer.from_config(record)
    return None


def attach_reducer(messages: Iterable[Message], reducer: Reducer) -> list[Message]:
    """Opt ``messages`` into worker-side reduction (contents shared between messages
    are updated once)."""
    messages = list(messages)
    seen: set[int] = set()
    for message in messages:
        content = message.content
        if id(content) not in seen:
            seen.add(id(content))
            content[REDUCER_KEY] = reducer.to_config()
    return messages


def partial_reply(template: Message, content: RecordDict) -> Message:
    """A reply carrying ``content`` with the metadata of reply ``template``."""
    return Message(content=content, metadata=copy(template.metadata))


class PartialReply(Message):
    """A fold of client replies, made by an :class:`Accumulator` (:func:`folded_reply`).

    ``rejected`` holds the node ids of the raw replies the fold refused, in the
    order met. Reducers take the partial-sum path for this type only.
    """

    rejected: tuple[int, ...] = ()


def folded_reply(
    template: Message, content: RecordDict, rejected: Iterable[int] = ()
) -> PartialReply:
    """A :class:`PartialReply` carrying ``content``, with the metadata of ``template``."""
    reply = PartialReply(content=content, metadata=copy(template.metadata))
    reply.rejected = tuple(int(node) for node in rejected)
    return reply


def is_partial(reply: Message) -> bool:
    """Whether ``reply`` is an accumulator's fold (never true of a client's reply)."""
    return isinstance(reply, PartialReply)


def reserved_keys(content: RecordDict) -> list[str]:
    """Record names, and keys of metric and config records, under :data:`RESERVED_PREFIX`."""
    found = [name for name in content if name.startswith(RESERVED_PREFIX)]
    for name, record in content.items():
        if isinstance(record, (MetricRecord, ConfigRecord)):
            found += [f"{name}.{k}" for k in record if k.startswith(RESERVED_PREFIX)]
    return found


def refuse(rejected: list[int], reply: Message, reason: str) -> None:
    """Drop a raw ``reply`` from a fold: name its node in ``rejected`` and log why."""
    node = int(reply.metadata.src_node_id)
    rejected.append(node)
    log.warning("reply of node %d refused: %s", node, reason)


def single(content: RecordDict, kind: type[R]) -> tuple[str, R]:
    """The one record of a kind in a message's content, as FedAvg requires."""
    found = records_of(content, kind)
    if len(found) != 1:
        raise ReductionError(f"expected exactly one {kind.__name__} per reply, found {len(found)}")
    return found[0]


def reply_weight(metrics: MetricRecord, weight_key: str) -> float:
    """The scalar weight of a reply (ReductionError if it has none)."""
    weight = metrics.get(weight_key)
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        raise ReductionError(f"reply has no scalar weight {weight_key!r}")
    return float(weight)


class WeightedMean(Reducer):
    """FedAvg's aggregation: ``sum_i w_i x_i / sum_i w_i`` (McMahan et al. 2017, Alg. 1).

    ``w_i`` is the reply's ``weight_key`` metric; metrics are averaged with the
    same weights (as Flower's ``aggregate_metricrecords``). A partial reply is
    the weighted mean of what it folds with ``weight_key`` set to the total
    weight, so folding partials gives the mean of all. As in Flower's FedAvg,
    arithmetic is in the arrays' own floating dtype.
    """

    params = ("weight_key",)

    def __init__(self, weight_key: str = "num-examples") -> None:
        self.weight_key = weight_key

    def accumulator(self, instruction: RecordDict) -> Accumulator:
        return _WeightedMeanAccumulator(self.weight_key)


class _WeightedMeanAccumulator(Accumulator):
    def __init__(self, weight_key: str) -> None:
        self.weight_key = weight_key
        self.values: list[dict[str, np.ndarray]] = []
        self.weights: list[float] = []
        self.metrics = MetricSums()
        self.keys: tuple[str, str] | None = None
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        array_key, arrays = single(reply.content, ArrayRecord)
        metric_key, metrics = single(reply.content, MetricRecord)
        weight = reply_weight(metrics, self.weight_key)
        values = to_numpy(arrays)
        if self.keys is None:
            self.keys, self.template = (array_key, metric_key), reply
        elif self.keys != (array_key, metric_key) or values.keys() != self.values[0].keys():
            raise ReductionError("replies carry different records or array keys")
        else:
            first = self.values[0]
            for key, value in values.items():
                if value.shape != first[key].shape:
                    raise ReductionError(
                        f"array {key!r} has shape {value.shape}, expected {first[key].shape}"
                    )
        self.values.append(values)  # read-only views of the reply's payload
        self.weights.append(weight)
        self.metrics.add(metrics, weight=weight, skip=(self.weight_key,))

    def result(self) -> Message:
        if self.keys is None or self.template is None:
            raise ReductionError("nothing to reduce")
        weights = np.array(self.weights)
        mean = {
            key: weighted_mean([v[key] for v in self.values], weights) for key in self.values[0]
        }
        array_key, metric_key = self.keys
        content = RecordDict(
            {array_key: to_record(mean), metric_key: self.metrics.record(self.weight_key)}
        )
        return partial_reply(self.template, content)


def weighted_mean(arrays: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """``sum_i w_i a_i / sum_i w_i`` in the arrays' floating dtype (at least float32); equal
    weights when all weights are 0.

    The terms are added one after another, elementwise, in the order given: IEEE elementwise
    arithmetic, not a BLAS product whose summation order may follow the process's thread
    count, so the same inputs give the same bits in any process."""
    first = arrays[0]
    dtype = np.promote_types(
        first.dtype if np.issubdtype(first.dtype, np.floating) else np.float64, np.float32
    )
    total = weights.sum()
    factors = weights / total if total > 0 else np.full(len(weights), 1.0 / len(weights))
    factors = factors.astype(dtype)
    out = np.multiply(np.asarray(first, dtype=dtype), factors[0])
    for factor, array in zip(factors[1:], arrays[1:], strict=True):
        out += np.multiply(np.asarray(array, dtype=dtype), factor)
    return out.reshape(first.shape).astype(first.dtype, copy=False)
