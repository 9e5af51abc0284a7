"""Benchmark: the same Flower ServerApp + ClientApp on fedsim, on Flower's runtime,
and as the raw training loop.

Workload: LeNet-5 style CNN, FEMNIST-like 28x28 data (62 classes), 90 training
rows per client (``--rows-per-client``; 0 gives FEMNIST-like writer sizes,
mean about 180), written to disk and memory-mapped, 1000 clients, 50 per round,
batch 10, 1 local epoch, 10 rounds, FedAvg (Message API), no federated
evaluation. The ServerApp seeds Python's ``random`` (which Flower's
FedAvg samples with), so fedsim and the raw loop train the same cohorts.

* fedsim: ``Engine.run_server_app`` on an engine whose workers are already up
  (one per CPU). ``fedsim_cold_s`` is the first run including the start of Ray
  and of the workers (process spawn, torch import).
* Flower: ``flwr.simulation.run_simulation`` with
  ``client_resources={"num_cpus": 1}``, in a fresh process per repetition,
  timed from the call to its return (it starts and stops Ray and its actors
  itself, as in every Flower run; ``fedsim_cold_s`` is fedsim's counterpart).
* raw: one process, one torch thread, the same clients and the same local
  training function on the same memory-mapped data, with no FL machinery;
  ``raw_s / workers`` is the limit any engine with that many workers can reach.

Prints one JSON object with medians over ``--reps`` repetitions:
``speedup_vs_flower = flower_s / fedsim_s``,
``overhead_vs_limit = fedsim_s / (raw_s / workers)`` and
``cold_overhead_s = fedsim_cold_s - fedsim_s`` (what starting Ray and the workers adds),
with ``cold_breakdown``: the engine's start-up steps (``ray_init``, ``workers_spawn``,
``workers_ready``: the wait for the workers after the driver's own set-up) and the cold run's
first and later rounds.

``--app`` times a small plain Flower app (``experiments/bench/app``: Message-API FedAvg, an
MLP on 32 generated rows per node) end to end, each run a fresh process as a user starts it:
``fedsim flwr-run`` against Flower's ``run_simulation`` (``--supernodes``, ``--app-rounds``,
``--clients-per-round``), alternating, and prints the medians and
``speedup_vs_flower = flower_s / fedsim_s`` (also the median of the per-pair ratios).

``--warm-head`` (either mode) also times runs on a warm Ray head (issue 29, point 3): the
benchmark starts one with ``fedsim up`` (its record under a private ``FEDSIM_WARM_DIR`` in a
temp dir) before any timing and stops it with ``fedsim down`` at the end, whatever happens.
The engine benchmark then times, alternating with Flower's repetitions, a fresh process's
first run on an engine that attaches to the head (``fedsim_warm_head_cold_s``, timed as
``fedsim_cold_s``: from the engine's start to the run's end) and reports
``speedup_vs_flower_warm_head = flower_s / fedsim_warm_head_cold_s``; ``--app`` times
``fedsim flwr-run`` attaching to the head (``fedsim_warm_head_s``) in each repetition next to
the cold ``fedsim flwr-run`` (``FEDSIM_WARM=off``) and Flower, and reports
``speedup_vs_flower_warm_head``. Cold runs are always run with the warm pool off, so a head
left up elsewhere never turns them warm. Both modes record the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402

NUM_CLIENTS = 1000
COHORT = 50
CLASSES = 62
SAMPLING_SEED = 0


def make_data(directory: Path, seed: int, rows_per_client: int) -> tuple[Path, dict]:
    """FEMNIST-like writers saved for memory-mapping (0 rows: FEMNIST-like sizes)."""
    from fedsim.data import DatasetSpec, build_dataset  # noqa: PLC0415

    spec = DatasetSpec(
        source="femnist",
        partition="natural",
        num_clients=NUM_CLIENTS,
        samples_per_client=rows_per_client * 5 // 4,
        test_fraction=0.2,
        seed=seed,
    )
    dataset = build_dataset(spec)
    sizes = dataset.train.sizes()
    if rows_per_client and not np.all(sizes == rows_per_client):
        raise RuntimeError(
            f"expected {rows_per_client} training rows per client, got {set(sizes.tolist())}"
        )
    stats = {"mean": float(sizes.mean()), "min": int(sizes.min()), "max": int(sizes.max())}
    return dataset.save(directory), stats


def cohorts(rounds: int) -> list[list[int]]:
    """The partitions FedAvg samples each round: ``random.sample`` over the node
    list, whose i-th entry is partition i on fedsim."""
    rnd = random.Random(SAMPLING_SEED)
    population = list(range(NUM_CLIENTS))
    return [sorted(rnd.sample(population, COHORT)) for _ in range(rounds)]


def apps(data_dir: Path, rounds: int, worker_sums: bool):
    """The Flower ServerApp and ClientApp under test (identical for both runtimes)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: PLC0415
    from flwr.serverapp import Grid, ServerApp  # noqa: PLC0415
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from fedsim.data import DatasetSpec  # noqa: PLC0415
    from fedsim.models import ModelSpec, initial_arrays  # noqa: PLC0415
    from fedsim.record_codec import to_record  # noqa: PLC0415
    from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: PLC0415
    from strategies.plumbing.worker_reduced import WorkerReduced  # noqa: PLC0415

    model = ModelSpec(kind="cnn", input_shape=(1, 28, 28), num_classes=CLASSES, hidden=(120, 84))
    data = DatasetSpec(
        source="npy", partition="natural", num_clients=NUM_CLIENTS, path=str(data_dir)
    )
    training = LocalTraining(epochs=1, batch_size=10, lr=0.05, seed=0)
    client_app = make_client_app(model, data, training)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        random.seed(SAMPLING_SEED)  # Flower's FedAvg samples with Python's random
        strategy = FedAvg(
            fraction_train=COHORT / NUM_CLIENTS,
            fraction_evaluate=0.0,
            min_available_nodes=NUM_CLIENTS,
        )
        if worker_sums:
            strategy = WorkerReduced(strategy)
        arrays: ArrayRecord = to_record(initial_arrays(model, 0))
        strategy.start(
            grid=grid, initial_arrays=arrays, num_rounds=rounds, train_config=ConfigRecord()
        )

    return server_app, client_app, model, data, training


