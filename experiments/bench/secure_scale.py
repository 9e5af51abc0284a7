"""Benchmark: secure aggregation at large-federation scale, against plaintext FedAvg.

Every point runs in a fresh process: the engine (``--workers`` Ray workers, one CPU each)
registers ``--population`` stateful clients (the engine's client registry; node ids are
computed, states live in the client-state store: ``--state-memory-mb`` (256) MiB in memory,
then SQLite), draws a
uniform cohort of C clients per round, injects the dropout model ``[faults] dropout =
--dropout`` (a sampled client never answers; in DDGauss full mode this applies to every
SecAgg+ exchange, so clients also drop out inside the protocol), and runs ``--warmup`` +
``--rounds`` rounds of one *mode* on a model of d parameters (one float32 vector):

* ``fedavg``: plaintext FedAvg (Flower's ``FedAvg`` with the engine's worker-side partial
  sums, its fastest path), the reference every ratio is taken against;
* ``ddgauss``: DDGauss in full mode (``strategies.methods.ddgauss.strategy``, KLS21 over SecAgg+
with real
  X25519 / ChaCha20-Poly1305 / Shamir): each client clips, rotates, rounds and noises its
  update and masks it inside its ClientApp, and the strategy runs SecAgg+ as three more
  message exchanges through the engine (``--secagg-degree`` neighbours, a majority
  threshold, masks in Z_2^``--ring-bits`` from the ``--prg`` keystream: ChaCha20 or AES-256-CTR).

A mode is a function ``(point) -> ModeRun`` registered in :data:`MODES`; a committee mode
also reports its members' CPU seconds and bytes per member (``ModeRun.committee``).

The clients' work is a *workload* (``--workload``, :data:`secure_workloads.WORKLOADS`), the
same under every mode (the secure modes wrap its ClientApp): ``synthetic`` (the default), a
fixed update of norm 0.5 drawn from ``(partition, round)``, so the benchmark measures the
protocol and the engine, not training; or ``lenet``, the engine benchmark's LeNet-5 trained
for one local epoch on FEMNIST-like writers (``--writers``, ``--rows-per-writer``; built once
per invocation and memory-mapped by the workers; d is the model's, ``--dims`` is ignored).
With 10^6 registered clients and ``--writers`` writers, **registered client p trains on
writer p % writers** (its node id, secret and state stay its own). Either way each client
keeps a small state (its rounds seen) in the client-state store; see
``experiments/bench/secure_workloads.py``.

Per round it records: ``round_s`` (wall seconds, driver), ``client_s`` (seconds inside the
ClientApps, summed over every client call of the round; the clients' CPU), ``server_cpu_s``
(CPU seconds of the driver's main thread: the strategy, the protocol's server side and the
grid's message handling), ``committee_cpu_s`` (committee modes), ``bytes_up_per_client`` /
``bytes_down_per_client`` (serialised message contents each cohort client sends / receives,
summed over the round's exchanges, divided by the cohort), ``bytes_per_member``,
``global_change_l2`` (how far the global model moved), for a training workload ``train_s``
(the clients' own training seconds, read back from their states), ``train_calls`` and
``secure_s`` = ``client_s`` - ``train_s`` (encoding, noise, masking, sharing, sealing, the
protocol's other exchanges), and per point the peak resident memory of the driver and of
each worker and the load average before and after (``load_average``: 1, 5, 15 min).
Points alternate modes within a repetition, so a slow spell of the shared machine hits all
modes alike;
``ratio_round_s`` is a mode's median round over plaintext FedAvg's at the same (cohort, d),
``ratio_vs_ddgauss`` a DMM mode's over DDGauss's.
``--populations`` also runs the smallest cohort and d at each population for the "memory
flat in the registered clients" check (``population_sweep``). The curve (time per round
against cohort, log-log, with the fitted exponent t ∝ C^a per mode and d) goes to
``--plot``; the JSON to stdout and ``--out`` (rewritten after every point). ``--merge`` combines
runs made with different settings per d into one JSON and plot; ``--profile`` runs one point
with the clients in the driver under cProfile; ``--md`` writes the table of the JSON (``--table
JSON`` makes it from a stored one).
Results and the profile: ``experiments/bench/secure_scale.md``; the LeNet workload:
``experiments/bench/secure_scale_lenet.md``.

    nice -n 10 .venv/bin/python experiments/bench/secure_scale.py \
        --cohorts 100 --dims 10000 --rounds 2
    nice -n 10 .venv/bin/python experiments/bench/secure_scale.py --workload lenet \
        --modes fedavg,ddgauss,dmm --cohorts 100,300 --rounds 2 --md lenet.md --out lenet.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from experiments.bench.secure_report import (  # noqa: E402
    Rounds,
    markdown,
    merge,
    plot,
    report,
    summarise,
)
from experiments.bench.secure_workloads import (  # noqa: E402, F401  (re-exported)
    ARRAY_KEY,
    LENET_DIM,
    UPDATE_NORM,
    WORKLOADS,
    make_writers,
    synthetic_client_app,
    training_seconds,
)

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the modes
@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    mode: str
    cohort: int
    dim: int
    population: int
    rounds: int
    warmup: int
    workers: int
    dropout: float
    seed: int
    secagg_degree: int
    ring_bits: int
    noise_multiplier: float
    state_memory_mb: int = 256
    prg: str = "chacha20"
    backend: str = "ray"
    workload: str = "synthetic"
    writers: int = 0
    data_dir: str = ""


@dataclass
class ModeRun:
    """What a mode gives the harness: the server strategy, the ClientApp, the run's secret
    root (None: clients draw from the OS) and, for committee modes, ``committee()``: the
    committee's CPU seconds and bytes per member since the last call (a dict with
    ``committee_cpu_s`` and ``bytes_per_member``). ``bind(engine, grid)`` runs once the
    grid is open (e.g. to host a committee on the engine)."""

    strategy: Any
    client_app: Any
    secrets: Any = None
    committee: Callable[[], dict[str, float]] | None = None
    bind: Callable[[Any, Any], None] | None = None
    details: dict[str, Any] = field(default_factory=dict)


def workload_app(point: Point):
    """The ClientApp of ``point``'s workload (:data:`secure_workloads.WORKLOADS`)."""
    return WORKLOADS[point.workload].client_app(point)


