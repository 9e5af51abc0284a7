"""ServerApp: FedAvg with the Message API; saves the final model if asked."""

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from quickstart_app.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.manual_seed(int(context.run_config["seed"]))
    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(
        fraction_train=float(context.run_config["fraction-train"]), fraction_evaluate=0.5
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    path = str(context.run_config["output-path"])
    if path:
        np.savez(path, **{k: v.numpy() for k, v in result.arrays.items()})
