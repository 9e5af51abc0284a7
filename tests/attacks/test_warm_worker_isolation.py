"""Attack: a run hides its clients' secrets in a warm pool's workers for a later run to find.

The warm pool (:mod:`fedsim.engine.warm_pool`) leases the same worker processes to one run
after another (one Engine serving several runs: test_reused_engine_isolation.py). Run 1's
ClientApp (tests/apps/warm_leak/leak_app.py) leaves its client's secret in a module global of
its own, a global of a module the worker had loaded, a class attribute, a ``sys.modules``
entry, ``os.environ`` and an attribute on the worker object itself; run 2's ClientApp
(probe_app.py) on the same worker processes must find none of them (the reset of
:mod:`fedsim.engine.worker_reset`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))


@pytest.mark.ray
def test_a_warm_pool_gives_run_2_nothing_of_run_1(tmp_path):
    env = dict(os.environ, FEDSIM_WARM_DIR=str(tmp_path / "warm"), FEDSIM_WARM="auto")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(TESTS / "warm_support.py"), "isolation", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("RESULT "))
    assert seen["secrets"] == 4
    assert seen["pids_2"] == seen["pids_1"]  # the pool's warm workers served both runs
    assert seen["found"] == []
