"""Server-side LAWA / EMA over rounds: train the raw global model, evaluate the average.

:class:`AveragedGlobalModel` wraps any Message-API strategy. After each
``aggregate_train`` it offers the new global arrays to a
:class:`fedsim.workloads.averaging.Averager` (a checkpoint per ``every`` rounds
after ``burn_in`` rounds), keeps sending the raw arrays in ``configure_train``,
and sends the averaged arrays in ``configure_evaluate``. Wrap a central
evaluation with :meth:`AveragedGlobalModel.evaluate_fn` to score the average
too, and read the final average from :meth:`AveragedGlobalModel.averaged`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.hooks import find
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.averaging import Averager, Averaging
from strategies.plumbing.wrapper import StrategyWrapper

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class AveragedGlobalModel(StrategyWrapper):
    """Averages ``strategy``'s global models over rounds (see the module docstring).

    Args:
        strategy: the wrapped strategy.
        averaging: the average's kind and schedule (in rounds).
        num_rounds: the run's rounds, the budget that resolves default schedules.
    """

    def __init__(self, strategy: Strategy, averaging: Averaging, num_rounds: int) -> None:
        super().__init__(strategy)
        self.averager: Averager = averaging.for_budget(num_rounds)
        self._latest: ArrayRecord | None = None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is not None:
            self._latest = arrays
            self.averager.observe(server_round, to_numpy(arrays))
        return arrays, metrics

    def averaged(self, arrays: ArrayRecord | None = None) -> ArrayRecord | None:
        """The averaged global arrays; before the first checkpoint, ``arrays``
        (or the latest global arrays)."""
        if self.averager.ready:
            return to_record(self.averager.average())
        return arrays if arrays is not None else self._latest

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        averaged = self.averaged(arrays)
        return self.strategy.configure_evaluate(
            server_round, arrays if averaged is None else averaged, config, grid
        )

    def evaluate_fn(self, evaluate: EvaluateFn) -> EvaluateFn:
        """``evaluate`` applied to the averaged arrays instead of the raw ones."""

        def averaged_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            averaged = self.averaged(arrays)
            return evaluate(server_round, arrays if averaged is None else averaged)

        return averaged_evaluate


def find_averaging(strategy: Strategy) -> AveragedGlobalModel | None:
    """The :class:`AveragedGlobalModel` in a chain of strategy wrappers, if any."""
    return find(strategy, AveragedGlobalModel)


def averaged_evaluation(strategy: Strategy, evaluate: EvaluateFn | None) -> EvaluateFn | None:
    """``evaluate`` scoring the averaged model when ``strategy`` averages, else ``evaluate``."""
    averaging = find_averaging(strategy)
    if evaluate is None or averaging is None:
        return evaluate
    return averaging.evaluate_fn(evaluate)
