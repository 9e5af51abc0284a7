"""ServerApp: FedAvg, fedsim's DPFedAvg or fedsim's DMM, chosen by the run config's ``strategy``.

The only change from a plain FedAvg ServerApp is the strategy object. DPFedAvg wraps the
FedAvg that samples ``fraction-train`` of the nodes; it accounts that sampling as it happens
(a fixed-size cohort drawn uniformly without replacement) and reports epsilon every round.
DMM (ideal mode: the protocol's arithmetic without its cryptography, which needs fedsim's
committee host under ``fedsim run``) trains every node every round and accounts the
participation it enforces. Under ``fedsim flwr-run`` each round's epsilon, noise and clipping
norm go to rounds.jsonl; under Flower's own ``flwr run`` the same strategy runs and its
metrics are in Flower's log.
"""

from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from fedsim.randomness import server_secret
from flower_app_dp.task import evaluate, held_out, initial_model
from strategies.methods import dmm
from strategies.methods.dp_fedavg.strategy import DPFedAvg

app = ServerApp()


def make_strategy(config: dict, nodes: int, rounds: int, context: Context) -> Strategy:
    """The strategy the run config names, for a federation of ``nodes`` nodes."""
    name = str(config["strategy"])
    fraction = float(config["fraction-train"])
    # no minimum number of nodes: FedAvg samples int(nodes * fraction) of them
    fedavg = FedAvg(
        fraction_train=fraction, fraction_evaluate=0.0, min_train_nodes=0, min_available_nodes=0
    )
    if name == "fedavg":
        return fedavg
    if name == "dp-fedavg":
        strategy = DPFedAvg(
            fedavg,
            clipping_norm=float(config["clipping-norm"]),
            noise_multiplier=float(config["noise-multiplier"]),
            expected_clients=max(1, int(nodes * fraction)),  # the mean's denominator
            delta=float(config["delta"]),
        )
        strategy.bind_server_secret(server_secret(context.node_config))
        return strategy
    if name == "dmm":
        options = {
            "clipping_norm": float(config["clipping-norm"]),
            "noise_multiplier": float(config["noise-multiplier"]),
            "delta": float(config["delta"]),
            "mode": "ideal",
            "committee_size": 12,
            "threshold": 2,
            "packing": 2,
            "member_dropouts": 1,
        }
        return dmm.from_options(
            options,
            rounds=rounds,
            expected_clients=nodes,
            population=nodes,
            seed=int(config["seed"]),
        )
    raise ValueError(f"strategy = {name!r}; allowed: 'fedavg', 'dp-fedavg', 'dmm'")


def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Loss and accuracy of the global model on the server's own held-out rows."""
    loss, accuracy = evaluate({k: a.numpy() for k, a in arrays.items()}, *held_out())
    return MetricRecord({"loss": loss, "accuracy": accuracy})


@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    nodes = len(list(grid.get_node_ids()))
    strategy = make_strategy(context.run_config, nodes, rounds, context)
    initial = ArrayRecord({k: Array(v) for k, v in initial_model().items()})
    strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=central_evaluation
    )
