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

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.metrics import MetricSums
from fedsim.engine.reduce import (
    Accumulator,
    Reducer,
    ReductionError,
    attach_reducer,
    partial_reply,
    single,
)
from fedsim.records import to_numpy, to_record
from strategies.wrapper import StrategyWrapper

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
        self.metrics = MetricSums()
        self.metric_key: str | None = None
        self.template: Message | None = None

    def add(self, reply: Message) -> None:
        _, arrays = single(reply.content, ArrayRecord)
        metric_key, metrics = single(reply.content, MetricRecord)
        values = to_numpy(arrays)
        if values.keys() != self.total.keys():
            raise ReductionError("reply arrays do not match the global model's keys")
        if CLIENTS_KEY in metrics:  # already a clipped partial sum
            for k in self.total:
                self.total[k] += values[k]
            self.clients += int(metrics[CLIENTS_KEY])
            self.clipped += int(metrics[CLIPPED_KEY])
        else:
            deltas = {k: values[k].astype(np.float64) - self.reference[k] for k in self.total}
            norm = float(np.sqrt(sum(float(np.vdot(d, d)) for d in deltas.values())))
            factor = clip_factor(norm, self.reducer.clipping_norm)
            for k in self.total:
                self.total[k] += factor * deltas[k]
            self.clients += 1
            self.clipped += int(norm > self.reducer.clipping_norm)
        weight = metrics.get(self.reducer.weight_key, 1)
        self.metrics.add(
            metrics,
            weight=float(weight) if isinstance(weight, (int, float)) else 1.0,
            skip=(*_BOOKKEEPING, self.reducer.weight_key),
        )
        if self.template is None:
            self.template, self.metric_key = reply, metric_key

    def result(self) -> Message:
        if self.template is None or self.metric_key is None:
            raise ReductionError("nothing to reduce")
        folded = self.metrics.record(self.reducer.weight_key)
        folded[CLIENTS_KEY] = self.clients
        folded[CLIPPED_KEY] = self.clipped
        content = RecordDict({self.global_key: to_record(self.total), self.metric_key: folded})
        return partial_reply(self.template, content)


class DPFedAvg(StrategyWrapper):
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
        super().__init__(strategy)
        self.reducer = ClippedSum(
            clipping_norm, getattr(strategy, "weighted_by_key", "num-examples")
        )
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = float(expected_clients)
        self.rng = rng
        self.worker_reduction = worker_reduction
        self._global: tuple[str, ArrayRecord] | None = None

    @property
    def clipping_norm(self) -> float:
        return self.reducer.clipping_norm

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
        total = to_numpy(single(summed.content, ArrayRecord)[1])
        metrics = single(summed.content, MetricRecord)[1]
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
