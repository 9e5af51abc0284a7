"""The engine: a long-lived pool of workers that runs Flower apps.

An :class:`Engine` starts (or joins) Ray and its worker actors once; each run
then loads its ClientApp on the workers and gets its own
:class:`~fedsim.engine.grid.SimulationGrid`. Starting workers (a process each,
importing torch) is the expensive part, so one engine can serve many runs, the
way a Ray cluster serves many jobs.

    with Engine(EngineConfig(workers=2)) as engine:
        engine.run_server_app(server_app, client_app, num_supernodes=1000)
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError, device_name, require
from fedsim.engine.app_grid import AppGrid
from fedsim.engine.backend import Backend, LocalBackend, RayBackend
from fedsim.engine.channel import REPLY_TIMEOUT_S
from fedsim.engine.client_registry import ClientRegistry
from fedsim.engine.cluster import ensure_ray
from fedsim.engine.faults import FaultConfig
from fedsim.engine.grid import SimulationGrid
from fedsim.engine.participation import CohortModel
from fedsim.engine.phase_report import PhaseObserver, RoundLog
from fedsim.engine.state import ClientStateStore
from fedsim.engine.worker import ClientAppSource, RunSpec, SharedDataset
from fedsim.randomness import NODE_SECRET_KEY, RootSource, RunSecret

log = logging.getLogger(__name__)


#: the most a worker (one process on one machine) can use
MAX_CPUS_PER_WORKER = 4096
MAX_GPUS_PER_WORKER = 64


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How to run clients.

    Attributes:
        backend: "ray" (worker actors) or "local" (in the driver, for debugging).
        workers: worker actors; 0 means one per CPU of the cluster.
        cpus_per_worker: Ray CPUs per worker (torch uses as many threads).
        gpus_per_worker: Ray GPUs per worker (a fraction shares a GPU); unset: 0 unless
            ``device = "cuda"``, then an equal share of the cluster's GPUs
            (:func:`gpu_share`). Ray makes a worker's GPUs its only visible ones.
        device: where the built-in workloads train: "cpu", "cuda" (the worker's GPU),
            "cuda:N" (GPU N of the machine; Ray reserves none) or "mps".
        ray_address: '' starts a local Ray (or joins ``RAY_ADDRESS`` if set);
            otherwise the address of an existing cluster.
        num_cpus: CPUs of a locally started Ray; 0 means all.
        object_store_mb: object store of a locally started Ray, in MiB; it holds
            each round's messages and datasets shipped to the workers.
        pin_workers: give each worker its own cores; "auto" pins when fedsim
            starts Ray itself (it then owns the machine), not on a joined cluster.
        depth: batches queued per worker.
        reply_timeout_s: seconds a Ray worker may stay silent (no reply, no heartbeat)
            while batches are pending on it; its batches then fail with a
            :class:`~fedsim.engine.backend.WorkerTimeout` naming the worker, and the
            dispatcher replaces it and runs them again (:mod:`fedsim.engine.channel`).
    """

    backend: Literal["ray", "local"] = "ray"
    workers: int = 0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    device: str = "cpu"
    ray_address: str = ""
    num_cpus: int = 0
    object_store_mb: int = 512
    pin_workers: Literal["auto", "on", "off"] = "auto"
    depth: int = 2
    reply_timeout_s: float = REPLY_TIMEOUT_S
    warm: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        require(
            self.workers >= 0, "engine.workers", self.workers, "an integer >= 0 (0: one per CPU)"
        )
        require(
            0 < self.cpus_per_worker <= MAX_CPUS_PER_WORKER,
            "engine.cpus_per_worker",
            self.cpus_per_worker,
            f"a number in (0, {MAX_CPUS_PER_WORKER}] (cores of one machine)",
        )
        require(
            self.gpus_per_worker is None or 0 <= self.gpus_per_worker <= MAX_GPUS_PER_WORKER,
            "engine.gpus_per_worker",
            self.gpus_per_worker,
            f"a number in [0, {MAX_GPUS_PER_WORKER}] (GPUs of one machine)",
        )
        check_device_and_gpus(self.device, self.gpus_per_worker)
        require(
            self.num_cpus >= 0, "engine.num_cpus", self.num_cpus, "an integer >= 0 (0: all CPUs)"
        )
        require(
            self.object_store_mb >= 80,
            "engine.object_store_mb",
            self.object_store_mb,
            "an integer >= 80 (MiB; Ray's minimum is 75 MiB)",
        )
        require(self.depth >= 1, "engine.depth", self.depth, "an integer >= 1")
        timeout = self.reply_timeout_s
        require(
            isinstance(timeout, (int, float))
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0,
            "engine.reply_timeout_s",
            timeout,
            "a finite number of seconds > 0 (how long a worker may stay silent with batches "
            f"pending; default {REPLY_TIMEOUT_S:g})",
        )
        require(
            self.warm in ("auto", "on", "off"),
            "engine.warm",
            self.warm,
            "'auto' (a warm pool if one is up), 'on' (start one if none) or 'off' (cold start)",
        )


