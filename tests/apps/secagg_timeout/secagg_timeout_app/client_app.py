"""A NumPyClient behind Flower's ``secaggplus_mod``: each fit adds ``partition + 1`` to the
parameters; the partitions in ``slow-partitions`` sleep ``slow-seconds`` first (Flower's
SecAgg+ demo drops a client the same way)."""

from __future__ import annotations

import time

from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context


class SlowClient(NumPyClient):
    def __init__(self, partition: int, delay: float) -> None:
        self.partition = partition
        self.delay = delay

    def fit(self, parameters, config):
        if self.delay:
            time.sleep(self.delay)
        return [p + (self.partition + 1) for p in parameters], 1, {}


def client_fn(context: Context):
    partition = int(context.node_config["partition-id"])
    slow = str(context.run_config["slow-partitions"]).split()
    delay = float(context.run_config["slow-seconds"]) if str(partition) in slow else 0.0
    return SlowClient(partition, delay).to_client()


app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
