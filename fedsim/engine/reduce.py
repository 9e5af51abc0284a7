"""Worker-side partial aggregation: the opt-in interface.

A strategy whose aggregation is a (weighted) sum can let each worker fold the
replies of the clients it ran into one *partial reply*, so a round ships
O(workers) model-sized messages to the server instead of O(clients).

The interface is one :class:`flwr.app.ConfigRecord` in the instruction's
content, under :data:`REDUCER_KEY`, that names a :class:`Reducer` subclass and
its parameters (:meth:`Reducer.to_config`). The grid finds it, and each worker
calls :meth:`Reducer.reduce` on its batch of successful replies. Error replies
are never folded; they come back one per client.

A reducer must be *associative*: ``reduce(P + Q)`` equals
``reduce([reduce(P), reduce(Q)])`` (to float round-off) for any split of the
replies, because the strategy receives partial replies, or raw replies when the
app runs on a runtime without reducers (Flower's own), or a mix. The strategy
may call the same reducer itself on whatever it receives.

:class:`WeightedMean` matches Flower's FedAvg family: a partial reply carries the
weighted mean of its clients' arrays and metrics, with the weight key set to the
sum of their weights, so FedAvg's own ``aggregate_train`` over partial replies
gives the same result as over raw ones. :class:`WorkerReduced` opts any such
strategy in without changing it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from copy import copy
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.records import to_numpy, to_record

REDUCER_KEY = "fedsim.reducer"
_CLASS_KEY = "class"


class ReductionError(ValueError):
    """The replies cannot be folded; the worker then returns them unreduced."""


class Reducer(ABC):
    """Folds client replies (raw or partial) into one partial reply."""

    #: the parameters ``to_config`` writes and ``__init__`` accepts
    params: ClassVar[tuple[str, ...]] = ()

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
    def reduce(self, instruction: RecordDict, replies: Sequence[Message]) -> Message:
        """Fold successful ``replies`` (at least one) to the ``instruction`` content."""


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


def single(records: dict[str, Any], kind: str) -> tuple[str, Any]:
    """The one record of a kind in a reply, as FedAvg requires."""
    if len(records) != 1:
        raise ReductionError(f"expected exactly one {kind} per reply, found {len(records)}")
    return next(iter(records.items()))


def fold_metrics(
    records: Sequence[MetricRecord], weights: np.ndarray, weight_key: str
) -> MetricRecord:
    """Weighted mean of each metric (``weight_key`` set to the total weight).

    Mirrors ``flwr.serverapp.strategy.strategy_utils.aggregate_metricrecords``:
    scalars and lists are averaged with weights ``w_i / sum(w)``. Weighted means
    compose: the mean of partial means weighted by their totals is the mean.
    """
    total = float(weights.sum())
    factors = weights / total if total > 0 else np.full(len(weights), 1.0 / len(weights))
    folded = MetricRecord()
    for key, value in records[0].items():
        if key == weight_key:
            continue
        if isinstance(value, list):
            stacked = np.array([r[key] for r in records], dtype=np.float64)
            folded[key] = (factors @ stacked).tolist()
        else:
            folded[key] = float(factors @ np.array([r[key] for r in records], dtype=np.float64))
    weight_values = [r[weight_key] for r in records]
    folded[weight_key] = (
        int(sum(weight_values)) if all(isinstance(w, int) for w in weight_values) else total
    )
    return folded


class WeightedMean(Reducer):
    """FedAvg's aggregation: ``sum_i w_i x_i / sum_i w_i`` (McMahan et al. 2017, Alg. 1).

    ``w_i`` is the reply's ``weight_key`` metric. Sums run in float64; the result
    is cast back to each array's dtype.
    """

    params = ("weight_key",)

    def __init__(self, weight_key: str = "num-examples") -> None:
        self.weight_key = weight_key

    def reduce(self, instruction: RecordDict, replies: Sequence[Message]) -> Message:
        if not replies:
            raise ReductionError("nothing to reduce")
        array_key, _ = single(replies[0].content.array_records, "ArrayRecord")
        metric_key, _ = single(replies[0].content.metric_records, "MetricRecord")
        metric_records, array_dicts = [], []
        for reply in replies:
            content = reply.content
            single(content.array_records, "ArrayRecord")
            single(content.metric_records, "MetricRecord")
            metrics = content.get(metric_key)
            arrays = content.get(array_key)
            if not isinstance(metrics, MetricRecord) or not isinstance(arrays, ArrayRecord):
                raise ReductionError("replies use different record keys")
            if self.weight_key not in metrics or isinstance(metrics[self.weight_key], list):
                raise ReductionError(f"reply has no scalar weight {self.weight_key!r}")
            metric_records.append(metrics)
            array_dicts.append(to_numpy(arrays))
        weights = np.array([m[self.weight_key] for m in metric_records], dtype=np.float64)
        total = weights.sum()
        factors = weights / total if total > 0 else np.full(len(weights), 1.0 / len(weights))
        keys = list(array_dicts[0])
        if any(list(a) != keys for a in array_dicts[1:]):
            raise ReductionError("replies carry different array keys")
        mean = {}
        for key in keys:
            acc = np.zeros(array_dicts[0][key].shape, dtype=np.float64)
            for factor, arrays in zip(factors, array_dicts, strict=True):
                acc += factor * arrays[key]
            mean[key] = acc.astype(array_dicts[0][key].dtype, copy=False)
        content = RecordDict(
            {
                array_key: to_record(mean),
                metric_key: fold_metrics(metric_records, weights, self.weight_key),
            }
        )
        return partial_reply(replies[0], content)


class WorkerReduced(Strategy):
    """Opt a strategy whose aggregation is a weighted mean into worker-side sums.

    Wraps e.g. ``FedAvg``, ``FedProx``, ``FedAvgM``, ``FedAdam``, ``FedYogi`` or
    ``FedAdagrad`` (all aggregate client arrays with FedAvg's weighted mean before
    their server update) and changes nothing but the instruction messages, which
    gain the :data:`REDUCER_KEY` record. Replies pass to the wrapped strategy
    untouched. Evaluation messages are left alone (their metrics are cheap).
    """

    def __init__(self, strategy: Strategy, reducer: Reducer | None = None) -> None:
        self.strategy = strategy
        self.reducer = reducer or WeightedMean(getattr(strategy, "weighted_by_key", "num-examples"))

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: expose the wrapped strategy's.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        return attach_reducer(messages, self.reducer)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

