"""ServerApp of the Message API, chosen by the run config's ``surface``:

* ``analytics``: the federation's count, mean and histogram from ``query`` and
  ``query.histogram`` messages to every node;
* ``fedavg``: ``flwr.serverapp.strategy.FedAvg`` started with an ``evaluate_fn`` (central
  evaluation on the pooled values), every node in each train and evaluate round;
* ``dp-server``: the same FedAvg inside the Message API's
  ``DifferentialPrivacyServerSideFixedClipping`` (z = 0: clipping only, deterministic);
* ``dp-client``: inside ``DifferentialPrivacyClientSideFixedClipping`` (z = 0), its train
  messages sent as the custom type ``train.clipped``, which the ClientApp serves through
  Flower's ``fixedclipping_mod``.

Writes what it computed (for ``fedavg``: the final arrays and the strategy's ``Result``, round
by round) to ``output-path``."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

app = ServerApp()


def wait_for_nodes(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    """The node ids once ``count`` nodes are connected (Flower's connect as the run starts)."""
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {count} nodes connected")
        time.sleep(0.1)
    return nodes


def analytics(grid: Grid, config: dict, nodes: list[int]) -> dict:
    stats = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=n, message_type="query", group_id="1") for n in nodes]
    )
    stats = [r.content["stats"] for r in stats if r.has_content()]
    count = sum(int(s["count"]) for s in stats)
    bins = ConfigRecord({k: config[k] for k in ("bins", "low", "high")})
    histograms = grid.send_and_receive(
        [
            Message(RecordDict({"bins": bins}), dst_node_id=n, message_type="query.histogram",
                    group_id="1")
            for n in nodes
        ]
    )
    counts = np.sum(
        [r.content["histogram"]["counts"] for r in histograms if r.has_content()], axis=0
    )
    return {
        "nodes": len(stats),
        "count": count,
        "mean": sum(float(s["sum"]) for s in stats) / count,
        "histogram": [int(c) for c in counts],
    }


def pooled(nodes: int) -> np.ndarray:
    """Every node's values (the ClientApp's draw), for central evaluation."""
    return np.concatenate(
        [np.random.default_rng(500 + p).normal(loc=p - 2.0, size=20 + 4 * p) for p in range(nodes)]
    )


class Retyped(Strategy):
    """``strategy`` with its train messages sent as ``message_type`` (a custom action)."""

    def __init__(self, strategy: Strategy, message_type: str) -> None:
        self.strategy, self.message_type = strategy, message_type

    def configure_train(self, server_round, arrays, config, grid):
        return [
            Message(m.content, dst_node_id=m.metadata.dst_node_id,
                    message_type=self.message_type, group_id=m.metadata.group_id)
            for m in self.strategy.configure_train(server_round, arrays, config, grid)
        ]

    def aggregate_train(self, server_round, replies):
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()


def strategy_for(surface: str, config: dict, n: int) -> Strategy:
    """The strategy a training surface runs on ``n`` nodes (every node every round)."""
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n,
                      min_evaluate_nodes=n, min_available_nodes=n)
    clip = float(config["clipping-norm"])
    if surface == "dp-server":
        return DifferentialPrivacyServerSideFixedClipping(strategy, 0.0, clip, n)
    if surface == "dp-client":
        dp = DifferentialPrivacyClientSideFixedClipping(strategy, 0.0, clip, n)
        return Retyped(dp, "train.clipped")
    return strategy


def fedavg(grid: Grid, config: dict, nodes: list[int]) -> dict:
    x = pooled(len(nodes))

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        w, b = (float(v) for v in arrays.to_numpy_ndarrays()[0])
        return MetricRecord({"central-mse": float(np.mean((w * x + b - (2.0 * x + 1.0)) ** 2))})

    strategy = strategy_for(str(config["surface"]), config, len(nodes))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(2, dtype=np.float64)]),
        num_rounds=int(config["num-server-rounds"]),
        evaluate_fn=central,
    )

    def by_round(records: dict) -> dict:
        return {str(r): dict(record.items()) for r, record in sorted(records.items())}

    return {
        "final": result.arrays.to_numpy_ndarrays()[0].tolist(),
        "train_metrics_clientapp": by_round(result.train_metrics_clientapp),
        "evaluate_metrics_clientapp": by_round(result.evaluate_metrics_clientapp),
        "evaluate_metrics_serverapp": by_round(result.evaluate_metrics_serverapp),
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes = wait_for_nodes(grid, int(config["min-nodes"]))
    surface = str(config["surface"])
    run = {"analytics": analytics, "fedavg": fedavg, "dp-server": fedavg,
           "dp-client": fedavg}.get(surface)
    if run is None:
        raise ValueError(f"run config surface = {surface!r} is not one this app knows")
    out = run(grid, config, nodes)
    if config["output-path"]:
        with open(str(config["output-path"]), "w") as fh:
            json.dump(out, fh)