def raw_loop(data_dir: Path, rounds: int) -> float:
    """Seconds for the same local training with no FL machinery (1 thread)."""
    import torch  # noqa: PLC0415

    from fedsim.data import FederatedDataset  # noqa: PLC0415
    from fedsim.models import build_model, initial_arrays, load_arrays, model_arrays  # noqa: PLC0415
    from fedsim.workloads.sgd import train_epochs  # noqa: PLC0415
    from fedsim.workloads.training import as_tensors, client_generator  # noqa: PLC0415

    torch.set_num_threads(1)
    _, _, model_spec, _, training = apps(data_dir, rounds, False)
    dataset = FederatedDataset.load(data_dir, mmap=True)
    model = build_model(model_spec)
    global_arrays = initial_arrays(model_spec, 0)
    start = time.perf_counter()
    for server_round, cohort in enumerate(cohorts(rounds), start=1):
        total = {k: np.zeros_like(v, dtype=np.float64) for k, v in global_arrays.items()}
        weight = 0
        for client in cohort:
            load_arrays(model, global_arrays)
            x, y = as_tensors(*dataset.train.client(int(client)))
            train_epochs(
                model, x, y, training, client_generator(training.seed, server_round, int(client))
            )
            for k, v in model_arrays(model).items():
                total[k] += len(y) * v
            weight += len(y)
        global_arrays = {k: (v / weight).astype(np.float32) for k, v in total.items()}
    return time.perf_counter() - start


def flower_once(data_dir: Path, rounds: int, cpus: int) -> float:
    """One Flower ``run_simulation``, timed as a Flower user waits for it (it
    starts and stops Ray itself)."""
    import logging  # noqa: PLC0415

    from flwr.simulation import run_simulation  # noqa: PLC0415
    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    server_app, client_app, *_ = apps(data_dir, rounds, False)
    start = time.perf_counter()
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=NUM_CLIENTS,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "logging_level": "WARNING"},
        },
    )
    return time.perf_counter() - start


