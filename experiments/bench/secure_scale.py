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
* ``ddgauss``: DDGauss in full mode (``strategies.ddgauss``, KLS21 over SecAgg+ with real
  X25519 / ChaCha20-Poly1305 / Shamir): each client clips, rotates, rounds and noises its
  update and masks it inside its ClientApp, and the strategy runs SecAgg+ as three more
  message exchanges through the engine (``--secagg-degree`` neighbours, a majority
  threshold, masks in Z_2^``--ring-bits``).

A mode is a function ``(point) -> ModeRun`` registered in :data:`MODES`; a committee mode
also reports its members' CPU seconds and bytes per member (``ModeRun.committee``).

The clients' training is a fixed synthetic workload (:func:`synthetic_client_app`): a
client's update is a fixed vector of norm 0.5 drawn from ``(partition, round)``, so the
benchmark measures the protocol and the engine, not training; the client still keeps a small
state (its rounds seen) in the client-state store.

Per round it records: ``round_s`` (wall seconds, driver), ``client_s`` (seconds inside the
ClientApps, summed over every client call of the round; the clients' CPU), ``server_cpu_s``
(CPU seconds of the driver's main thread: the strategy, the protocol's server side and the
grid's message handling), ``committee_cpu_s`` (committee modes), ``bytes_up_per_client`` /
``bytes_down_per_client`` (serialised message contents each cohort client sends / receives,
summed over the round's exchanges, divided by the cohort), ``bytes_per_member``, and per
point the peak resident memory of the driver and of each worker. Points alternate modes
within a repetition, so a slow spell of the shared machine hits all modes alike;
``ratio_round_s`` is a mode's median round over plaintext FedAvg's at the same (cohort, d).
``--populations`` also runs the smallest cohort and d at each population for the "memory
flat in the registered clients" check (``population_sweep``). The curve (time per round
against cohort, log-log, with the fitted exponent t ∝ C^a per mode and d) goes to
``--plot``; the JSON to stdout and ``--out`` (rewritten after every point). ``--merge`` combines
runs made with different settings per d into one JSON and plot; ``--profile`` runs one point
with the clients in the driver under cProfile. Results and the profile:
``experiments/bench/secure_scale.md``.

    nice -n 10 .venv/bin/python experiments/bench/secure_scale.py \
        --cohorts 100 --dims 10000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

UPDATE_NORM = 0.5
"""L2 norm of every synthetic client update (below the clipping norm 1)."""
ARRAY_KEY = "w"
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the workload
def synthetic_client_app(dim: int, seed: int):
    """A real Flower ClientApp whose train reply is the global vector plus a fixed update of
    norm :data:`UPDATE_NORM`, the client's simulated data: the public stream ``(seed, round,
    Stream.PARTITION, partition)``; the client counts its rounds in ``context.state`` (so every
    client is stateful)."""
    from flwr.app import (  # noqa: PLC0415
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp  # noqa: PLC0415

    from fedsim.randomness import Stream, public_generator  # noqa: PLC0415
    from fedsim.record_codec import to_numpy, to_record  # noqa: PLC0415

    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        ((key, record),) = [
            (k, v) for k, v in message.content.items() if isinstance(v, ArrayRecord)
        ]
        weights = to_numpy(record)[ARRAY_KEY]
        if weights.shape != (dim,):
            raise ValueError(f"the global vector has shape {weights.shape}, expected ({dim},)")
        config = message.content["config"]
        partition = int(context.node_config["partition-id"])
        server_round = int(config.get("server-round", 0))
        rng = public_generator(seed, server_round, Stream.PARTITION, partition)
        update = rng.standard_normal(dim, dtype=np.float32)
        update *= UPDATE_NORM / float(np.linalg.norm(update))
        seen = context.state.get("synthetic")
        rounds = int(seen["rounds"]) + 1 if isinstance(seen, ConfigRecord) else 1
        context.state["synthetic"] = ConfigRecord({"rounds": rounds})
        content = RecordDict(
            {
                key: to_record({ARRAY_KEY: weights + update}),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        )
        return Message(content=content, reply_to=message)

    return app


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
    backend: str = "ray"


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


def fedavg_mode(point: Point) -> ModeRun:
    """Plaintext FedAvg with worker-side partial sums."""
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415

    from strategies.seeded_sampling import SeededSampling  # noqa: PLC0415
    from strategies.worker_reduced import WorkerReduced  # noqa: PLC0415

    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
    strategy = SeededSampling(WorkerReduced(inner), point.seed)
    return ModeRun(strategy, synthetic_client_app(point.dim, point.seed))


def ddgauss_mode(point: Point) -> ModeRun:
    """DDGauss in full mode: SecAgg+ over the engine, clients masking in their ClientApp."""
    from fedsim.randomness import RunSecret  # noqa: PLC0415
    from strategies.ddgauss import ddgauss_client_app, from_options  # noqa: PLC0415
    from strategies.seeded_sampling import SeededSampling  # noqa: PLC0415

    options = {
        "clipping_norm": 1.0,
        "noise_multiplier": point.noise_multiplier,
        "mode": "full",
        "secagg_degree": point.secagg_degree,
        "ring_bits": point.ring_bits,
        "bits": min(point.ring_bits, 20),
    }
    strategy = from_options(options, expected_clients=point.cohort, seed=point.seed)
    app = ddgauss_client_app(synthetic_client_app(point.dim, point.seed))
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
    from protocols.dmm import MEMBER_ID_BASE  # noqa: PLC0415
    from protocols.resharing import NEW_ID_BASE, OLD_ID_BASE  # noqa: PLC0415
    from strategies.dmm import dmm_client_app, from_options  # noqa: PLC0415
    from strategies.seeded_sampling import SeededSampling  # noqa: PLC0415

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
        t, seats = output.transcript, range(strategy.scheme.n)
        per_member = [
            sum(
                t.nbytes(receiver=base + j) + t.nbytes(sender=base + j)
                for base in (MEMBER_ID_BASE, OLD_ID_BASE)
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
        dmm_client_app(synthetic_client_app(point.dim, point.seed)),
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
class _Rounds:
    """Per-round totals of the grid's phase reports (a :class:`PhaseObserver`)."""

    def __init__(self) -> None:
        self.phases: dict[int, dict[str, float]] = {}
        self.lock = threading.Lock()

    def phase_finished(self, report) -> None:
        with self.lock:
            row = self.phases.setdefault(
                report.server_round or 0,
                {"client_s": 0.0, "bytes_up": 0, "bytes_down": 0, "exchanges": 0, "failed": 0},
            )
            row["client_s"] += report.compute_s
            kind = report.message_type.removeprefix("query.")
            row[f"client_s.{kind}"] = row.get(f"client_s.{kind}", 0.0) + report.compute_s
            row[f"wall_s.{kind}"] = row.get(f"wall_s.{kind}", 0.0) + report.wall_s
            row["bytes_up"] += report.bytes_up
            row["bytes_down"] += report.bytes_down
            row["exchanges"] += 1
            row["failed"] += report.failed + report.dropped

    def attach(self, row: dict[str, Any], cohort: int) -> None:
        """Add round ``row["round"]``'s client seconds (total and by exchange), exchanges and
        bytes per cohort client to ``row``."""
        phases = self.phases.get(row["round"], {})
        row["client_s"] = phases.get("client_s", 0.0)
        row["by_exchange"] = {
            k: v for k, v in phases.items() if k.startswith(("client_s.", "wall_s."))
        }
        row["exchanges"] = phases.get("exchanges", 0)
        row["bytes_up_per_client"] = phases.get("bytes_up", 0) / cohort
        row["bytes_down_per_client"] = phases.get("bytes_down", 0) / cohort


def run_point(point: Point) -> dict[str, Any]:
    """Run ``point`` in this process and return its measurements."""
    import logging  # noqa: PLC0415

    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    from fedsim.engine import (  # noqa: PLC0415
        ClientStateStore,
        Engine,
        EngineConfig,
        FaultConfig,
        UniformCohort,
    )
    from fedsim.engine.metrics import peak_rss_mb  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.record_codec import to_record  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    logging.getLogger("strategies").setLevel(logging.ERROR)
    mode = MODES[point.mode](point)
    observer = _Rounds()
    engine = Engine(
        EngineConfig(
            backend=point.backend,
            workers=point.workers,
            num_cpus=point.workers,
            object_store_mb=1024,
        )
    ).start()
    total_rounds = point.warmup + point.rounds
    rows: list[dict[str, Any]] = []
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
        clock = {"wall": time.perf_counter(), "cpu": time.thread_time()}
        initial = {ARRAY_KEY: np.zeros(point.dim, dtype=np.float32)}

        def on_round(outcome) -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            metrics = dict(outcome.train_metrics or {})
            row = {
                "round": outcome.server_round,
                "round_s": wall - clock["wall"],
                "server_cpu_s": cpu - clock["cpu"],
                "survivors": metrics.get("ddgauss-survivors"),
                "aborted": metrics.get("ddgauss-aborted"),
            }
            if mode.committee is not None:
                row.update(mode.committee())
            rows.append(row)
            clock["wall"], clock["cpu"] = time.perf_counter(), time.thread_time()

        run_rounds(mode.strategy, grid, to_record(initial), total_rounds, on_round=on_round)
        grid.wait_idle()
        workers = getattr(engine.backend, "worker_peak_rss_mb", list)()
        stored = len(store)
        store.close()
    engine.close()
    for row in rows:
        observer.attach(row, point.cohort)
    driver = peak_rss_mb()
    return {
        "rounds": rows[point.warmup :],
        "warmup_rounds": rows[: point.warmup],
        "clients_with_state": stored,
        "peak_rss_mb": {"driver": driver, "workers": workers, "total": driver + sum(workers)},
        "details": mode.details,
    }


# ----------------------------------------------------------------------------- summaries
_PER_ROUND = ("round_s", "client_s", "server_cpu_s", "bytes_up_per_client", "bytes_down_per_client")
_COMMITTEE = ("committee_cpu_s", "bytes_per_member")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every measured round of every repetition; the largest memory peaks."""
    rounds = [row for run in runs for row in run["rounds"]]
    out: dict[str, Any] = {"measured_rounds": len(rounds)}
    for key in (*_PER_ROUND, *_COMMITTEE):
        values = [row[key] for row in rounds if row.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    exchanges = sorted({k for row in rounds for k in row.get("by_exchange", {})})
    out["by_exchange"] = {
        k: statistics.median(row["by_exchange"].get(k, 0.0) for row in rounds) for k in exchanges
    }
    survivors = [row["survivors"] for row in rounds if row.get("survivors") is not None]
    out["median_survivors"] = statistics.median(survivors) if survivors else None
    out["aborted_rounds"] = sum(int(row.get("aborted") or 0) for row in rounds)
    peaks = [run["peak_rss_mb"] for run in runs]
    out["peak_rss_mb"] = {
        "driver": max(p["driver"] for p in peaks),
        "workers": [max(w) for w in zip(*(p["workers"] for p in peaks))],
        "total": max(p["total"] for p in peaks),
    }
    out["clients_with_state"] = max(run["clients_with_state"] for run in runs)
    out["per_round"] = [run["rounds"] for run in runs]
    return out


def fit_exponent(cohorts: list[int], seconds: list[float]) -> float | None:
    """a in t = b * C^a, least squares on log t against log C (None below two cohorts)."""
    if len(set(cohorts)) < 2:
        return None
    slope, _ = np.polyfit(np.log(cohorts), np.log(seconds), 1)
    return float(slope)


def exponents(points: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The fitted exponent of round time against cohort, per mode and d."""
    out: dict[str, dict[str, float | None]] = {}
    for mode in sorted({p["mode"] for p in points}):
        for dim in sorted({p["dim"] for p in points}):
            rows = sorted(
                (p["cohort"], p["summary"]["round_s"])
                for p in points
                if p["mode"] == mode and p["dim"] == dim
            )
            if rows:
                out.setdefault(mode, {})[str(dim)] = fit_exponent(*map(list, zip(*rows)))
    return out


def plot(points: list[dict[str, Any]], fits: dict, path: Path) -> None:
    """Seconds per round against cohort size, log-log, one line per mode and d."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    styles = {"fedavg": "o-", "ddgauss": "s-", "dmm": "^-", "dmm-unfolded": "v--"}
    for mode in sorted({p["mode"] for p in points}):
        for dim in sorted({p["dim"] for p in points}):
            rows = sorted(
                (p["cohort"], p["summary"]["round_s"])
                for p in points
                if p["mode"] == mode and p["dim"] == dim
            )
            if not rows:
                continue
            exponent = fits.get(mode, {}).get(str(dim))
            label = f"{mode}, d = {dim:.0e}" + (
                f" (t ∝ C^{exponent:.2f})" if exponent is not None else ""
            )
            ax.plot(*zip(*rows), styles.get(mode, "x-"), label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round C")
    ax.set_ylabel("seconds per round (median)")
    ax.set_title("Secure aggregation at scale: time per round (2 workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver
def _points(args: argparse.Namespace) -> list[Point]:
    """The (mode, cohort, d) grid; d = 10^6 only at the smallest cohort (``--big-dim-cohorts``)."""
    out = []
    for dim in args.dims:
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
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
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: {unknown} unknown; allowed: {', '.join(MODES)}")
    if "fedavg" not in args.modes:
        parser.error("--modes must include 'fedavg': every ratio is taken against it")
    for name in ("rounds", "repeats", "workers", "population"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}; it must be >= 1")
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
    points = _points(args)
    if args.profile is not None:
        return profile(points[-1], args.profile)
    sweep = [
        _point(args, mode, min(args.cohorts), min(args.dims), population)
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
    print(json.dumps(result, indent=2))
    if args.plot is not None:
        plot(result["points"], result["exponents"], args.plot)
    return result


def report(
    args: argparse.Namespace, points: list[Point], sweep: list[Point], runs: dict[Point, list]
) -> dict[str, Any]:
    """The JSON of the points measured so far (a mode's ratio once FedAvg's point is in)."""
    rows = [
        {**{k: getattr(p, k) for k in ("mode", "cohort", "dim", "population")},
         "summary": summarise(runs[p])}
        for p in points
        if runs[p]
    ]  # fmt: skip
    for row in rows:
        reference = [
            r for r in rows
            if r["mode"] == "fedavg" and (r["cohort"], r["dim"]) == (row["cohort"], row["dim"])
        ]  # fmt: skip
        row["ratio_round_s"] = (
            row["summary"]["round_s"] / reference[0]["summary"]["round_s"] if reference else None
        )
    result = {
        "settings": {
            k: getattr(args, k)
            for k in (
                "population", "rounds", "warmup", "repeats", "workers", "dropout",
                "secagg_degree", "ring_bits", "noise_multiplier", "seed", "state_memory_mb",
            )
        },  # fmt: skip
        "cpu_count": os.cpu_count(),
        "points": rows,
        "exponents": exponents(rows),
        "ratios": _ratios(rows),
    }
    done = [p for p in sweep if runs[p]]
    if done:
        result["population_sweep"] = _population_sweep(done, runs)
    return result


def profile(point: Point, path: Path) -> dict[str, Any]:
    """Run ``point`` with the clients in this process under cProfile: the stats go to
    ``path`` (pstats) and the top functions by own time to stdout."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    local = Point(**{**point.__dict__, "backend": "local"})
    profiler = cProfile.Profile()
    result = profiler.runcall(run_point, local)
    profiler.dump_stats(path)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    print(json.dumps(summarise([result]), indent=1))
    return result


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each secure point's round time over FedAvg's at the same (C, d), keyed for reading."""
    return {
        f"{r['mode']} C={r['cohort']} d={r['dim']}": r["ratio_round_s"]
        for r in rows
        if r["mode"] != "fedavg"
    }


def merge(paths: list[Path], out: Path | None, plot_path: Path | None) -> dict[str, Any]:
    """One result from several runs' JSON: their points (a later run's point replaces an
    earlier one at the same mode, cohort, d and population), each run's settings, the
    exponents refitted over all points, and the first memory sweep found."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    points: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        for row in run["points"]:
            row = {"settings": run.get("settings"), **row}  # a merged run's rows keep theirs
            points[(row["mode"], row["cohort"], row["dim"], row["population"])] = row
    rows = sorted(points.values(), key=lambda r: (r["dim"], r["cohort"], r["mode"] != "fedavg"))
    result = {
        "merged_from": [str(p) for p in paths],
        "cpu_count": os.cpu_count(),
        "points": rows,
        "exponents": exponents(rows),
        "ratios": _ratios(rows),
    }
    sweeps = [run["population_sweep"] for run in runs if "population_sweep" in run]
    if sweeps:
        result["population_sweep"] = sweeps[0]
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    if plot_path is not None:
        plot(rows, result["exponents"], plot_path)
    return result


def _population_sweep(sweep: list[Point], runs: dict[Point, list[dict]]) -> dict[str, Any]:
    """Per mode: round time and peak memory at each population, and largest / smallest."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(p.mode for p in sweep):
        mine = sorted((p for p in sweep if p.mode == mode), key=lambda p: p.population)
        table = {str(p.population): summarise(runs[p]) for p in mine}
        small, large = table[str(mine[0].population)], table[str(mine[-1].population)]
        out[mode] = {
            "cohort": mine[0].cohort,
            "dim": mine[0].dim,
            "populations": {
                n: {"round_s": s["round_s"], "peak_rss_mb": s["peak_rss_mb"]}
                for n, s in table.items()
            },
            "ratio_round_s": large["round_s"] / small["round_s"],
            "ratio_total_peak_rss": large["peak_rss_mb"]["total"]
            / small["peak_rss_mb"]["total"],
        }
    return out


if __name__ == "__main__":
    main()
