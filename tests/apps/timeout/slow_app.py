"""One slow client and a send_and_receive timeout, for fedsim and Flower's own runtime alike.

The ServerApp first asks every node once without a timeout (so both runtimes have their
workers up and warm), then sends one timed train message to each node: the client of
partition ``SLOW`` sleeps ``SLOW_S`` seconds, longer than the timeout ``TIMEOUT_S``; every
other client replies at once. :data:`REPLIED` gets the partitions whose replies the
ServerApp received in the timed phase (the ServerApp runs in the caller's process under both
runtimes). The slow client's reply, late for that call, is then pulled by its message id
(``pull_messages``): :data:`LATE` gets the partitions of the replies pulled.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

NODES = 8
SLOW = 0  # the first partition: under fedsim's batches, its batch-mates share its worker
TIMEOUT_S = 3.0
SLOW_S = 7.0

#: the partitions that replied in the timed phase, the replies of the warm-up, and the
#: partitions of the late replies pulled afterwards
REPLIED: list[int] = []
WARMED: list[int] = []
LATE: list[int] = []
#: seconds the ServerApp keeps pulling for the late reply
PULL_S = 60.0

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    config = message.content["config"]
    if pid == int(config["slow-partition"]):
        time.sleep(float(config["slow-seconds"]))
    return Message(RecordDict({"metrics": MetricRecord({"pid": pid})}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    return Message(RecordDict({"metrics": MetricRecord({"pid": pid})}), reply_to=message)


server = ServerApp()


def _pids(replies: list[Message]) -> list[int]:
    return sorted(int(r.content["metrics"]["pid"]) for r in replies if not r.has_error())


@server.main()
def main(grid: Grid, context: Context) -> None:
    waited = time.monotonic()  # Flower's runtime registers its nodes as the ServerApp starts
    while len(nodes := sorted(grid.get_node_ids())) < NODES:
        if time.monotonic() - waited > 120:
            raise RuntimeError(f"only {len(nodes)} of {NODES} nodes after 120 s")
        time.sleep(0.1)
    warm = RecordDict({"config": ConfigRecord({})})
    warmed = list(grid.send_and_receive([Message(warm, n, "query") for n in nodes]))
    WARMED[:] = _pids(warmed)
    partition = {r.metadata.src_node_id: int(r.content["metrics"]["pid"]) for r in warmed}
    slow = RecordDict({"config": ConfigRecord({"slow-partition": SLOW, "slow-seconds": SLOW_S})})
    timed = [Message(slow, n, "train", group_id="1") for n in nodes]
    REPLIED[:] = _pids(list(grid.send_and_receive(timed, timeout=TIMEOUT_S)))
    late = [m.metadata.message_id for m in timed if partition[m.metadata.dst_node_id] == SLOW]
    pulled: list[Message] = []
    waited = time.monotonic()
    while not pulled and time.monotonic() - waited < PULL_S:
        pulled = list(grid.pull_messages(late))
        time.sleep(0.2)
    LATE[:] = _pids(pulled)