def fedsim_and_raw(
    data_dir: Path, rounds: int, reps: int, workers: int, worker_sums: bool
) -> tuple[float, dict[str, float], list[float], list[float], list[float]]:
    """(cold seconds, where they went, warm seconds, raw seconds, seconds inside the
    ClientApp), the last three per repetition.

    fedsim's and the raw loop's repetitions alternate, so that a slow spell of
    this shared machine affects both alike.
    """
    import logging  # noqa: PLC0415

    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    from fedsim.engine import Engine, EngineConfig  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    server_app, client_app, *_ = apps(data_dir, rounds, worker_sums)
    start = time.perf_counter()
    # a cold start even if a warm head is up (``warm = "auto"`` would attach to it)
    engine = Engine(EngineConfig(workers=workers, num_cpus=workers, warm="off")).start()
    rounds_seen = _RoundTimes()
    engine.run_server_app(server_app, client_app, NUM_CLIENTS, observer=rounds_seen)
    cold = time.perf_counter() - start
    breakdown = {**engine.startup_s, **rounds_seen.summary()}
    warm, raw, compute = [], [], []
    for _ in range(reps):
        raw.append(raw_loop(data_dir, rounds))
        observer = _ComputeTotal()
        start = time.perf_counter()
        engine.run_server_app(server_app, client_app, NUM_CLIENTS, observer=observer)
        warm.append(time.perf_counter() - start)
        compute.append(observer.seconds)
    engine.close()
    return cold, breakdown, warm, raw, compute


def fedsim_once(data_dir: Path, rounds: int, workers: int, worker_sums: bool) -> dict:
    """A fresh process's first run, timed as ``fedsim_cold_s`` (from the engine's start to the
    run's end), on the warm head that ``$FEDSIM_WARM_DIR`` records: refused if the engine did
    not attach to it, so a cold start is never reported as a warm one."""
    import logging  # noqa: PLC0415

    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    from fedsim.engine import Engine, EngineConfig  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    server_app, client_app, *_ = apps(data_dir, rounds, worker_sums)
    start = time.perf_counter()
    engine = Engine(EngineConfig(workers=workers, num_cpus=workers, warm="auto")).start()
    rounds_seen = _RoundTimes()
    try:
        engine.run_server_app(server_app, client_app, NUM_CLIENTS, observer=rounds_seen)
        seconds = time.perf_counter() - start
        mode = engine._ray_mode
    finally:
        engine.close()
    if mode != "warm":
        raise RuntimeError(
            f"the warm-head run did not attach to the head in {os.environ.get('FEDSIM_WARM_DIR')} "
            f"(Ray mode {mode!r})"
        )
    return {"seconds": seconds, "breakdown": {**engine.startup_s, **rounds_seen.summary()}}


#: what the JSON says of the machine the numbers come from
MACHINE_NOTE = (
    "a 2-core machine that other jobs may share (load_average: before and after): absolute "
    "seconds can be inflated; fedsim and Flower alternate, so the ratios are the comparable "
    "numbers"
)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@contextmanager
def warm_head(workers: int, record: dict) -> Iterator[dict[str, str]]:
    """A warm head started by ``fedsim up`` (``workers`` warm workers on ``workers`` CPUs),
    recorded under a private ``FEDSIM_WARM_DIR`` in a temp dir; yields the environment a run
    attaches with (``FEDSIM_WARM=auto``); ``fedsim down`` at the end, whatever happens.
    ``record`` gets ``up_s`` (the seconds ``fedsim up`` took: the head's and the warm
    workers' start, which no timed run pays) and ``stopped`` (``fedsim down`` stopped it)."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="fedsim-bench-warm-") as tmp:
        env = dict(
            os.environ,
            FEDSIM_WARM_DIR=str(Path(tmp) / "warm"),
            FEDSIM_WARM="auto",
            PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        )
        fedsim = [sys.executable, "-m", "fedsim"]
        up = [*fedsim, "up", "--workers", str(workers), "--num-cpus", str(workers)]
        try:
            began = time.perf_counter()
            done = subprocess.run(
                [*up, "--idle-timeout", "900"], env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"fedsim up failed:\n{done.stderr[-3000:]}")
            record["up_s"] = time.perf_counter() - began
            yield env
        finally:
            down = subprocess.run([*fedsim, "down"], env=env, capture_output=True, text=True)
            record["stopped"] = "stopped" in down.stdout


class _RoundTimes:
    """Seconds from the observer's creation to the end of each training phase."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.rounds: list[float] = []

    def phase_finished(self, report) -> None:
        now = time.perf_counter()
        self.rounds.append(now - self.last)
        self.last = now

    def summary(self) -> dict[str, float]:
        """The first round (counted from the run's call: it includes ``workers_ready`` and
        loading the run on the workers) and the median later one."""
        later = self.rounds[1:]
        return {
            "call_to_first_round_end": self.rounds[0] if self.rounds else 0.0,
            "later_round_median": statistics.median(later) if later else 0.0,
        }


