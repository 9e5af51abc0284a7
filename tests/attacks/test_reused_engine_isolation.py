"""Attack: a run hides its clients' secrets in the worker processes for a later run to find.

One :class:`~fedsim.engine.simulation.Engine` serving several runs keeps its Ray workers.
Run 1's ClientApp (tests/apps/warm_leak/leak_app.py) leaves its client's secret in a module
global of its own, a global of a module the worker had loaded, a class attribute, a
``sys.modules`` entry, ``os.environ`` and an attribute on the worker object itself; run 2's
ClientApp (probe_app.py) on the same worker processes must find none of them (the reset of
:mod:`fedsim.engine.worker_reset`, which the Ray backend runs before every run but the first).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.ray
def test_a_reused_engine_gives_run_2_nothing_of_run_1(ray_session):
    from reuse_support import leak_then_probe

    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(workers=2)).start()
    calls = iter([engine, engine])
    closed = engine.close
    engine.close = lambda: None  # both runs on this engine's workers
    try:
        seen = leak_then_probe(lambda: next(calls))
    finally:
        closed()
    assert seen["secrets"] == 4  # run 1 had its clients' secrets to hide
    assert seen["pids_2"] == seen["pids_1"]  # run 2 ran in the same processes
    assert seen["found"] == []
