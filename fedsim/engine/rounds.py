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

Two outcomes stop the run (:class:`RunStopped`) before the round is reported, so
it is neither recorded nor checkpointed, because every later round would be
garbage: aggregated arrays with NaN or infinite values (:class:`NonFiniteModel`,
training diverged), and a training phase in which the ClientApp raised for every
client that ran (:class:`EveryClientFailed`; crashed workers, dropouts and late
replies do not count, they are faults a run is meant to survive).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.engine.boundary import boundary_of, mechanism_of
from fedsim.engine.hooks import Stoppable, find
from fedsim.engine.participation import EVALUATE, TRAIN
from fedsim.record_codec import to_numpy


class RunStopped(RuntimeError):
    """A round whose outcome makes the rest of the run meaningless."""


class EveryClientFailed(RunStopped):
    """The ClientApp raised for every client of a training phase."""

    def __init__(self, server_round: int, count: int, reason: str) -> None:
        self.server_round, self.count = server_round, count
        first = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
        super().__init__(
            f"round {server_round}: the ClientApp raised for all {count} clients that trained "
            f"(the first: {first}); the run stopped"
        )


def check_replies(server_round: int, replies: list[Message]) -> None:
    """Raise :class:`EveryClientFailed` if every reply is a ClientApp exception."""
    if replies and all(
        r.has_error() and r.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION for r in replies
    ):
        raise EveryClientFailed(server_round, len(replies), replies[0].error.reason)


class NonFiniteModel(RunStopped):
    """The strategy returned arrays with NaN or infinite values (training diverged)."""

    def __init__(self, server_round: int, arrays: list[str]) -> None:
        self.server_round, self.arrays = server_round, arrays
        super().__init__(
            f"round {server_round}: the aggregated model has NaN or infinite values in "
            f"{', '.join(map(repr, arrays))}; the run stopped (training diverged: a step "
            "size such as the learning rate is likely too large)"
        )


def check_finite(server_round: int, arrays: ArrayRecord) -> None:
    """Raise :class:`NonFiniteModel` if a floating array of ``arrays`` is not finite."""
    bad = [
        key
        for key, value in to_numpy(arrays).items()
        if value.dtype.kind in "fc" and not np.isfinite(value).all()
    ]
    if bad:
        raise NonFiniteModel(server_round, bad)


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
    The loop ends early when the strategy's ``should_stop(server_round)`` (a
    :class:`~fedsim.engine.hooks.Stoppable` layer's) returns True before a round. On a grid
    with a release boundary
    (:mod:`fedsim.engine.boundary`) a private strategy is registered as the run's mechanism
    and each round's calls run in its scope.
    """
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    arrays = initial_arrays
    boundary, mechanism = boundary_of(grid), mechanism_of(strategy)
    if boundary is not None and mechanism is not None:
        boundary.register(mechanism)

    def scope():  # replies delivered inside are the mechanism's
        if boundary is None or mechanism is None:
            return nullcontext()
        return boundary.scope(mechanism)

    if evaluate_fn is not None and first_round == 1:
        central = evaluate_fn(0, arrays)
        if on_round is not None:
            on_round(RoundOutcome(0, arrays, None, None, central))
    stoppable = find(strategy, Stoppable)
    for server_round in range(first_round, num_rounds + 1):
        if stoppable is not None and stoppable.should_stop(server_round):
            break
        with scope():
            arrays, train_metrics, evaluate_metrics = _round(
                strategy, grid, server_round, arrays, (train_config, evaluate_config), timeout
            )
        central = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
        if on_round is not None:
            on_round(RoundOutcome(server_round, arrays, train_metrics, evaluate_metrics, central))
    return arrays


def _round(
    strategy: Strategy,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    configs: tuple[ConfigRecord, ConfigRecord],
    timeout: float | None,
) -> tuple[ArrayRecord, MetricRecord | None, MetricRecord | None]:
    """One round's train and evaluate phases (``configs``: their configs), as Flower's
    ``Strategy.start`` calls them: the new arrays (``arrays`` when the strategy kept them)
    and the aggregated train and evaluate metrics."""
    train_config, evaluate_config = configs
    declare = getattr(grid, "begin_phase", None)  # fedsim's grid keys cohorts by round
    if declare is not None:
        declare(server_round, TRAIN)
    replies = list(
        grid.send_and_receive(
            strategy.configure_train(server_round, arrays, train_config, grid),
            timeout=timeout,
        )
    )
    check_replies(server_round, replies)
    new_arrays, train_metrics = strategy.aggregate_train(server_round, replies)
    if new_arrays is not None:
        check_finite(server_round, new_arrays)
        arrays = new_arrays
    if declare is not None:
        declare(server_round, EVALUATE)
    replies = grid.send_and_receive(
        strategy.configure_evaluate(server_round, arrays, evaluate_config, grid),
        timeout=timeout,
    )
    evaluate_metrics = strategy.aggregate_evaluate(server_round, replies)
    return arrays, train_metrics, evaluate_metrics