def check_device_and_gpus(device: str, gpus_per_worker: float | None) -> None:
    """Refuse a device and a GPU reservation that contradict each other: GPUs reserved for
    workers that train on the CPU (or on Apple's ``mps``, which Ray does not count), or
    ``cuda:N`` (N > 0) for workers that Ray restricts to their own GPU (seen as ``cuda:0``)."""
    device_name(device, "engine.device")
    gpus = gpus_per_worker or 0.0
    require(
        gpus == 0 or device.startswith("cuda"),
        "engine.gpus_per_worker",
        gpus_per_worker,
        f"0 or unset with engine.device = {device!r} (workers would hold GPUs they never use); "
        "set engine.device = 'cuda' to train on them",
    )
    require(
        gpus == 0 or device in ("cuda", "cuda:0"),
        "engine.device",
        device,
        f"'cuda' with engine.gpus_per_worker = {gpus_per_worker}: Ray shows each worker only "
        "the GPU it reserved, as cuda:0 (or set gpus_per_worker = 0 to address GPU N yourself)",
    )


def gpu_share(cluster_gpus: float, num_workers: int) -> float:
    """Each worker's Ray GPUs when ``device = "cuda"`` leaves ``gpus_per_worker`` unset: the
    workers spread over the cluster's GPUs, ``1 / ceil(workers / GPUs)`` each (a fraction
    shares a GPU; Ray packs a fraction within one GPU, so the share divides 1)."""
    whole = int(cluster_gpus)
    if whole < 1:
        raise ConfigError(
            "engine.device",
            "cuda",
            f"a Ray cluster with GPUs (it has {cluster_gpus}); use 'cpu', or start Ray where "
            "the GPUs are (`ray start --num-gpus N`)",
        )
    return 1.0 / math.ceil(num_workers / whole)


def share_datasets(
    backend: Backend, datasets: tuple[tuple[Any, Any], ...]
) -> tuple[SharedDataset, ...]:
    """Each ``(DatasetSpec, FederatedDataset)`` pair with its arrays put into the backend's
    object store once, to be registered on every worker."""
    return tuple(
        SharedDataset(
            spec=spec,
            arrays={k: backend.share(v) for k, v in dataset.to_arrays().items()},
            num_classes=dataset.num_classes,
            name=dataset.name,
        )
        for spec, dataset in datasets
    )