class _ComputeTotal:
    """Sums the seconds clients spent inside the ClientApp, over all phases."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def phase_finished(self, report) -> None:
        self.seconds += report.compute_s


APP_DIR = Path(__file__).resolve().parent / "app"


def app_run_config(rounds: int, supernodes: int, clients_per_round: int) -> dict:
    """The bench app's run config for ``rounds`` rounds of ``clients_per_round`` clients."""
    if not 1 <= clients_per_round <= supernodes:
        raise ValueError(
            f"--clients-per-round = {clients_per_round} is not allowed: "
            f"an integer in [1, --supernodes = {supernodes}]"
        )
    return {"num-server-rounds": rounds, "fraction-train": clients_per_round / supernodes}


def flower_app_once(app_dir: Path, supernodes: int, run_config: dict, cpus: int) -> None:
    """Flower's ``run_simulation`` on the app project in ``app_dir``, loaded as ``flwr run``
    loads it (its ``[tool.flwr.app.config]`` with ``run_config`` applied: run_simulation
    takes no run config, so the ServerApp gets it through a wrapper)."""
    import logging  # noqa: PLC0415

    from flwr.clientapp.client_app import LoadClientAppError  # noqa: PLC0415
    from flwr.common.config import flatten_dict, get_project_config  # noqa: PLC0415
    from flwr.serverapp import ServerApp  # noqa: PLC0415
    from flwr.serverapp.server_app import LoadServerAppError  # noqa: PLC0415
    from flwr.simulation import run_simulation  # noqa: PLC0415
    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415
    from flwr.supercore.object_ref import load_app  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    project = get_project_config(app_dir)["tool"]["flwr"]["app"]
    config = {**flatten_dict(project.get("config", {})), **run_config}
    server = load_app(project["components"]["serverapp"], LoadServerAppError, str(app_dir))
    client = load_app(project["components"]["clientapp"], LoadClientAppError, str(app_dir))
    with_config = ServerApp()

    @with_config.main()
    def main(grid, context) -> None:
        context.run_config.update(config)
        server(grid, context)

    run_simulation(
        server_app=with_config,
        client_app=client,
        num_supernodes=supernodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "logging_level": "WARNING"},
        },
    )


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of ``command`` as a fresh process, from spawn to exit; refused after
    :data:`CHILD_TIMEOUT_S` (a Ray whose raylet died hangs its driver), its process group
    killed with it."""
    start = time.perf_counter()
    done = _run(command, env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds


#: seconds a benchmark's child process may run
CHILD_TIMEOUT_S = 1200.0


def _run(command: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    """``command`` in its own session with its output in files (not pipes, which a Ray
    daemon it leaves behind would hold open); on :data:`CHILD_TIMEOUT_S` its process group
    is killed and the run refused."""
    import signal  # noqa: PLC0415

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise RuntimeError(
                f"{' '.join(command)} ran past {CHILD_TIMEOUT_S:.0f} s: stopped"
            ) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())


def _child_json(command: list[str], env: dict[str, str]) -> dict:
    """The last stdout line of ``python COMMAND`` (a fresh process), parsed as JSON."""
    done = _run([sys.executable, *command], env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def _no_head() -> Iterator[None]:
    yield None


def _pairs(flower: list[float], fedsim: list[float]) -> float:
    """The median of the per-pair ratios flower / fedsim."""
    return statistics.median(f / s for f, s in zip(flower, fedsim, strict=True))


def _attached(out: Path) -> bool:
    """Whether the ``fedsim flwr-run`` that wrote ``out`` ran on a warm pool's workers."""
    summary = json.loads((out / "summary.json").read_text())
    return bool(summary.get("engine", {}).get("warm_pool"))


