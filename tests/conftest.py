"""Shared fixtures: one Ray instance and one engine for the whole session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

APPS = Path(__file__).parent / "apps"
QUICKSTART = APPS / "quickstart"
sys.path.insert(0, str(QUICKSTART))  # the quickstart app's package, for in-process use


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance (2 CPUs) for all tests that need it."""
    import ray

    from fedsim.engine.cluster import ensure_ray

    started = ensure_ray(num_cpus=2, object_store_mb=256)
    yield ray
    if started is not None:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_engine(ray_session):
    """A started Ray engine with two workers, shared by the session's tests."""
    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(workers=2)).start()
    yield engine
    engine.close()


@pytest.fixture
def local_engine():
    """The in-process engine (one worker in the test process)."""
    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(backend="local")).start()
    yield engine
    engine.close()
