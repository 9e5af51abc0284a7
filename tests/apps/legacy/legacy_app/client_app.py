"""ClientApp: a NumPyClient made by ``client_fn``, behind two client mods.

One applies Flower's ``secaggplus_mod`` to train messages of ``SecAggPlusWorkflow`` (those
carrying its stage configs), the other Flower's ``fixedclipping_mod`` to train messages that
carry a clipping norm (those of ``DifferentialPrivacyClientSideFixedClipping``); every other
message passes on.
"""

import numpy as np
from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.client import NumPyClient
from flwr.client.mod import fixedclipping_mod, secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.strategy.dp_fixed_clipping import KEY_CLIPPING_NORM

from legacy_app.task import initial_parameters, mse, node_data, train


class LinearClient(NumPyClient):
    def __init__(self, partition_id: int, run_config: dict) -> None:
        self.partition_id = partition_id
        self.x, self.y = node_data(partition_id)
        self.steps = int(run_config.get("local-steps", 5))
        self.lr = float(run_config.get("lr", 0.1))

    def get_properties(self, config):
        return {
            "partition-id": self.partition_id,
            "num-examples": len(self.y),
            "mean-y": float(np.mean(self.y)),
        }

    def get_parameters(self, config):
        return initial_parameters()

    def fit(self, parameters, config):
        mu = float(config.get("proximal_mu", 0.0))
        updated = train(parameters, self.x, self.y, self.steps, self.lr, mu)
        return updated, len(self.y), {"train-mse": mse(updated, self.x, self.y)}

    def evaluate(self, parameters, config):
        loss = mse(parameters, self.x, self.y)
        return loss, len(self.y), {"mse": loss}


def client_fn(context: Context):
    client = LinearClient(int(context.node_config["partition-id"]), dict(context.run_config))
    return client.to_client()


def clip_when_asked(msg: Message, context: Context, call_next):
    """``fixedclipping_mod`` for train messages with a clipping norm; others pass."""
    if msg.metadata.message_type == MessageType.TRAIN:
        config = compat.recorddict_to_fitins(msg.content, keep_input=True).config
        if KEY_CLIPPING_NORM in config:
            return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


def secagg_when_asked(msg: Message, context: Context, call_next):
    """``secaggplus_mod`` for SecAgg+ train messages; others pass."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(client_fn=client_fn, mods=[secagg_when_asked, clip_when_asked])