def fedavg_mode(point: Point) -> ModeRun:
    """Plaintext FedAvg with worker-side partial sums."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from strategies.plumbing.seeded_sampling import SeededSampling  # noqa: PLC0415
    from strategies.plumbing.worker_reduced import WorkerReduced  # noqa: PLC0415

    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
    strategy = SeededSampling(WorkerReduced(inner), point.seed)
    return ModeRun(strategy, workload_app(point))


def ddgauss_mode(point: Point) -> ModeRun:
    """DDGauss in full mode: SecAgg+ over the engine, clients masking in their ClientApp."""
    from fedsim.randomness import RunSecret  # noqa: PLC0415
    from strategies.methods.ddgauss.client import ddgauss_client_app  # noqa: PLC0415
    from strategies.methods.ddgauss.spec import from_options  # noqa: PLC0415
    from strategies.plumbing.seeded_sampling import SeededSampling  # noqa: PLC0415

    options = {
        "clipping_norm": 1.0,
        "noise_multiplier": point.noise_multiplier,
        "mode": "full",
        "secagg_degree": point.secagg_degree,
        "ring_bits": point.ring_bits,
        "bits": min(point.ring_bits, 20),
        "prg": point.prg,
    }
    strategy = from_options(options, expected_clients=point.cohort, seed=point.seed)
    app = ddgauss_client_app(workload_app(point))
    secrets = RunSecret.fresh()  # each client's own secret comes from it, never the seed
    return ModeRun(
        SeededSampling(strategy, point.seed),
        app,
        secrets,
        details={"options": options},
    )


def dmm_mode(point: Point, worker_fold: bool = True) -> ModeRun:
    """DMM in full mode with committees of clients: n = 20, t = 3, k = 3, 3 planned member
    dropouts (the defaults), a banded M of 2 bands (each committee hands one partial sum to
    the next by linear packed resharing), members hosted on 2 committee actors, each with its
    client's own secret and the run's dropout, and the clients of each worker batch folding
    their sharing inputs into one sealed message per batch (``worker_fold``; mode
    ``dmm-unfolded``: every client shares and seals its own, as it must under a runtime
    whose workers do not fold)."""
    from fedsim.engine import FaultConfig  # noqa: PLC0415
    from fedsim.engine.dmm_committee import CommitteeHost  # noqa: PLC0415
    from fedsim.privacy.participation import Participation  # noqa: PLC0415
    from fedsim.randomness import RunSecret  # noqa: PLC0415
    from protocols.kit import NEW_ID_BASE, OLD_ID_BASE, SEAT_ID_BASE  # noqa: PLC0415
    from strategies.methods.dmm import dmm_client_app, from_options  # noqa: PLC0415
    from strategies.plumbing.seeded_sampling import SeededSampling  # noqa: PLC0415

    options = {
        "clipping_norm": 1.0,
        "noise_multiplier": point.noise_multiplier,
        "mode": "full",
        "bands": 2,
        "committee_actors": True,
        "committee_shards": 2,
        "worker_fold": worker_fold,
    }
    strategy = from_options(
        dict(options),
        rounds=point.warmup + point.rounds + 1,  # the last measured round hands off too
        expected_clients=point.cohort,
        population=point.population,
        seed=point.seed,
        # the bands of M; a client sampled twice in a row is refused
        participation=Participation.separated(2),
    )
    secrets = RunSecret.fresh()  # each client's own secret comes from it, never the seed
    state: dict[str, Any] = {"cpu": 0.0}

    def bind(engine, grid) -> None:
        faults = FaultConfig(dropout=point.dropout, seed=point.seed)
        state["host"] = CommitteeHost(
            secrets, faults, actors=True, shards=2, draw=(point.seed, point.population)
        )
        strategy.bind_committee_host(state["host"])

    def committee() -> dict[str, float]:
        cpu = state["host"].cpu_seconds() if "host" in state else 0.0
        spent, state["cpu"] = cpu - state["cpu"], cpu
        output = strategy.last_output
        if output is None:
            return {"committee_cpu_s": spent, "bytes_per_member": None}
        t, seats = output.transcript, range(strategy.secure.scheme.n)
        per_member = [
            sum(
                t.nbytes(receiver=base + j) + t.nbytes(sender=base + j)
                for base in (SEAT_ID_BASE, OLD_ID_BASE)
            )
            for j in seats
        ]
        nxt = [t.nbytes(receiver=NEW_ID_BASE + j) + t.nbytes(sender=NEW_ID_BASE + j) for j in seats]
        return {
            "committee_cpu_s": spent,
            "bytes_per_member": float(np.mean(per_member)),
            "bytes_per_next_member": float(np.mean(nxt)),
            "noise_clients": output.contributors,
        }

    return ModeRun(
        SeededSampling(strategy, point.seed),
        dmm_client_app(workload_app(point)),
        secrets,
        committee=committee,
        bind=bind,
        details={"options": options, "n": 20, "t": 3, "k": 3},
    )


MODES: dict[str, Callable[[Point], ModeRun]] = {
    "fedavg": fedavg_mode,
    "ddgauss": ddgauss_mode,
    "dmm": dmm_mode,
    "dmm-unfolded": lambda point: dmm_mode(point, worker_fold=False),
}
"""Benchmark modes by name; ``fedavg`` is the reference of every ratio."""


# ----------------------------------------------------------------------------- one point
def _round_recorder(mode: ModeRun, rows: list[dict[str, Any]], initial: dict[str, np.ndarray]):
    """The ``on_round`` callback: per round its wall and driver-CPU seconds (the callback's
    own time excluded), the protocol's survivors, the committee's numbers and the L2 norm of
    the change of the global model (``global_change_l2``)."""
    from fedsim.record_codec import to_numpy  # noqa: PLC0415

    clock = {"wall": time.perf_counter(), "cpu": time.thread_time()}
    last = {"flat": np.concatenate([v.ravel() for v in initial.values()])}

    def on_round(outcome) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        metrics = dict(outcome.train_metrics or {})
        arrays = to_numpy(outcome.arrays)
        flat = np.concatenate([np.asarray(arrays[k], np.float64).ravel() for k in initial])
        row = {
            "round": outcome.server_round,
            "round_s": wall - clock["wall"],
            "server_cpu_s": cpu - clock["cpu"],
            "survivors": metrics.get("ddgauss-survivors"),
            "aborted": metrics.get("ddgauss-aborted"),
            "global_change_l2": float(np.linalg.norm(flat - last["flat"])),
        }
        last["flat"] = flat
        if mode.committee is not None:
            row.update(mode.committee())
        rows.append(row)
        clock["wall"], clock["cpu"] = time.perf_counter(), time.thread_time()

    return on_round


def _engine(point: Point):
    """A started engine of ``point.workers`` workers (one CPU each)."""
    from fedsim.engine import Engine, EngineConfig  # noqa: PLC0415

    config = EngineConfig(
        backend=point.backend, workers=point.workers, num_cpus=point.workers, object_store_mb=1024
    )
    return Engine(config).start()


def run_point(point: Point) -> dict[str, Any]:
    """Run ``point`` in this process and return its measurements."""
    import logging  # noqa: PLC0415

    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    from fedsim.engine import ClientStateStore, FaultConfig, UniformCohort  # noqa: PLC0415
    from fedsim.engine.metrics import peak_rss_mb  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.record_codec import to_record  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    logging.getLogger("strategies").setLevel(logging.ERROR)
    load_before = list(os.getloadavg())
    mode, observer, rows = MODES[point.mode](point), Rounds(), []
    engine = _engine(point)
    initial = WORKLOADS[point.workload].initial(point)
    with tempfile.TemporaryDirectory(prefix="fedsim-secure-scale-") as tmp:
        store = ClientStateStore(
            Path(tmp) / "state.sqlite", memory_budget=point.state_memory_mb * 2**20
        )
        grid = engine.open_run(
            mode.client_app,
            point.population,
            run_config={"seed": point.seed},  # DMM clients recompute the committee draw
            participation=UniformCohort(point.population, point.cohort, point.seed),
            state_store=store,
            observer=observer,
            faults=FaultConfig(dropout=point.dropout, seed=point.seed),
            secrets=mode.secrets,
        )
        if mode.bind is not None:
            mode.bind(engine, grid)
        if mode.committee is not None:
            mode.committee()  # reset its counters
        on_round = _round_recorder(mode, rows, initial)
        total_rounds = point.warmup + point.rounds
        run_rounds(mode.strategy, grid, to_record(initial), total_rounds, on_round=on_round)
        grid.wait_idle()
        workers = getattr(engine.backend, "worker_peak_rss_mb", list)()
        stored = len(store)
        trains = point.workload != "synthetic"
        training = training_seconds(store, observer.train_nodes) if trains else None
        store.close()
    engine.close()
    for row in rows:
        observer.attach(row, point.cohort, training)
    driver = peak_rss_mb()
    return {
        "rounds": rows[point.warmup :],
        "warmup_rounds": rows[: point.warmup],
        "clients_with_state": stored,
        "peak_rss_mb": {"driver": driver, "workers": workers, "total": driver + sum(workers)},
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "details": mode.details,
    }


# ----------------------------------------------------------------------------- driver
def _points(args: argparse.Namespace) -> list[Point]:
    """The (mode, cohort, d) grid; d = 10^6 only at the smallest cohort (``--big-dim-cohorts``);
    a workload with a model of its own has its d (``--dims`` ignored)."""
    out = []
    fixed = WORKLOADS[args.workload].dim
    for dim in args.dims if fixed is None else [fixed]:
        cohorts = (
            args.cohorts if dim < 10**6 else [c for c in args.cohorts if c <= args.big_dim_cohort]
        )
        for cohort in cohorts:
            for mode in args.modes:
                out.append(_point(args, mode, cohort, dim, args.population))
    return out


def _point(args: argparse.Namespace, mode: str, cohort: int, dim: int, population: int) -> Point:
    return Point(
        mode=mode,
        cohort=cohort,
        dim=dim,
        population=population,
        rounds=args.rounds,
        warmup=args.warmup,
        workers=args.workers,
        dropout=args.dropout,
        seed=args.seed,
        secagg_degree=args.secagg_degree,
        ring_bits=args.ring_bits,
        noise_multiplier=args.noise_multiplier,
        state_memory_mb=args.state_memory_mb,
        prg=args.prg,
        workload=args.workload,
        writers=args.writers if args.workload == "lenet" else 0,
        data_dir=args.data_dir,
    )


def _in_subprocess(point: Point) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(point.__dict__)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"point {point} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ints(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",") if v]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--workload", choices=list(WORKLOADS), default="synthetic")
    parser.add_argument("--writers", type=int, default=1000, help="lenet: FEMNIST-like writers")
    parser.add_argument(
        "--rows-per-writer", type=int, default=90, help="lenet: training rows per writer"
    )
    parser.add_argument("--cohorts", type=_ints, default=[100, 300, 1000])
    parser.add_argument("--dims", type=_ints, default=[10**4, 10**5, 10**6])
    parser.add_argument(
        "--big-dim-cohort", type=int, default=100, help="largest cohort run at d >= 10^6"
    )
    parser.add_argument("--population", type=int, default=10**6, help="registered clients")
    parser.add_argument(
        "--populations",
        type=_ints,
        default=[],
        help="also run the smallest cohort and d at each of these populations (memory sweep)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per point")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.02)
    parser.add_argument("--secagg-degree", type=int, default=16)
    parser.add_argument("--ring-bits", type=int, default=32)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument(
        "--state-memory-mb",
        type=int,
        default=256,
        help="client states kept in memory (MiB, the engine's default) before SQLite",
    )
    parser.add_argument(
        "--prg", choices=["chacha20", "aes-ctr"], default="chacha20", help="DDGauss's mask PRG"
    )
    parser.add_argument("--seed", type=int, default=0)
    _output_arguments(parser)
    return parser


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--md", type=Path, default=None, help="write the Markdown table here")
    parser.add_argument("--plot", type=Path, default=None, help="write the log-log curve here")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="instead: run the first point in this process (clients in the driver, the "
        "engine's local backend) under cProfile and write the profile here",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="instead: combine the JSON of earlier runs (e.g. small d with more rounds, large d "
        "with fewer) into one --out and --plot, exponents fitted over all their points",
    )
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        help="instead: the Markdown table of this stored JSON, to --md (else stdout)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.data_dir = ""  # the lenet writers' directory, once main has built them
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: {unknown} unknown; allowed: {', '.join(MODES)}")
    if "fedavg" not in args.modes:
        parser.error("--modes must include 'fedavg': every ratio is taken against it")
    for name in ("rounds", "repeats", "workers", "population", "writers", "rows_per_writer"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout={args.dropout}; allowed: a probability in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.one:
        print(json.dumps(run_point(Point(**json.loads(args.one)))))
        return {}
    if args.merge:
        return merge(args.merge, args.out, args.plot)
    if args.table:
        text = markdown(json.loads(args.table.read_text()))
        print(text, end="") if args.md is None else args.md.write_text(text)
        return {}
    if args.workload == "synthetic":
        return _measure(args)
    with tempfile.TemporaryDirectory(prefix="fedsim-secure-writers-") as tmp:
        args.data_dir = str(make_writers(Path(tmp), args.writers, args.rows_per_writer, args.seed))
        return _measure(args)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every point (each in a fresh process), writing the JSON (and table) after each."""
    points = _points(args)
    if args.profile is not None:
        return profile(points[-1], args.profile)
    sweep = [
        _point(args, mode, min(args.cohorts), points[0].dim, population)
        for population in args.populations
        for mode in args.modes
    ]
    # the cheap memory sweep first; a sweep point equal to a grid point runs once
    runs: dict[Point, list[dict]] = {p: [] for p in (*sweep, *points)}
    result: dict[str, Any] = {}
    for _ in range(args.repeats):
        for point in runs:
            measured = _in_subprocess(point)
            runs[point].append(measured)
            brief = summarise([measured])
            print(
                f"{point.mode} C={point.cohort} d={point.dim} N={point.population}: "
                f"{brief['round_s']:.3f} s/round, peak {brief['peak_rss_mb']['total']:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
            result = report(args, points, sweep, runs)  # written after every point
            if args.out is not None:
                args.out.write_text(json.dumps(result, indent=2) + "\n")
            if args.md is not None:
                args.md.write_text(markdown(result))
    print(json.dumps(result, indent=2))
    if args.plot is not None:
        plot(result["points"], result["exponents"], args.plot)
    return result


def profile(point: Point, path: Path) -> dict[str, Any]:
    """Run ``point`` with the clients in this process under cProfile: the stats go to
    ``path`` (pstats) and the top functions by own time to stdout."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    local = Point(**{**point.__dict__, "backend": "local"})
    if point.mode == "dmm":  # its committee members are Ray actors even beside local clients
        from fedsim.engine.cluster import ensure_ray  # noqa: PLC0415

        ensure_ray(num_cpus=point.workers)
    profiler = cProfile.Profile()
    result = profiler.runcall(run_point, local)
    profiler.dump_stats(path)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    print(json.dumps(summarise([result]), indent=1))
    return result


if __name__ == "__main__":
    main()
