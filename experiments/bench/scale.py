"""Benchmark: time and memory per round against the number of registered clients.

One synthetic federation of ``--max-clients`` clients (``--rows`` training rows
each, 8 features, 10 classes; each client's features shifted by its own mean)
is written to disk once and memory-mapped; populations of 10^4, 10^5 and 10^6
clients are its first N clients. For each population a fresh process starts
the engine (one Ray worker per CPU), registers N clients and runs ``--rounds``
rounds of FedAvg on a logistic regression with ``--cohort`` uniformly sampled
clients per round. Clients are stateful: each keeps its SGD momentum in the
client-state store (64 MiB in memory, then SQLite on disk), so the store grows
with the clients seen.

Each population runs ``--reps`` times, the populations alternating. Prints one
JSON object: for each population the seconds of every round, their median over
all repetitions, and the peak resident memory (MiB) of the driver and of each
worker;
``ratio_round_s`` and ``ratio_total_peak_rss`` compare the largest population
with the smallest (the target is both within 1.2, and the total peak RSS at
10^6 under 6 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402

FEATURES = 8
CLASSES = 10
CHUNK = 100_000  # clients generated at a time


def make_federation(directory: Path, num_clients: int, rows: int, seed: int) -> Path:
    """Write ``num_clients`` clients of ``rows`` train and ``max(1, rows // 4)``
    test rows in the layout of ``FederatedDataset.save``, chunk by chunk."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(FEATURES, CLASSES))
    for split, per_client in (("train", rows), ("test", max(1, rows // 4))):
        n = num_clients * per_client
        x = np.lib.format.open_memmap(
            directory / f"{split}_x.npy", mode="w+", dtype=np.float32, shape=(n, FEATURES)
        )
        y = np.lib.format.open_memmap(
            directory / f"{split}_y.npy", mode="w+", dtype=np.int64, shape=(n,)
        )
        for start in range(0, num_clients, CHUNK):
            count = min(CHUNK, num_clients - start)
            shift = np.random.default_rng([seed, start]).normal(
                scale=0.5, size=(count, 1, FEATURES)
            )
            block = shift + rng.normal(size=(count, per_client, FEATURES))
            logits = block @ weights + rng.gumbel(size=(count, per_client, CLASSES))
            lo, hi = start * per_client, (start + count) * per_client
            x[lo:hi] = block.reshape(-1, FEATURES)
            y[lo:hi] = logits.argmax(-1).reshape(-1)
        x.flush()
        y.flush()
        del x, y
        np.save(
            directory / f"{split}_offsets.npy",
            np.arange(num_clients + 1, dtype=np.int64) * per_client,
        )
    meta = {
        "format": "fedsim.FederatedDataset",
        "version": 1,
        "name": "scale-synthetic",
        "num_classes": CLASSES,
        "num_clients": num_clients,
        "feature_shape": [FEATURES],
        "arrays": ["train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets"],
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def one_population(data_dir: Path, population: int, args: argparse.Namespace) -> dict:
    """Run the federation's first ``population`` clients in this process."""
    import logging  # noqa: PLC0415

    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415
    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    from fedsim.data import DatasetSpec  # noqa: PLC0415
    from fedsim.engine import ClientStateStore, Engine, EngineConfig, UniformCohort  # noqa: PLC0415
    from fedsim.engine.metrics import peak_rss_mb  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.models import ModelSpec, initial_arrays  # noqa: PLC0415
    from fedsim.record_codec import to_record  # noqa: PLC0415
    from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: PLC0415
    from strategies.plumbing.seeded_sampling import SeededSampling  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    model = ModelSpec(kind="logreg", input_shape=(FEATURES,), num_classes=CLASSES)
    data = DatasetSpec(
        source="npy", partition="natural", num_clients=population, path=str(data_dir)
    )
    training = LocalTraining(
        epochs=1, batch_size=args.rows, lr=0.1, momentum=0.9, keep_momentum=True, seed=args.seed
    )
    engine = Engine(EngineConfig(workers=args.workers, num_cpus=args.workers)).start()
    with tempfile.TemporaryDirectory(prefix="fedsim-scale-state-") as tmp:
        store = ClientStateStore(Path(tmp) / "state.sqlite", memory_budget=64 * 2**20)
        grid = engine.open_run(
            make_client_app(model, data, training),
            population,
            participation=UniformCohort(population, args.cohort, args.seed),
            state_store=store,
        )
        strategy = SeededSampling(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1), args.seed
        )
        marks = [time.perf_counter()]
        run_rounds(
            strategy,
            grid,
            to_record(initial_arrays(model, args.seed)),
            args.rounds,
            on_round=lambda outcome: marks.append(time.perf_counter()),
        )
        grid.wait_idle()
        workers = engine.backend.worker_peak_rss_mb()
        stored = len(store)
        store.close()
    engine.close()
    driver = peak_rss_mb()
    rounds = np.diff(marks).tolist()
    return {
        "round_s": rounds,
        "median_round_s": statistics.median(rounds),
        "clients_with_state": stored,
        "peak_rss_mb": {"driver": driver, "workers": workers, "total": driver + sum(workers)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--populations", default="10000,100000,1000000")
    parser.add_argument("--cohort", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=10, help="training rows per client")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3, help="runs of each population")
    parser.add_argument("--one", metavar="DATA_DIR:N", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        data_dir, population = args.one.rsplit(":", 1)
        print(json.dumps(one_population(Path(data_dir), int(population), args)))
        return

    populations = [int(p) for p in args.populations.split(",")]
    runs: dict[int, list[dict]] = {p: [] for p in populations}
    with tempfile.TemporaryDirectory(prefix="fedsim-scale-") as tmp:
        started = time.perf_counter()
        data_dir = make_federation(Path(tmp) / "data", max(populations), args.rows, args.seed)
        written = time.perf_counter() - started
        for _ in range(args.reps):  # populations alternate, so a slow spell hits all alike
            for population in populations:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", f"{data_dir}:{population}",
                     *sys.argv[1:]],
                    check=False, capture_output=True, text=True,
                )  # fmt: skip
                if done.returncode:
                    sys.exit(f"population {population} failed:\n{done.stderr[-4000:]}")
                runs[population].append(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {str(p): _combine(runs[p]) for p in populations}
    small, large = results[str(min(populations))], results[str(max(populations))]
    print(
        json.dumps(
            {
                "cohort": args.cohort,
                "rounds": args.rounds,
                "reps": args.reps,
                "rows_per_client": args.rows,
                "workers": args.workers,
                "data_written_s": written,
                "populations": results,
                "ratio_round_s": large["median_round_s"] / small["median_round_s"],
                "ratio_total_peak_rss": large["peak_rss_mb"]["total"]
                / small["peak_rss_mb"]["total"],
            },
            indent=2,
        )
    )


def _combine(runs: list[dict]) -> dict:
    """Median seconds over every round of every repetition; the largest peaks."""
    rounds = [s for run in runs for s in run["round_s"]]
    peaks = [run["peak_rss_mb"] for run in runs]
    return {
        "round_s": [run["round_s"] for run in runs],
        "median_round_s": statistics.median(rounds),
        "clients_with_state": max(run["clients_with_state"] for run in runs),
        "peak_rss_mb": {
            "driver": max(p["driver"] for p in peaks),
            "workers": [max(w) for w in zip(*(p["workers"] for p in peaks))],
            "total": max(p["total"] for p in peaks),
        },
    }


if __name__ == "__main__":
    main()
