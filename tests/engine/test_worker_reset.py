"""The reset of a warm worker (:mod:`fedsim.engine.worker_reset`), in a process of its own
(a reset rewinds every module of its process, which a test session's must not see)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, random, sys, threading, time, types
import numpy as np
import torch
import fedsim.engine.worker as worker_module
from fedsim.engine.worker_reset import ResettableWorker

# what the script keeps is bound before the baseline: a reset drops names added after it,
# in every module, this one (``__main__``) too
keep = {}
stop = threading.Event()
worker = ResettableWorker(1)
worker.warm_up(modules=())
keep["before"] = (random.random(), float(np.random.random()), float(torch.rand(1)))
keep["first"] = worker.reset()
# a run: draws from every global generator, rebinds and adds globals, a module, a thread
random.seed(7); np.random.seed(7); torch.manual_seed(7); torch.set_num_threads(3)
keep["after_run"] = (random.random(), float(np.random.random()), float(torch.rand(1)))
worker_module.REBOUND = 1
worker_module.remember = None
sys.modules["fedsim_run_module"] = types.ModuleType("fedsim_run_module")
os.environ["FEDSIM_RUN_VAR"] = "1"
worker.extra = "run"
keep["second"] = worker.reset()
keep["again"] = (random.random(), float(np.random.random()), float(torch.rand(1)))
stop = threading.Event()
threading.Thread(target=stop.wait, name="run-thread", daemon=True).start()
keep["third"] = worker.reset()
stop.set()
print("RESULT " + json.dumps({
    **keep,
    "rebound": hasattr(worker_module, "REBOUND"),
    "remember": worker_module.remember is not None,
    "module": "fedsim_run_module" in sys.modules,
    "env": "FEDSIM_RUN_VAR" in os.environ,
    "extra": hasattr(worker, "extra"),
    "threads": torch.get_num_threads(),
}))
"""


def test_a_reset_rewinds_globals_modules_generators_and_refuses_a_live_thread():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("RESULT "))
    assert seen["first"]["ok"] and seen["second"]["ok"], seen
    # the generators are where warm-up left them: the same draws as before the run
    assert seen["again"] == seen["before"] != seen["after_run"]
    assert not seen["rebound"] and seen["remember"]
    assert not seen["module"] and not seen["env"] and not seen["extra"]
    assert seen["threads"] == 1
    # a thread the run left running: the reset fails, naming it (the pool replaces the worker)
    assert not seen["third"]["ok"]
    assert any("run-thread" in problem for problem in seen["third"]["problems"])
