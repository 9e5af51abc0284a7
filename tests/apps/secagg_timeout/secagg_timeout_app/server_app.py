"""Flower's SecAgg+ demo server in small: legacy FedAvg on initial parameters of zeros,
``DefaultWorkflow`` with ``SecAggPlusWorkflow`` under a stage timeout, no evaluation."""

from __future__ import annotations

import numpy as np
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=5,
        min_available_clients=5,
        initial_parameters=ndarrays_to_parameters([np.zeros(4, np.float64)]),
    )
    legacy = LegacyContext(
        context=context,
        config=ServerConfig(num_rounds=int(config["num-server-rounds"])),
        strategy=strategy,
    )
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(
            num_shares=int(config["num-shares"]),
            reconstruction_threshold=int(config["reconstruction-threshold"]),
            timeout=float(config["timeout"]),
        )
    )
    workflow(grid, legacy)
