"""ClientApp: train on the node's own generated rows; under DMM, the client side of the protocol.

DMM's clients round their update, add their own noise share and (full mode) share and seal
it before anything leaves the node, so with ``strategy = "dmm"`` the training app runs inside
fedsim's ``dmm_client_app``. FedAvg and DPFedAvg need nothing on the client: DPFedAvg clips
and adds its noise on the server.
"""

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_app_dp.task import load_partition, train
from strategies.methods.dmm import dmm_client_app

training = ClientApp()


@training.train()
def train_fn(msg: Message, context: Context) -> Message:
    model = {k: a.numpy() for k, a in msg.content["arrays"].items()}
    pid = int(context.node_config["partition-id"])
    x, y = load_partition(pid)
    server_round = int(msg.content["config"]["server-round"])
    seed = int(context.run_config["seed"]) * 100003 + server_round * 1009 + pid
    loss = train(
        model, x, y, int(context.run_config["local-epochs"]), float(context.run_config["lr"]), seed
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)


dmm_training = dmm_client_app(training)
app = ClientApp()


@app.train()
def route(msg: Message, context: Context) -> Message:
    """The run config's strategy decides which client runs."""
    chosen = dmm_training if context.run_config["strategy"] == "dmm" else training
    return chosen(msg, context)
