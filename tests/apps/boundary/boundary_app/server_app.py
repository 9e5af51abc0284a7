"""ServerApp: fedsim's DPFedAvg around Flower's FedAvg, and the server's ways around it.

``attack`` (run config) picks what the ServerApp does besides running the strategy:

* ``none``: DPFedAvg(FedAvg(fraction_train)), as documented;
* ``patched-sample``: ``random.sample`` is patched to return the same lowest node ids every
  round (the cohort the accountant credits with amplification would then be fixed);
* ``two-strategies``: two DPFedAvg strategies started one after the other on the same nodes;
* ``raw-phase``: a train phase sent with ``grid.send_and_receive`` outside the strategy (the
  raw updates reach the ServerApp);
* ``extra-instructions``: a DPFedAvg subclass adds instructions to more nodes after the
  sampling check;
* ``handed-twice``: a DPFedAvg subclass hands every reply to the aggregate twice;
* ``legacy-parameters``: before the strategy, one node's parameters asked for as
  ``DefaultWorkflow`` does (a ``get_parameters`` message: the node's own vector comes back);
* ``legacy-properties``: before the strategy, every node's ``get_properties`` (each node's
  norm and first entry come back).

Every train instruction that leaves is logged (node ids per phase) to ``sent-path``.
"""

import json
import random

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import GetParametersIns, GetPropertiesIns
from flwr.common.constant import MessageTypeLegacy
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedsim.randomness import server_secret
from strategies.methods.dp_fedavg.strategy import DPFedAvg

app = ServerApp()
SIZE = 8


class LoggingGrid:
    """The grid, with the node ids of each train phase kept."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.train_phases: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.train_phases.append(sorted(int(m.metadata.dst_node_id) for m in messages))
        return self._grid.send_and_receive(messages, timeout=timeout)


class ExtraInstructions(DPFedAvg):
    """Adds train instructions to the nodes the sample left out, after the sampling check."""

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not messages:
            return messages
        sent = {int(m.metadata.dst_node_id) for m in messages}
        others = [n for n in sorted(grid.get_node_ids()) if n not in sent][: len(messages)]
        extra = [
            Message(messages[0].content, n, MessageType.TRAIN, group_id=str(server_round))
            for n in others
        ]
        return messages + extra


class HandedTwice(DPFedAvg):
    """Hands every reply to the aggregate twice."""

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        return super().aggregate_train(server_round, replies + replies)


def dp_fedavg(cls, config: dict, nodes: int, context: Context) -> DPFedAvg:
    fraction = float(config["fraction-train"])
    fedavg = FedAvg(
        fraction_train=fraction, fraction_evaluate=0.0, min_train_nodes=0, min_available_nodes=0
    )
    strategy = cls(
        fedavg,
        clipping_norm=float(config["clipping-norm"]),
        noise_multiplier=float(config["noise-multiplier"]),
        expected_clients=max(1, int(nodes * fraction)),
        delta=float(config["delta"]),
    )
    strategy.bind_server_secret(server_secret(context.node_config))
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    sample = random.sample
    try:
        attack(grid, context)
    finally:
        random.sample = sample  # the patch stays inside this run


def attack(grid: Grid, context: Context) -> None:
    config = context.run_config
    attack = str(config["attack"])
    rounds = int(config["num-server-rounds"])
    logged = LoggingGrid(grid)
    nodes = sorted(int(n) for n in grid.get_node_ids())
    initial = ArrayRecord({"w": Array(np.zeros(SIZE, dtype=np.float32))})
    if attack == "patched-sample":
        random.sample = lambda population, k: sorted(population)[:k]
    if attack == "raw-phase":
        content = RecordDict({"arrays": initial, "config": ConfigRecord({"server-round": 1})})
        raw = logged.send_and_receive(
            [Message(content, n, MessageType.TRAIN, group_id="1") for n in nodes]
        )
        assert len(raw) == len(nodes)  # every node's update, un-noised
    if attack in ("legacy-parameters", "legacy-properties"):
        if attack == "legacy-parameters":
            kind, asked = MessageTypeLegacy.GET_PARAMETERS, nodes[:1]
            content = compat.getparametersins_to_recorddict(GetParametersIns({}))
        else:
            kind, asked = MessageTypeLegacy.GET_PROPERTIES, nodes
            content = compat.getpropertiesins_to_recorddict(GetPropertiesIns({}))
        legacy = logged.send_and_receive(
            [Message(content, n, kind, group_id="0") for n in asked]
        )
        assert all(r.has_content() for r in legacy)  # the nodes' own values, in clear
    cls = {"extra-instructions": ExtraInstructions, "handed-twice": HandedTwice}.get(
        attack, DPFedAvg
    )
    starts = 2 if attack == "two-strategies" else 1
    for _ in range(starts):
        strategy = dp_fedavg(cls, config, len(nodes), context)
        strategy.start(grid=logged, initial_arrays=initial, num_rounds=rounds)
    path = str(config["sent-path"])
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(logged.train_phases, out)