def server_run(run_id: int, run_config: dict[str, Any] | None) -> Run:
    """The server side's Flower :class:`Run` of ``run_id`` (its config overridden by
    ``run_config``), with this process's task identity set to the SuperLink's."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = run_id
    run = Run.create_empty(run_id)
    run.override_config = dict(run_config or {})
    return run


@dataclass
class Engine:
    """A started backend that runs Flower ServerApps and ClientApps."""

    config: EngineConfig = field(default_factory=EngineConfig)
    extra_modules: tuple[str, ...] = ()
    backend: Backend | None = None
    _ray_mode: str | None = None  # "local" or "cluster" when this engine initialised Ray
    _runs: int = 0
    #: seconds of the start-up steps: ``ray_init`` (0 when Ray was already up),
    #: ``workers_spawn`` (asking Ray for the actors), ``workers_ready`` (waiting for them
    #: in :meth:`ready`, after whatever the driver did meanwhile)
    startup_s: dict[str, float] = field(default_factory=dict)
    #: private directories of the root files this engine wrote for its runs (removed by close)
    _root_dirs: list[str] = field(default_factory=list, repr=False)

    def start(self) -> Engine:
        """Start Ray (if needed) and the workers; idempotent.

        Returns as soon as the worker actors are requested: they start and import while the
        caller goes on (building its dataset and strategy); :meth:`ready`, which every run
        calls first, waits for them. When Ray is already initialised (``ray.init`` by the
        caller, or by an earlier engine) it is joined as it is and left running by
        :meth:`close`, so one Ray start can serve many engines.
        """
        if self.backend is not None:
            return self
        cfg = self.config
        if cfg.backend == "local":
            self.backend = LocalBackend(torch_threads=max(1, int(cfg.cpus_per_worker)))
            return self
        began = time.perf_counter()
        if self._start_warm(began):
            return self
        self._ray_mode = self._ray_mode or ensure_ray(
            cfg.ray_address,
            cfg.num_cpus or None,
            self.extra_modules,
            object_store_mb=cfg.object_store_mb,
        )
        spawned = time.perf_counter()
        pin = cfg.pin_workers == "on" or (cfg.pin_workers == "auto" and self._ray_mode == "local")
        self.backend = RayBackend(
            num_workers=cfg.workers or None,
            cpus_per_worker=cfg.cpus_per_worker,
            gpus_per_worker=self._worker_gpus(),
            pin_workers=pin,
            reply_timeout_s=cfg.reply_timeout_s,
        )
        self.startup_s = {
            "ray_init": spawned - began,
            "workers_spawn": time.perf_counter() - spawned,
        }
        return self

    def _start_warm(self, began: float) -> bool:
        """Attach to a warm pool (:mod:`fedsim.engine.warm_pool`) unless Ray is initialised
        or ``warm`` is off; True if this engine now runs on pooled workers."""
        import ray  # noqa: PLC0415

        from fedsim.engine.warm_pool import attach, warm_mode  # noqa: PLC0415

        cfg = self.config
        if ray.is_initialized():
            return False
        keeper = attach(
            warm_mode(cfg.warm),
            cfg.ray_address,
            cfg.num_cpus or None,
            cfg.object_store_mb,
            self.extra_modules,
        )
        if keeper is None:
            if ray.is_initialized():  # joined a cluster without a pool: an ordinary run on it
                self._ray_mode = "cluster"
            return False
        from fedsim.engine.pooled_backend import PooledRayBackend  # noqa: PLC0415

        self._ray_mode = "warm"
        spawned = time.perf_counter()
        self.backend = PooledRayBackend(
            keeper,
            num_workers=cfg.workers or None,
            cpus_per_worker=cfg.cpus_per_worker,
            gpus_per_worker=self._worker_gpus(),
            reply_timeout_s=cfg.reply_timeout_s,
        )
        self.startup_s = {
            "ray_init": spawned - began,
            "workers_spawn": time.perf_counter() - spawned,
        }
        return True

    def ready(self) -> Engine:
        """Start (if needed) and wait until the workers are up; idempotent."""
        backend = self.start().backend
        assert backend is not None
        if "workers_ready" not in self.startup_s and self.config.backend == "ray":
            waited = time.perf_counter()
            backend.ready()
            self.startup_s["workers_ready"] = time.perf_counter() - waited
        return self

    def _worker_gpus(self) -> float:
        """Ray GPUs per worker: ``gpus_per_worker`` if set, else :func:`gpu_share` of the
        cluster's GPUs for ``device = "cuda"``, else 0."""
        cfg = self.config
        if cfg.gpus_per_worker is not None:
            return cfg.gpus_per_worker
        if cfg.device != "cuda":
            return 0.0
        import ray  # noqa: PLC0415

        resources = ray.cluster_resources()
        workers = cfg.workers or max(1, int(resources.get("CPU", 0.0) // cfg.cpus_per_worker))
        return gpu_share(resources.get("GPU", 0.0), workers)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def root_source(self, secrets: RunSecret | RootSource | None) -> RootSource | None:
        """Where this engine's workers find a run's root: ``secrets`` itself when it is a
        :class:`RootSource` (the driver reads nothing); a :class:`RunSecret` the caller holds
        is written to a private file (mode 0600, removed by :meth:`close`) for the workers to
        open. None: None (clients draw fresh OS secrets for every call)."""
        if secrets is None or isinstance(secrets, RootSource):
            return secrets
        if not isinstance(secrets, RunSecret):
            raise ValueError(
                f"secrets is a {type(secrets).__name__}; allowed: RootSource, RunSecret or None"
            )
        where = tempfile.mkdtemp(prefix="fedsim-root-")
        self._root_dirs.append(where)
        return RootSource(str(secrets.write(Path(where) / "run.root")))

    def fresh_root(self) -> RootSource:
        """A fresh root of OS randomness written by a worker (the driver never reads it)."""
        source = self.ready().backend.fresh_root()
        self._root_dirs.append(str(Path(source.path).parent))
        return source

    def server_secret(self, source: RootSource):
        """The server's own :class:`~fedsim.randomness.PartySecret` under ``source``, derived
        on a worker."""
        return self.ready().backend.server_secret(source)

    def close(self) -> None:
        """Stop the workers (and Ray, if this engine started it)."""
        for where in self._root_dirs:
            shutil.rmtree(where, ignore_errors=True)
        self._root_dirs.clear()
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self._ray_mode is not None:
            import ray  # noqa: PLC0415

            ray.shutdown()
            self._ray_mode = None

    def describe(self) -> dict[str, Any]:
        return {} if self.backend is None else self.backend.describe()

    def open_run(
        self,
        client_app: ClientApp | ClientAppSource,
        num_clients: int,
        *,
        run_config: dict[str, Any] | None = None,
        participation: CohortModel | None = None,
        observer: PhaseObserver | None = None,
        round_log: RoundLog | None = None,
        state_store: ClientStateStore | None = None,
        faults: FaultConfig | None = None,
        datasets: tuple[tuple[Any, Any], ...] = (),
        run_id: int | None = None,
        raise_errors: bool = False,
        secrets: RunSecret | RootSource | None = None,
    ) -> SimulationGrid:
        """Load a run on the workers and return the grid that drives it.

        Args:
            client_app: the ClientApp, or where to import it from.
            num_clients: registered virtual clients (node ids from the registry).
            run_config: the run's ``context.run_config`` for every client.
            participation: which clients ``get_node_ids`` reports per phase.
            observer: receives each phase's report.
            round_log: where a strategy running its own loop (``Strategy.start``) reports
                the rounds it finished.
            state_store: where clients' states live (default: in memory, spilling
                to a temporary file past 256 MiB).
            faults: dropouts, stragglers and worker crashes to inject.
            datasets: ``(DatasetSpec, FederatedDataset)`` pairs put into the
                object store once and registered on every worker.
            raise_errors: re-raise ClientApp exceptions instead of turning them
                into error replies (useful with the local backend).
            secrets: where the run's secret root lies (:class:`RootSource`; a
                :class:`RunSecret` is written to a private file first): each worker opens it
                and client ``i`` finds its own secret ``root.client(i)`` in ``node_config``
                (None: clients draw theirs from the OS). The driver keeps only the source.
        """
        backend = self.ready().backend
        assert backend is not None
        registry = ClientRegistry(num_clients)
        _check_covers(participation, num_clients)
        self._runs += 1
        run_id = self._runs if run_id is None else run_id
        app, shared = _app_source(client_app), share_datasets(backend, datasets)
        secret = self.root_source(secrets)
        backend.start_run(
            RunSpec(run_id, num_clients, dict(run_config or {}), app, shared, raise_errors, secret)
        )
        return SimulationGrid(
            backend,
            registry,
            server_run(run_id, run_config),
            participation=participation,
            state_store=state_store,
            observer=observer,
            round_log=round_log,
            faults=faults,
            depth=self.config.depth,
        )

    def run_server_app(
        self,
        server_app: ServerApp,
        client_app: ClientApp | ClientAppSource,
        num_supernodes: int,
        *,
        run_config: dict[str, Any] | None = None,
        participation: CohortModel | None = None,
        observer: PhaseObserver | None = None,
        round_log: RoundLog | None = None,
        faults: FaultConfig | None = None,
        raise_errors: bool = False,
        secrets: RunSecret | RootSource | None = None,
    ) -> Context:
        """Run a Flower ServerApp against ``num_supernodes`` virtual clients.

        With ``secrets``, each client gets its own secret in ``node_config`` and the
        ServerApp's context gets the server's (:func:`fedsim.randomness.server_secret` reads
        it), derived by a worker. The ServerApp gets an :class:`~fedsim.engine.app_grid.AppGrid`
        (Flower's Grid interface, no engine internals). Returns the ServerApp's context after
        its ``main`` returned.
        """
        source = self.root_source(secrets)
        server = None if source is None else self.server_secret(source)
        grid = self.open_run(
            client_app,
            num_supernodes,
            run_config=run_config,
            participation=participation,
            observer=observer,
            round_log=round_log,
            faults=faults,
            raise_errors=raise_errors,
            secrets=source,
        )
        context = Context(
            run_id=grid.run.run_id,
            node_id=0,
            node_config={} if server is None else {NODE_SECRET_KEY: server.token()},
            state=RecordDict(),
            run_config=dict(run_config or {}),
        )
        del server
        server_app(AppGrid(grid), context)
        grid.wait_idle()
        return context


def _check_covers(participation: CohortModel | None, num_clients: int) -> None:
    """A participation model (if any) covers exactly the run's ``num_clients`` clients."""
    if participation is not None and participation.num_clients != num_clients:
        raise ValueError(
            f"participation model covers {participation.num_clients} clients, "
            f"the run has {num_clients}"
        )


def _app_source(client_app: ClientApp | ClientAppSource) -> ClientAppSource:
    """Where the workers get ``client_app`` (an object, or already a source)."""
    if isinstance(client_app, ClientAppSource):
        return client_app
    return ClientAppSource(app=client_app)
