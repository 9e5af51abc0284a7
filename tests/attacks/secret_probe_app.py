"""A Flower ClientApp that uses its own secret, as every secure client does: it draws its noise
from the secret in its ``node_config`` and, as the one party allowed to, writes its secret to
``run_config["probe-dir"]`` so the test knows what the server must never hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsim.randomness import Purpose, client_secret

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    secret = client_secret(context.node_config)
    partition = int(context.node_config["partition-id"])
    probe = Path(str(context.run_config["probe-dir"]))
    (probe / f"{partition}.hex").write_text(secret.token())
    noise = secret.generator(1, Purpose.NOISE).normal(size=4).astype(np.float32)
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(noise)})}), reply_to=message)
