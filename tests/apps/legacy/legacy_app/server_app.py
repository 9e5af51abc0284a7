"""ServerApp: one of Flower's legacy surfaces, chosen by the run config's ``surface``.

* ``fedavg``: ``LegacyContext`` + ``DefaultWorkflow`` + ``FedAvg`` without initial
  parameters, so the workflow asks one node for them (``get_parameters``);
* ``fedprox``, ``fedadam``: the same workflow with ``FedProx`` / ``FedAdam``;
* ``dp-server``, ``dp-client``: ``FedAvg`` inside ``DifferentialPrivacyServerSideFixedClipping``
  / ``DifferentialPrivacyClientSideFixedClipping`` (the client's mod clips);
* ``secagg``: ``DefaultWorkflow`` whose fit step is ``SecAggPlusWorkflow`` (the client's
  ``secaggplus_mod`` masks), ``FedAvg``;
* ``evaluate-only``: ``DefaultWorkflow`` whose fit step does nothing: every round evaluates
  the given model on every node;
* ``properties``: federated analytics with ``get_properties`` messages (the pooled mean of y);
* ``server-fn``: ``ServerApp(server_fn=...)``, the oldest form (``start_grid``: one message per
  node per call, sent from a thread pool);
* ``reconnect``, ``system``: a message of that type to every node (no ClientApp runs one).

Central evaluation records the global parameters of every round; ``output-path`` gets the
final parameters and what the strategy aggregated, as JSON.
"""

import json
import time

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.common import GetPropertiesIns, ndarrays_to_parameters
from flwr.common.constant import MessageTypeLegacy
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedProx,
)
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid

from legacy_app.task import initial_parameters, mse, node_data

app = ServerApp()


def wait_for_nodes(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    """The node ids once ``count`` nodes are connected (Flower's connect as the run starts)."""
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {count} nodes connected")
        time.sleep(0.1)
    return nodes


def weighted(metrics: list[tuple[int, dict]]) -> dict:
    total = sum(n for n, _ in metrics)
    keys = sorted({k for _, m in metrics for k in m})
    return {k: sum(n * float(m[k]) for n, m in metrics) / total for k in keys}


class Recorder:
    """What the strategy computed, round by round."""

    def __init__(self, nodes: int) -> None:
        self.x, self.y = map(np.concatenate, zip(*(node_data(p) for p in range(nodes))))
        self.central: list[list] = []
        self.fit_metrics: list[dict] = []
        self.evaluate_metrics: list[dict] = []
        self.final: list[list[float]] = []

    def evaluate(self, server_round: int, arrays, config):
        params = [np.asarray(a, dtype=np.float64) for a in arrays]
        self.final = [p.tolist() for p in params]
        loss = mse(params, self.x, self.y)
        self.central.append([server_round, loss])
        return loss, {"central-mse": loss}

    def fit_aggregate(self, metrics):
        self.fit_metrics.append(weighted(metrics))
        return self.fit_metrics[-1]

    def evaluate_aggregate(self, metrics):
        self.evaluate_metrics.append(weighted(metrics))
        return self.evaluate_metrics[-1]


def strategy_of(surface: str, config: dict, nodes: int, recorder: Recorder):
    common = dict(
        fraction_fit=1.0,
        fraction_evaluate=1.0,
        min_fit_clients=nodes,
        min_evaluate_clients=nodes,
        min_available_clients=nodes,
        evaluate_fn=recorder.evaluate,
        fit_metrics_aggregation_fn=recorder.fit_aggregate,
        evaluate_metrics_aggregation_fn=recorder.evaluate_aggregate,
    )
    given = ndarrays_to_parameters(initial_parameters())
    if surface in ("fedavg", "server-fn"):
        return FedAvg(**common)  # initial parameters from a node (get_parameters)
    if surface == "fedprox":
        return FedProx(**common, initial_parameters=given, proximal_mu=config["proximal-mu"])
    if surface == "fedadam":
        return FedAdam(**common, initial_parameters=given, eta=0.1, tau=1e-3)
    if surface in ("evaluate-only", "secagg"):
        return FedAvg(**common, initial_parameters=given)
    wrapper = {
        "dp-server": DifferentialPrivacyServerSideFixedClipping,
        "dp-client": DifferentialPrivacyClientSideFixedClipping,
    }.get(surface)
    if wrapper is None:
        raise ValueError(f"run config surface = {surface!r} is not one this app knows")
    return wrapper(
        FedAvg(**common, initial_parameters=given),
        noise_multiplier=float(config["noise-multiplier"]),
        clipping_norm=float(config["clipping-norm"]),
        num_sampled_clients=nodes,
    )


def no_training(grid: Grid, context: Context) -> None:
    """The fit step of an evaluate-only app."""


def pooled_mean(grid: Grid) -> dict:
    """Federated analytics with ``get_properties``: every node's count and mean of y."""
    content = compat.getpropertiesins_to_recorddict(GetPropertiesIns({}))
    nodes = sorted(grid.get_node_ids())
    messages = [
        Message(content, dst_node_id=node, message_type=MessageTypeLegacy.GET_PROPERTIES,
                group_id="1")
        for node in nodes
    ]
    replies = [r for r in grid.send_and_receive(messages) if r.has_content()]
    props = [compat.recorddict_to_getpropertiesres(r.content).properties for r in replies]
    total = sum(int(p["num-examples"]) for p in props)
    return {
        "nodes": len(props),
        "num-examples": total,
        "mean-y": sum(int(p["num-examples"]) * float(p["mean-y"]) for p in props) / total,
        "partitions": sorted(int(p["partition-id"]) for p in props),
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    surface = str(config["surface"])
    nodes = len(wait_for_nodes(grid, int(config["min-nodes"])))
    recorder = Recorder(nodes)
    rounds = int(config["num-server-rounds"])
    out: dict = {"surface": surface}
    if surface in ("reconnect", "system"):
        grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=surface, group_id="1")
             for n in sorted(grid.get_node_ids())]
        )
    elif surface == "properties":
        out["analytics"] = pooled_mean(grid)
    elif surface == "server-fn":
        strategy = strategy_of(surface, config, nodes, recorder)
        inner = ServerApp(
            server_fn=lambda _: ServerAppComponents(
                strategy=strategy, config=ServerConfig(num_rounds=rounds)
            )
        )
        inner(grid, context)
    else:
        legacy = LegacyContext(
            context=context,
            config=ServerConfig(num_rounds=rounds),
            strategy=strategy_of(surface, config, nodes, recorder),
        )
        fit = {
            "evaluate-only": no_training,
            "secagg": SecAggPlusWorkflow(num_shares=nodes - 1, reconstruction_threshold=2),
        }.get(surface)
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)
        history = legacy.history
        out["history"] = {
            "losses_distributed": history.losses_distributed,
            "losses_centralized": history.losses_centralized,
            "metrics_distributed_fit": history.metrics_distributed_fit,
            "metrics_distributed": history.metrics_distributed,
            "metrics_centralized": history.metrics_centralized,
        }
    out.update(
        final=recorder.final,
        central=recorder.central,
        fit_metrics=recorder.fit_metrics,
        evaluate_metrics=recorder.evaluate_metrics,
    )
    if config["output-path"]:
        with open(str(config["output-path"]), "w") as fh:
            json.dump(out, fh)