def app_mode(args: argparse.Namespace) -> dict:
    """``fedsim flwr-run`` against ``run_simulation`` on the bench app, end to end."""
    run_config = app_run_config(args.app_rounds, args.supernodes, args.clients_per_round)
    pairs = " ".join(f"{k}={v!r}" for k, v in run_config.items())
    env_python = [sys.executable]
    flower = [
        *env_python,
        __file__,
        "--flower-app-once",
        str(APP_DIR),
        "--supernodes",
        str(args.supernodes),
        "--app-rounds",
        str(args.app_rounds),
        "--clients-per-round",
        str(args.clients_per_round),
        "--workers",
        str(args.workers),
    ]
    times: dict[str, list[float]] = {"fedsim_s": [], "flower_s": []}
    # (key, backend, warm head?): the cold ``fedsim flwr-run`` always with the pool off
    kinds = [("fedsim_s", "ray", False)]
    if args.warm_head:
        kinds.append(("fedsim_warm_head_s", "ray", True))
    if args.also_local:
        kinds.append(("fedsim_local_s", "local", False))
    for key, *_ in kinds:
        times[key] = []
    cold_env = dict(os.environ, FEDSIM_WARM="off")
    load = [_load()]
    head: dict = {}
    with (
        tempfile.TemporaryDirectory(prefix="fedsim-bench-app-") as tmp,
        warm_head(args.workers, head) if args.warm_head else _no_head() as head_env,
    ):
        for rep in range(args.reps):
            for key, backend, warm in kinds:
                out = Path(tmp) / f"{key}-{rep}"
                fedsim = [
                    *env_python,
                    "-m",
                    "fedsim",
                    "flwr-run",
                    str(APP_DIR),
                    "--num-supernodes",
                    str(args.supernodes),
                    "--run-config",
                    pairs,
                    "--out",
                    str(out),
                    "--no-progress",
                    "--workers",
                    str(args.workers),
                    "--client-cpus",  # as Flower's side: not Flower's default of 2
                    "1",
                    "--backend",
                    backend,
                ]
                times[key].append(_timed(fedsim, head_env if warm else cold_env))
                if backend == "ray" and _attached(out) != warm:
                    raise RuntimeError(
                        f"{key}: the run {'did not attach' if warm else 'attached'} to a warm pool"
                    )
            times["flower_s"].append(_timed(flower, cold_env))
    load.append(_load())
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "workload": {
            "app": "experiments/bench/app (Message-API FedAvg, MLP 16-32-4, 32 rows per node)",
            "supernodes": args.supernodes,
            "rounds": args.app_rounds,
            "clients_per_round": args.clients_per_round,
        },
        "workers": args.workers,
        "repetitions": args.reps,
        "load_average": load,
        "machine": MACHINE_NOTE,
        "niceness": os.nice(0),
        **medians,
        "speedup_vs_flower": medians["flower_s"] / medians["fedsim_s"],
        "speedup_vs_flower_pairs": _pairs(times["flower_s"], times["fedsim_s"]),
        "all": times,
    }
    if args.warm_head:
        result["warm_head"] = head
        result["speedup_vs_flower_warm_head"] = medians["flower_s"] / medians["fedsim_warm_head_s"]
        result["speedup_vs_flower_warm_head_pairs"] = _pairs(
            times["flower_s"], times["fedsim_warm_head_s"]
        )
    if args.also_local:
        result["speedup_vs_flower_local"] = medians["flower_s"] / medians["fedsim_local_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rows-per-client",
        type=int,
        default=90,
        help="training rows of every client (0: FEMNIST-like writer sizes, mean about 180)",
    )
    parser.add_argument(
        "--no-worker-sums", action="store_true", help="send every reply to the server"
    )
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument(
        "--app",
        action="store_true",
        help="time `fedsim flwr-run` against Flower's run_simulation on a small Flower app, "
        "end to end (fresh processes)",
    )
    parser.add_argument("--supernodes", type=int, default=50, help="--app: virtual nodes")
    parser.add_argument("--app-rounds", type=int, default=5, help="--app: rounds")
    parser.add_argument(
        "--clients-per-round", type=int, default=10, help="--app: clients trained per round"
    )
    parser.add_argument(
        "--also-local",
        action="store_true",
        help="--app: also time `fedsim flwr-run --backend local` (clients in the driver)",
    )
    parser.add_argument(
        "--warm-head",
        action="store_true",
        help="also time runs attaching to a warm head (`fedsim up` before timing, "
        "`fedsim down` after; a private FEDSIM_WARM_DIR)",
    )
    parser.add_argument("--flower-once", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--fedsim-once", metavar="DATA_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--flower-app-once", metavar="APP_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.flower_app_once:
        run_config = app_run_config(args.app_rounds, args.supernodes, args.clients_per_round)
        flower_app_once(Path(args.flower_app_once), args.supernodes, run_config, args.workers)
        return
    if args.app:
        print(json.dumps(app_mode(args), indent=2))
        return

    if args.fedsim_once:
        once = fedsim_once(
            Path(args.fedsim_once), args.rounds, args.workers, not args.no_worker_sums
        )
        print(json.dumps(once))
        return
    if args.flower_once:
        print(
            json.dumps({"seconds": flower_once(Path(args.flower_once), args.rounds, args.workers)})
        )
        return

    load = [_load()]
    head: dict = {}
    warm_head_runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fedsim-bench-") as tmp:
        data_dir, sizes = make_data(Path(tmp) / "femnist", args.seed, args.rows_per_client)
        cold, breakdown, warm, raw, compute = fedsim_and_raw(
            data_dir, args.rounds, args.reps, args.workers, not args.no_worker_sums
        )
        child = [
            "--rounds",
            str(args.rounds),
            "--workers",
            str(args.workers),
            *(["--no-worker-sums"] if args.no_worker_sums else []),
        ]
        flower: list[float] = []
        with warm_head(args.workers, head) if args.warm_head else _no_head() as head_env:
            for _ in range(args.reps):
                if head_env is not None:  # alternating: a run on the warm head, then Flower
                    warm_head_runs.append(
                        _child_json([__file__, "--fedsim-once", str(data_dir), *child], head_env)
                    )
                if not args.skip_flower:
                    flower_child = [__file__, "--flower-once", str(data_dir), *child]
                    flower.append(_child_json(flower_child, dict(os.environ))["seconds"])
    load.append(_load())

    fedsim_s = statistics.median(warm)
    raw_s = statistics.median(raw)
    result = {
        "workload": {
            "clients": NUM_CLIENTS,
            "training_rows_per_client": sizes,
            "clients_per_round": COHORT,
            "rounds": args.rounds,
            "batch_size": 10,
            "local_epochs": 1,
            "model": "LeNet-5 CNN, 62 classes",
            "worker_sums": not args.no_worker_sums,
        },
        "workers": args.workers,
        "repetitions": args.reps,
        "fedsim_s": fedsim_s,
        "fedsim_cold_s": cold,
        "cold_overhead_s": cold - fedsim_s,
        "cold_breakdown": breakdown,
        "raw_s": raw_s,
        "limit_s": raw_s / args.workers,
        "overhead_vs_limit": fedsim_s / (raw_s / args.workers),
        # seconds all clients spent inside the ClientApp on fedsim's workers,
        # relative to the raw loop: the part of the overhead that is compute
        "clientapp_vs_raw": statistics.median(compute) / raw_s,
        "load_average": load,
        "machine": MACHINE_NOTE,
        "niceness": os.nice(0),
        "all": {"fedsim_s": warm, "raw_s": raw, "flower_s": flower},
    }
    if warm_head_runs:
        result["warm_head"] = head
        seconds = [r["seconds"] for r in warm_head_runs]
        result["fedsim_warm_head_cold_s"] = statistics.median(seconds)
        result["warm_head_breakdown"] = [r["breakdown"] for r in warm_head_runs]
        result["all"]["fedsim_warm_head_cold_s"] = seconds
    if flower:
        flower_s = statistics.median(flower)
        result["flower_s"] = flower_s
        result["speedup_vs_flower"] = flower_s / fedsim_s
        result["speedup_vs_flower_cold"] = flower_s / cold
        if warm_head_runs:
            result["speedup_vs_flower_warm_head"] = flower_s / result["fedsim_warm_head_cold_s"]
            result["speedup_vs_flower_warm_head_pairs"] = _pairs(flower, seconds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
