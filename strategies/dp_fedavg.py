"""Client-level DP-FedAvg with fixed clipping, as a Flower strategy wrapper.

DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Alg. 1) replaces FedAvg's weighted mean by a noisy mean of
clipped client updates:

    Delta_i   = x_i - g                                   (client update)
    clip(v,C) = v * min(1, C / ||v||_2)                   (flattened L2 norm)
    Delta_bar = (sum_i clip(Delta_i, C) + N(0, (z C)^2 I)) / m

with ``z`` the noise multiplier and ``m`` the *expected* number of clients per
round (the cohort size for fixed-size sampling, ``q N`` for Poisson sampling),
never the number that replied, so that the sensitivity of the sum is ``C``.

The clipped sum is a :class:`~fedsim.engine.reduce.Reducer`: each worker can
fold its clients' replies into one partial sum (:class:`ClippedSum`), and the
strategy applies the same reducer to whatever it receives, so the result is the
same with or without worker-side reduction, and on Flower's own runtime.

The wrapped strategy (FedAvg, FedAdam, ...) then receives a single reply whose
arrays are ``g + Delta_bar``: FedAvg returns it as the new model, server
optimisers apply their update to the pseudo-gradient ``-Delta_bar``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.reduce import (
    ReductionError,
    Reducer,
    attach_reducer,
    fold_metrics,
    partial_reply,
    single,
)
from fedsim.records import to_numpy, to_record

CLIENTS_KEY = "fedsim.clients"
CLIPPED_KEY = "fedsim.clipped"
_BOOKKEEPING = (CLIENTS_KEY, CLIPPED_KEY)


def clip_factor(norm: float, clipping_norm: float) -> float:
    """``min(1, C / norm)``, with 1 for a zero update."""
    return 1.0 if norm <= clipping_norm else clipping_norm / norm


class ClippedSum(Reducer):
    """``sum_i clip(x_i - g, C)`` over raw replies, plus the sums in partial replies.

    A partial reply carries float64 sums and the metrics ``fedsim.clients``
    (updates folded) and ``fedsim.clipped`` (how many had norm > C). Client
    metrics are folded as weighted means (weight ``weight_key``).
    """

    params = ("clipping_norm", "weight_key")

    def __init__(self, clipping_norm: float, weight_key: str = "num-examples") -> None:
        if not clipping_norm > 0:
            raise ValueError(f"clipping_norm = {clipping_norm!r}; it must be > 0")
        self.clipping_norm = float(clipping_norm)
        self.weight_key = weight_key

    def reduce(self, instruction: RecordDict, replies: Sequence[Message]) -> Message:
        if not replies:
            raise ReductionError("nothing to reduce")
        global_key, global_record = single(instruction.array_records, "ArrayRecord")
        reference = to_numpy(global_record)
        total = {k: np.zeros(v.shape, dtype=np.float64) for k, v in reference.items()}
        clients = clipped = 0
        client_metrics: list[MetricRecord] = []
        weights: list[float] = []
        metric_key = None
        for reply in replies:
            array_key, arrays = single(reply.content.array_records, "ArrayRecord")
            metric_key, metrics = single(reply.content.metric_records, "MetricRecord")
            values = to_numpy(arrays)
            if values.keys() != total.keys():
                raise ReductionError("reply arrays do not match the global model's keys")
            if CLIENTS_KEY in metrics:  # already a clipped partial sum
                for k in total:
                    total[k] += values[k]
                clients += int(metrics[CLIENTS_KEY])
                clipped += int(metrics[CLIPPED_KEY])
            else:
                deltas = {k: values[k].astype(np.float64) - reference[k] for k in total}
                norm = float(np.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values())))
                factor = clip_factor(norm, self.clipping_norm)
                for k in total:
                    total[k] += factor * deltas[k]
                clients += 1
                clipped += int(norm > self.clipping_norm)
            weight = metrics.get(self.weight_key, 1)
            weights.append(float(weight) if isinstance(weight, (int, float)) else 1.0)
            client_metrics.append(
                MetricRecord({k: v for k, v in metrics.items() if k not in _BOOKKEEPING})
            )
        for record, weight in zip(client_metrics, weights, strict=True):
            record[self.weight_key] = weight
        folded = fold_metrics(client_metrics, np.array(weights), self.weight_key)
        folded[CLIENTS_KEY] = clients
        folded[CLIPPED_KEY] = clipped
        content = RecordDict({global_key: to_record(total), str(metric_key): folded})
        return partial_reply(replies[0], content)


class DPFedAvg(Strategy):
    """Wrap a FedAvg-family strategy with client-level DP (fixed clipping).

    Args:
        strategy: the wrapped strategy (samples, configures, applies the server update).
        clipping_norm: ``C``, the L2 bound on each client's update.
        noise_multiplier: ``z``; the sum's noise has standard deviation ``z C``.
        expected_clients: ``m``, the expected number of clients per round.
        rng: the generator of the Gaussian noise.
        worker_reduction: let workers fold clipped sums (same result, less traffic).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        clipping_norm: float,
        noise_multiplier: float,
        expected_clients: float,
        rng: np.random.Generator,
        worker_reduction: bool = True,
    ) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier = {noise_multiplier!r}; it must be >= 0")
        if not expected_clients > 0:
            raise ValueError(f"expected_clients = {expected_clients!r}; it must be > 0")
        self.strategy = strategy
        self.reducer = ClippedSum(clipping_norm, getattr(strategy, "weighted_by_key", "num-examples"))
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = float(expected_clients)
        self.rng = rng
        self.worker_reduction = worker_reduction
        self._global: tuple[str, ArrayRecord] | None = None

    @property
    def clipping_norm(self) -> float:
        return self.reducer.clipping_norm

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        key = getattr(self.strategy, "arrayrecord_key", "arrays")
        self._global = (key, arrays)
        if self.worker_reduction:
            attach_reducer(messages, self.reducer)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        valid = [r for r in replies if not r.has_error()]
        if not valid:
            return None, None
        key, global_record = self._global
        summed = self.reducer.reduce(RecordDict({key: global_record}), valid)
        total = to_numpy(next(iter(summed.content.array_records.values())))
        metrics = next(iter(summed.content.metric_records.values()))
        std = self.noise_multiplier * self.clipping_norm
        reference = to_numpy(global_record)
        updated = {}
        for name, value in reference.items():
            noise = self.rng.normal(0.0, std, size=value.shape) if std > 0 else 0.0
            mean_update = (total[name] + noise) / self.expected_clients
            updated[name] = (value.astype(np.float64) + mean_update).astype(value.dtype)
        clients = int(metrics[CLIENTS_KEY])
        weight_key = self.reducer.weight_key
        client_metrics = MetricRecord(
            {k: v for k, v in metrics.items() if k not in _BOOKKEEPING and k != weight_key}
        )
        client_metrics[weight_key] = 1
        synthetic = partial_reply(
            valid[0], RecordDict({key: to_record(updated), "metrics": client_metrics})
        )
        arrays, aggregated = self.strategy.aggregate_train(server_round, [synthetic])
        aggregated = aggregated if aggregated is not None else MetricRecord()
        aggregated["dp-clients"] = clients
        aggregated["dp-clipped-fraction"] = int(metrics[CLIPPED_KEY]) / clients
        aggregated["dp-noise-std"] = std / self.expected_clients
        return arrays, aggregated

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
