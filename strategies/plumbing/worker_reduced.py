"""Worker-side sums for the strategies whose aggregation is FedAvg's weighted mean
(:mod:`fedsim.worker_reduce`)."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.worker_reduce import Reducer, WeightedMean, attach_reducer
from strategies.plumbing.wrapper import StrategyWrapper, weighted_by_key


class WorkerReduced(StrategyWrapper):
    """Opt a strategy whose aggregation is a weighted mean into worker-side sums.

    Wraps e.g. ``FedAvg``, ``FedProx``, ``FedAvgM``, ``FedAdam``, ``FedYogi`` or
    ``FedAdagrad`` (all aggregate client arrays with FedAvg's weighted mean before
    their server update) and changes nothing but the instruction messages, which
    gain the :data:`~fedsim.worker_reduce.REDUCER_KEY` record. Replies pass to the wrapped strategy
    untouched. Evaluation messages are left alone (their metrics are cheap).
    """

    def __init__(self, strategy: Strategy, reducer: Reducer | None = None) -> None:
        super().__init__(strategy)
        self.reducer = reducer or WeightedMean(weighted_by_key(strategy))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        return attach_reducer(messages, self.reducer)
