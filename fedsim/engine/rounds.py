"""The round loop of a Message-API strategy, with a hook after every round.

:func:`run_rounds` makes exactly the calls ``flwr.serverapp.strategy.Strategy.start``
makes (configure/aggregate train, configure/aggregate evaluate, then the
optional central ``evaluate_fn``), in the same order and with the same
arguments, and additionally reports each finished round to ``on_round``. fedsim's
own runs use it so that every round is recorded (and can be checkpointed) as it
ends.

A strategy may end the run early by defining ``should_stop(server_round) -> bool``
(e.g. DP-FedAvg when the next round would exceed its privacy budget): it is asked
before each round, and a True ends the loop before that round's first message.
Such a strategy should also send nothing from ``configure_train`` for that
round, so that Flower's own ``Strategy.start`` stops spending on it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.participation import EVALUATE, TRAIN


@dataclass(frozen=True)
class RoundOutcome:
    """What the strategy returned in one round."""

    server_round: int
    arrays: ArrayRecord
    train_metrics: MetricRecord | None
    evaluate_metrics: MetricRecord | None
    central_metrics: MetricRecord | None


EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def run_rounds(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    *,
    timeout: float | None = 3600,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: EvaluateFn | None = None,
    on_round: Callable[[RoundOutcome], None] | None = None,
    first_round: int = 1,
) -> ArrayRecord:
    """Run rounds ``first_round..num_rounds``; returns the final global arrays.

    ``on_round`` also receives a round-0 outcome with the central evaluation of
    the initial arrays when ``evaluate_fn`` is given and ``first_round`` is 1.
    The loop ends early when the strategy's ``should_stop(server_round)`` (if it
    has one) returns True before a round.
    """
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    arrays = initial_arrays
    if evaluate_fn is not None and first_round == 1:
        central = evaluate_fn(0, arrays)
        if on_round is not None:
            on_round(RoundOutcome(0, arrays, None, None, central))
    declare = getattr(grid, "begin_phase", None)  # fedsim's grid keys cohorts by round
    should_stop = getattr(strategy, "should_stop", None)
    for server_round in range(first_round, num_rounds + 1):
        if should_stop is not None and should_stop(server_round):
            break
        if declare is not None:
            declare(server_round, TRAIN)
        replies = grid.send_and_receive(
            strategy.configure_train(server_round, arrays, train_config, grid), timeout=timeout
        )
        new_arrays, train_metrics = strategy.aggregate_train(server_round, replies)
        if new_arrays is not None:
            arrays = new_arrays
        if declare is not None:
            declare(server_round, EVALUATE)
        replies = grid.send_and_receive(
            strategy.configure_evaluate(server_round, arrays, evaluate_config, grid),
            timeout=timeout,
        )
        evaluate_metrics = strategy.aggregate_evaluate(server_round, replies)
        central = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
        if on_round is not None:
            on_round(RoundOutcome(server_round, arrays, train_metrics, evaluate_metrics, central))
    return arrays
