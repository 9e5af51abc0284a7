"""The engine's start-up (issue 21, point 3): workers start while the driver works, the
steps are timed, and a Ray that is already running is joined and left running."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_start_returns_before_the_workers_are_awaited_and_ready_waits(ray_session):
    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(workers=2)).start()
    try:
        # start() asked Ray for the workers and returned: nothing waited for them yet
        assert set(engine.startup_s) == {"ray_init", "workers_spawn"}
        assert engine.ready() is engine
        assert set(engine.startup_s) == {"ray_init", "workers_spawn", "workers_ready"}
        assert all(seconds >= 0 for seconds in engine.startup_s.values())
        described = engine.describe()
        assert described["workers"] == 2 and described["direct_channels"] == 2
    finally:
        engine.close()


@pytest.mark.ray
def test_a_run_right_after_start_meets_its_workers(ray_session):
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedsim.engine import ClientAppSource, Engine, EngineConfig
    from fedsim.record_codec import to_numpy, to_record

    engine = Engine(EngineConfig(workers=2)).start()
    try:
        grid = engine.open_run(ClientAppSource(reference="toy_app:app", app_dir=str(HERE)), 4)
        assert "workers_ready" in engine.startup_s  # the run waited for the workers
        content = RecordDict(
            {
                "arrays": to_record({"w": np.zeros(2, dtype=np.float32)}),
                "config": ConfigRecord({"server-round": 1, "step": 1.0}),
            }
        )
        nodes = sorted(grid.get_node_ids())
        replies = list(grid.send_and_receive([Message(content, n, "train") for n in nodes]))
        assert len(replies) == 4 and not any(r.has_error() for r in replies)
        got = sorted(float(to_numpy(r.content["arrays"])["w"][0]) for r in replies)
        assert got == [1.0, 2.0, 3.0, 4.0]  # arrays + (partition-id + 1) * step
        grid.wait_idle()
    finally:
        engine.close()


@pytest.mark.ray
def test_an_initialised_ray_is_joined_and_left_running(ray_session):
    import ray

    from fedsim.engine import Engine, EngineConfig

    assert ray.is_initialized()
    for _ in range(2):  # two engines, one after the other, on the one Ray start
        engine = Engine(EngineConfig(workers=1)).ready()
        assert engine.describe()["workers"] == 1
        engine.close()
        assert ray.is_initialized()
