"""A ClientApp that reports every trace of :mod:`leak_app` it finds in its worker."""

from __future__ import annotations

import gc
import os
import sys

import flwr.app
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

import fedsim.engine.worker as worker_module

app = ClientApp()


def traces() -> list[str]:
    """Where a secret of an earlier run is still held: one entry per place."""
    found = []
    leak = sys.modules.get("leak_app")
    if leak is not None:
        found.append(f"sys.modules['leak_app'] (STASH={getattr(leak, 'STASH', None)})")
    if hasattr(worker_module, "LEAKED_SECRET"):
        found.append(f"fedsim.engine.worker.LEAKED_SECRET={worker_module.LEAKED_SECRET}")
    if hasattr(flwr.app.Context, "leaked_secret"):
        found.append(f"flwr.app.Context.leaked_secret={flwr.app.Context.leaked_secret}")
    if "fedsim_leaked_secret" in sys.modules:
        found.append("sys.modules['fedsim_leaked_secret']")
    if "FEDSIM_LEAKED_SECRET" in os.environ:
        found.append(f"os.environ['FEDSIM_LEAKED_SECRET']={os.environ['FEDSIM_LEAKED_SECRET']}")
    for obj in gc.get_objects():
        if isinstance(obj, worker_module.ClientWorker) and hasattr(obj, "leaked_secret"):
            found.append(f"worker attribute leaked_secret={obj.leaked_secret}")
    return found


@app.query()
def query(msg: Message, context: flwr.app.Context) -> Message:
    found = traces()
    return Message(
        RecordDict({"probe": ConfigRecord({"found": found or [""], "pid": os.getpid()})}),
        reply_to=msg,
    )
