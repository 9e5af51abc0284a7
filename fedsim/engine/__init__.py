"""The simulation engine: Flower's Grid on Ray actors (or in-process)."""

from fedsim.engine.backend import Backend, LocalBackend, RayBackend, WorkerLost
from fedsim.engine.client_registry import NODE_ID_OFFSET, ClientRegistry
from fedsim.engine.faults import FaultConfig
from fedsim.engine.grid import PhaseObserver, PhaseReport, RoundLog, SimulationGrid
from fedsim.engine.participation import (
    CohortModel,
    FullCohort,
    MinSeparationCohort,
    PoissonCohort,
    UniformCohort,
)
from fedsim.engine.simulation import Engine, EngineConfig
from fedsim.engine.state import ClientStateStore
from fedsim.engine.worker import ClientAppSource, ClientWorker

__all__ = [
    "NODE_ID_OFFSET",
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
    "PhaseObserver",
    "RoundLog",
    "PhaseReport",
    "PoissonCohort",
    "RayBackend",
    "SimulationGrid",
    "UniformCohort",
    "WorkerLost",
]
