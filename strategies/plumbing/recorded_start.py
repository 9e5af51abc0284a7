"""``Strategy.start`` for fedsim's strategies: fedsim's round loop, every round in the records.

A plain Flower ServerApp runs a strategy with ``strategy.start(grid=..., ...)``. Flower's
``Strategy.start`` keeps what the strategy returned each round (its aggregated metrics) only
in the :class:`~flwr.serverapp.strategy.Result`, so under ``fedsim flwr-run`` the privacy
report, the noise and the protocol's metrics of a fedsim strategy never reached
rounds.jsonl. fedsim's strategy wrappers (DPFedAvg, the matrix mechanism, DMM, DDGauss, ...)
start with :func:`recorded_start` instead. It runs the rounds with
:func:`fedsim.engine.rounds.run_rounds`, the loop ``fedsim run`` uses (the calls of Flower's
``start``, in the same order, plus the ``should_stop`` check of a privacy budget), and hands
every finished round to the grid's round log (:class:`fedsim.engine.phase_report.RoundLog`; fedsim's
grid has one under ``fedsim flwr-run``) with the sections ``fedsim run`` writes:
``aggregated``, ``aggregated_evaluate``, ``central`` and ``privacy`` (the strategy's
``privacy_report()``). A strategy with a privacy report is private: the log then keeps the
clients' own metrics out unless the strategy's ``metrics_in_clear`` says otherwise, as
``fedsim run`` does. Under Flower's own runtime the grid has no round log: the Result is
kept, as Flower's ``start`` keeps it, and each round's privacy report goes to Flower's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

from fedsim.engine.hooks import ClearMetrics, GridBound, PrivacyReporting, Stoppable, find
from fedsim.engine.rounds import RoundOutcome, run_rounds


def recorded_start(
    strategy: Strategy,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int = 3,
    timeout: float = 3600,
    train_config: ConfigRecord | None = None,
    evaluate_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
) -> Result:
    """Run ``strategy`` for ``num_rounds`` rounds on ``grid``, as Flower's ``Strategy.start``
    takes its arguments and returns its :class:`Result`; every round also goes to the grid's
    round log, when it has one (see the module docstring)."""
    log(INFO, "Starting %s strategy:", type(strategy).__name__)
    log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
    strategy.summary()
    bound = find(strategy, GridBound)  # e.g. DPFedAvg plans its sampling
    if bound is not None:
        bound.bind_grid(grid)
    round_log = getattr(grid, "round_log", None)
    private = find(strategy, PrivacyReporting)
    report = None if private is None else private.privacy_report
    if round_log is not None:
        clear = find(strategy, ClearMetrics)
        round_log.open_rounds(
            private=report is not None,
            metrics_in_clear=clear is not None and bool(clear.metrics_in_clear),
        )
    result = Result()
    started = time.time()

    def on_round(outcome: RoundOutcome) -> None:
        _keep(result, outcome)
        if round_log is None and report is not None and outcome.server_round:
            log(INFO, "\t└──> Privacy: %s", report())
        if round_log is not None:
            round_log.end_round(
                outcome.server_round,
                aggregated=outcome.train_metrics,
                aggregated_evaluate=outcome.evaluate_metrics,
                central=outcome.central_metrics,
                privacy=report() if report is not None else None,
            )

    result.arrays = run_rounds(
        strategy,
        grid,
        initial_arrays,
        num_rounds,
        timeout=timeout,
        train_config=train_config,
        evaluate_config=evaluate_config,
        evaluate_fn=evaluate_fn,
        on_round=on_round,
    )
    log(INFO, "Strategy execution finished in %.2fs", time.time() - started)
    if round_log is not None:
        round_log.end_run(**run_summary(strategy))
    return result


def run_summary(strategy: Strategy) -> dict[str, Any]:
    """What a run's summary adds for ``strategy``: why it stopped early (None: it did not)
    and, for a private strategy, its final privacy report (as ``fedsim run`` writes them)."""
    stoppable, private = find(strategy, Stoppable), find(strategy, PrivacyReporting)
    out: dict[str, Any] = {"stopped_reason": None if stoppable is None else stoppable.stop_reason}
    if private is not None:
        out["privacy"] = private.privacy_report()
    return out


def _keep(result: Result, outcome: RoundOutcome) -> None:
    """File ``outcome``'s metrics in ``result`` where Flower's ``start`` files them."""
    if outcome.server_round and outcome.train_metrics is not None:
        log(INFO, "\t└──> Aggregated MetricRecord: %s", outcome.train_metrics)
        result.train_metrics_clientapp[outcome.server_round] = outcome.train_metrics
    if outcome.evaluate_metrics is not None:
        result.evaluate_metrics_clientapp[outcome.server_round] = outcome.evaluate_metrics
    if outcome.central_metrics is not None:
        result.evaluate_metrics_serverapp[outcome.server_round] = outcome.central_metrics
