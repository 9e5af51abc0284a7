"""fedsim.frontend.flwr_metrics: what Flower's strategies file in a Result or History reaches the
sink of the context that entered ``recorded_metrics``, and nothing else changes."""

from __future__ import annotations

import pickle
import threading

import numpy as np
from flwr.app import MetricRecord
from flwr.server.history import History
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import strategy as strategy_module

from fedsim.frontend.flwr_metrics import recorded_metrics


def test_history_entries_reach_the_sink_with_their_sections():
    got = []
    with recorded_metrics(lambda *entry: got.append(entry)):
        history = History()
        history.add_loss_centralized(server_round=0, loss=4.0)
        history.add_metrics_centralized(server_round=0, metrics={"acc": 0.25, "id": b"\x01\xff"})
        history.add_metrics_distributed_fit(1, {"train_loss": np.float32(0.5)})
        history.add_loss_distributed(server_round=1, loss=0.6)
        history.add_metrics_distributed(server_round=1, metrics={"loss": 0.9, "mse": 0.6})
    assert got == [
        (0, "central", {"loss": 4.0}),
        (0, "central", {"acc": 0.25, "id": "01ff"}),
        (1, "aggregated", {"train_loss": 0.5}),
        (1, "aggregated_evaluate", {"loss": 0.6}),
        # a metric named like the round's loss but of another value keeps its own name
        (1, "aggregated_evaluate", {"metric:loss": 0.9, "mse": 0.6}),
    ]
    # Flower's own record is unchanged
    assert history.losses_centralized == [(0, 4.0)]
    assert history.metrics_distributed == {"loss": [(1, 0.9)], "mse": [(1, 0.6)]}


def test_the_strategys_result_reports_what_start_files_in_it():
    got = []
    with recorded_metrics(lambda *entry: got.append(entry)):
        result = strategy_module.Result()  # as Strategy.start builds it
        result.evaluate_metrics_serverapp[0] = MetricRecord({"central-mse": 2.0})
        result.train_metrics_clientapp[1] = MetricRecord({"train-mse": 1.0, "hist": [1, 2]})
        result.evaluate_metrics_clientapp[1] = MetricRecord({"eval-mse": 1.5})
    assert isinstance(result, Result)
    assert got == [
        (0, "central", {"central-mse": 2.0}),
        (1, "aggregated", {"train-mse": 1.0, "hist": [1, 2]}),
        (1, "aggregated_evaluate", {"eval-mse": 1.5}),
    ]
    copied = pickle.loads(pickle.dumps(result.train_metrics_clientapp))
    assert type(copied) is dict and copied[1]["train-mse"] == 1.0


def test_outside_the_context_and_in_other_threads_nothing_is_reported():
    got = []
    with recorded_metrics(lambda *entry: got.append(entry)):
        pass
    History().add_loss_centralized(server_round=1, loss=1.0)  # after the context
    strategy_module.Result().train_metrics_clientapp[1] = MetricRecord({"x": 1.0})
    with recorded_metrics(lambda *entry: got.append(entry)):
        worker = threading.Thread(target=lambda: History().add_loss_distributed(1, 2.0))
        worker.start()
        worker.join()
    assert got == []
    # fedsim's own strategies build Flower's Result class, which reports nothing
    with recorded_metrics(lambda *entry: got.append(entry)):
        Result().train_metrics_clientapp[1] = MetricRecord({"x": 1.0})
    assert got == []
