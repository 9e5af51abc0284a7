"""The simulation engine: Flower's Grid on Ray actors (or in-process).

The names below load on first use (PEP 562 ``__getattr__``): a worker process imports
:mod:`fedsim.engine.worker` through this package, and should not pay for the driver's
modules (the grid, the cohort models and their privacy accounting, Ray's backend).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsim.engine.backend import Backend, LocalBackend, RayBackend, WorkerLost
    from fedsim.engine.client_registry import NODE_ID_OFFSET, ClientRegistry
    from fedsim.engine.faults import FaultConfig
    from fedsim.engine.grid import SimulationGrid
    from fedsim.engine.participation import (
        CohortModel,
        FullCohort,
        MinSeparationCohort,
        PoissonCohort,
        UniformCohort,
    )
    from fedsim.engine.phase_report import PhaseObserver, PhaseReport, RoundLog
    from fedsim.engine.simulation import Engine, EngineConfig
    from fedsim.engine.state import ClientStateStore
    from fedsim.engine.worker import ClientAppSource, ClientWorker

#: exported name -> the module that defines it
_WHERE = {
    **dict.fromkeys(("Backend", "LocalBackend", "RayBackend", "WorkerLost"), "backend"),
    **dict.fromkeys(("NODE_ID_OFFSET", "ClientRegistry"), "client_registry"),
    "FaultConfig": "faults",
    **dict.fromkeys(("PhaseObserver", "PhaseReport", "RoundLog"), "phase_report"),
    "SimulationGrid": "grid",
    **dict.fromkeys(
        ("CohortModel", "FullCohort", "MinSeparationCohort", "PoissonCohort", "UniformCohort"),
        "participation",
    ),
    **dict.fromkeys(("Engine", "EngineConfig"), "simulation"),
    "ClientStateStore": "state",
    **dict.fromkeys(("ClientAppSource", "ClientWorker"), "worker"),
}

#: the names above, spelled out so that tools see the TYPE_CHECKING imports exported
__all__ = [
    "Backend",
    "ClientAppSource",
    "ClientRegistry",
    "ClientStateStore",
    "ClientWorker",
    "CohortModel",
    "Engine",
    "EngineConfig",
    "FaultConfig",
    "FullCohort",
    "LocalBackend",
    "MinSeparationCohort",
    "NODE_ID_OFFSET",
    "PhaseObserver",
    "PhaseReport",
    "PoissonCohort",
    "RayBackend",
    "RoundLog",
    "SimulationGrid",
    "UniformCohort",
    "WorkerLost",
]
assert sorted(_WHERE) == __all__


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'fedsim.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedsim.engine.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
