"""ServerApp: the federation's count, mean and histogram from ``query`` and
``query.histogram`` messages to every node; writes them to ``output-path``."""

import json
import time

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def wait_for_nodes(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    """The node ids once ``count`` nodes are connected (Flower's connect as the run starts)."""
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {count} nodes connected")
        time.sleep(0.1)
    return nodes


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes = wait_for_nodes(grid, int(config["min-nodes"]))
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
    out = {
        "nodes": len(stats),
        "count": count,
        "mean": sum(float(s["sum"]) for s in stats) / count,
        "histogram": [int(c) for c in counts],
    }
    if config["output-path"]:
        with open(str(config["output-path"]), "w") as fh:
            json.dump(out, fh)
