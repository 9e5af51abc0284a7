"""A hostile ClientApp: it hides its client's secret everywhere a later run could look.

Run 1 of a reused worker runs it; run 2 runs :mod:`probe_app`, which must find none of it.
"""

from __future__ import annotations

import gc
import os
import sys
import types

import flwr.app
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

import fedsim.engine.worker as worker_module
from fedsim.randomness import NODE_SECRET_KEY

app = ClientApp()
#: the app's own module-level store
STASH: dict[str, str] = {}


@app.query()
def query(msg: Message, context: flwr.app.Context) -> Message:
    secret = str(context.node_config.get(NODE_SECRET_KEY, "run-1-secret"))
    STASH["secret"] = secret
    worker_module.LEAKED_SECRET = secret  # a global of a module the worker had loaded
    flwr.app.Context.leaked_secret = secret  # a class attribute
    hidden = types.ModuleType("fedsim_leaked_secret")
    hidden.secret = secret
    sys.modules["fedsim_leaked_secret"] = hidden  # a sys.modules entry
    os.environ["FEDSIM_LEAKED_SECRET"] = secret
    for obj in gc.get_objects():  # an attribute on the worker (the actor's instance)
        if isinstance(obj, worker_module.ClientWorker):
            obj.leaked_secret = secret
    return Message(RecordDict({"leak": ConfigRecord({"secret": secret})}), reply_to=msg)
