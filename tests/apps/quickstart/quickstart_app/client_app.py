"""ClientApp: train and evaluate on the partition given by node_config."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart_app.task import Net, load_data, test, train

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid = context.node_config["partition-id"]
    x, y = load_data(pid, context.node_config["num-partitions"])
    server_round = msg.content["config"]["server-round"]
    seed = int(context.run_config["seed"]) * 100003 + server_round * 1009 + pid
    loss = train(
        model, x, y, int(context.run_config["local-epochs"]), float(context.run_config["lr"]), seed
    )
    # Stateful client: count how many times this client trained.
    counter = context.state.get("counter", MetricRecord({"times": 0}))
    counter["times"] = int(counter["times"]) + 1
    context.state["counter"] = counter
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {"train_loss": loss, "num-examples": len(y), "times": counter["times"]}
            ),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    pid = context.node_config["partition-id"]
    x, y = load_data(pid, context.node_config["num-partitions"])
    loss, acc = test(model, x, y)
    content = RecordDict(
        {"metrics": MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})}
    )
    return Message(content=content, reply_to=msg)
