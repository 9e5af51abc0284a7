"""ClientApp: local training on the node's partition; settings come with the message."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from bench_app.task import Net, load_data, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition = int(context.node_config["partition-id"])
    x, y = load_data(partition)
    seed = int(config["seed"]) * 100003 + int(config["server-round"]) * 1009 + partition
    loss = train(model, x, y, int(config["local-epochs"]), float(config["lr"]), seed)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)
