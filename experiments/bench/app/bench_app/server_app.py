"""ServerApp: Message-API FedAvg, no federated evaluation; the client settings travel in the
train config (Flower's ``run_simulation`` gives ClientApps no run config)."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from bench_app.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    torch.manual_seed(int(config["seed"]))
    strategy = FedAvg(fraction_train=float(config["fraction-train"]), fraction_evaluate=0.0)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord(
            {k: config[k] for k in ("lr", "local-epochs", "seed")}
        ),
        num_rounds=int(config["num-server-rounds"]),
    )
