"""FedAvg on digits with and without client methods: MARS, LAWA / EMA, QODA quantised uploads.

Workload: scikit-learn digits, 30 clients (Dirichlet alpha 0.5 label skew), an MLP with one
hidden layer of 32 units, all clients every round, one local epoch (batch 16), FedAvg, the
local engine. Accuracy is measured centrally on the pooled test rows (361) after the last
round; each setting runs with seeds 0, 1, 2 (model init, shuffling, quantisation draws).

Table 1 (20 rounds): local optimiser SGD (lr 0.1) / MARS-AdamW (lr 1e-2) / MARS-Lion
(lr 3e-3); server-side LAWA (k 10) and EMA (beta 0.9) over rounds, scored on the average;
client-side LAWA over local iterates (k 10, every step). Table 1b: the same server
averages after 60 rounds, when the raw global model has plateaued.

Table 2 (equal upload bits): the bits of 5 dense (32-bit) rounds buy 20 rounds at 8 bits and
40 rounds at 4 bits (QODA layer-wise quantisation of the update, uniform or adapted levels).
Bits are the exact payload (codes + norms + adapted levels) from the clients'
``upload-bits``; ``bytes_up`` is the engine's measure of the replies (with .npy headers).

Writes ``results.json`` next to this file and prints the README's tables (mean ± sample
standard deviation, ddof = 1, over the seeds); ``--tables`` prints them from ``results.json``
without running anything, and ``--resummarise`` recomputes its summaries from its per-seed runs.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.averaging import Averaging  # noqa: E402
from fedsim.workloads.client_app import training_app  # noqa: E402
from fedsim.workloads.methods import MethodsTraining  # noqa: E402
from fedsim.workloads.supervised import METHODS, LocalTraining  # noqa: E402
from fedsim.workloads.training import evaluate_model  # noqa: E402
from strategies.methods.averaging import AveragedGlobalModel  # noqa: E402
from strategies.methods.quantized import DequantizedUploads  # noqa: E402

CLIENTS, SEEDS = 30, (0, 1, 2)
DATA = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=CLIENTS, seed=1)


class Phases:
    def __init__(self) -> None:
        self.reports: list = []

    def phase_finished(self, report) -> None:
        self.reports.append(report)


def run_setting(engine, dataset, model, *, rounds, seed, methods, server_averaging=None):
    training = LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=seed, **methods)
    parts = {key: getattr(training, key) for key in METHODS}
    app = training_app(MethodsTraining(model, training, **parts), DATA)  # SGD when none is set
    strategy = FedAvg(fraction_evaluate=0.0)
    if training.compression is not None:
        strategy = DequantizedUploads(strategy)
    if server_averaging is not None:
        strategy = AveragedGlobalModel(strategy, server_averaging, rounds)
    phases = Phases()
    random.seed(seed)  # Flower's node sampling
    grid = engine.open_run(app, CLIENTS, datasets=((DATA, dataset),), observer=phases)
    final = run_rounds(strategy, grid, to_record(initial_arrays(model, seed)), rounds)
    if server_averaging is not None:
        final = strategy.averaged(final)
    net = build_model(model)
    load_arrays(net, to_numpy(final))
    test_x = torch.as_tensor(np.asarray(dataset.test.x), dtype=torch.float32)
    test_y = torch.as_tensor(np.asarray(dataset.test.y), dtype=torch.int64)
    accuracy = evaluate_model(net, test_x, test_y)["accuracy"]
    train = [r for r in phases.reports if r.message_type.startswith("train")]
    coordinates = sum(v.size for v in to_numpy(final).values())
    bits = sum(r.client_metrics.get("upload-bits", 32 * coordinates) * r.succeeded for r in train)
    return {
        "accuracy": accuracy,
        "upload_bits": int(bits),
        "bytes_up": int(sum(r.bytes_up for r in train)),
    }


def summarise(runs):
    acc = [r["accuracy"] for r in runs]
    return {
        "accuracy_mean": float(np.mean(acc)),
        "accuracy_std": float(np.std(acc, ddof=1)),
        "accuracy_std_ddof": 1,
        "upload_mbit": runs[0]["upload_bits"] / 1e6,
        "bytes_up_mb": runs[0]["bytes_up"] / 1e6,
        "runs": runs,
    }


def main() -> None:
    torch.set_num_threads(1)
    dataset = build_dataset(DATA)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    lawa10 = Averaging(kind="lawa", k=10, every=1, burn_in=0)
    table1 = {
        "FedAvg (SGD)": dict(methods=dict()),
        "+ MARS-AdamW": dict(methods=dict(optimizer={"name": "mars-adamw", "lr": 1e-2})),
        "+ MARS-Lion": dict(methods=dict(optimizer={"name": "mars-lion", "lr": 3e-3})),
        "+ server LAWA k=10": dict(methods=dict(), server_averaging=lawa10),
        "+ server EMA 0.9": dict(
            methods=dict(),
            server_averaging=Averaging(kind="ema", beta=0.9, every=1, burn_in=0),
        ),
        "+ client LAWA k=10": dict(methods=dict(averaging=lawa10)),
    }
    table2 = {
        "dense 32-bit, 5 rounds": dict(rounds=5, methods=dict()),
        "QODA 8-bit, 20 rounds": dict(rounds=20, methods=dict(compression={"bits": 8})),
        "QODA 4-bit, 40 rounds": dict(rounds=40, methods=dict(compression={"bits": 4})),
        "QODA 4-bit adaptive, 40 rounds": dict(
            rounds=40, methods=dict(compression={"bits": 4, "levels": "adaptive"})
        ),
        "dense 32-bit, 40 rounds (8x bits)": dict(rounds=40, methods=dict()),
    }
    table1b = {
        "FedAvg (SGD)": dict(methods=dict()),
        "+ server LAWA k=10": dict(methods=dict(), server_averaging=lawa10),
        "+ server EMA 0.9": table1["+ server EMA 0.9"],
    }
    results: dict = {"table1_rounds": 20, "table1": {}, "table1b": {}, "table2": {}}
    started = time.perf_counter()
    with Engine(EngineConfig(backend="local")) as engine:
        for name, kw in table1.items():
            runs = [run_setting(engine, dataset, model, rounds=20, seed=s, **kw) for s in SEEDS]
            results["table1"][name] = summarise(runs)
        for name, kw in table1b.items():
            runs = [run_setting(engine, dataset, model, rounds=60, seed=s, **kw) for s in SEEDS]
            results["table1b"][name] = summarise(runs)
        for name, kw in table2.items():
            kw = dict(kw)
            rounds = kw.pop("rounds")
            runs = [run_setting(engine, dataset, model, rounds=rounds, seed=s, **kw) for s in SEEDS]
            results["table2"][name] = {"rounds": rounds, **summarise(runs)}
    results["seconds"] = time.perf_counter() - started
    out = Path(__file__).with_name("results.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)
    print(f"\n{results['seconds']:.0f} s")


def mean_sd(runs: list[dict]) -> str:
    """Test accuracy over the seeds: mean ± sample standard deviation (ddof = 1)."""
    acc = np.array([r["accuracy"] for r in runs])
    return f"{acc.mean():.3f} ± {acc.std(ddof=1):.3f}"


def print_tables(results: dict) -> None:
    """The README's tables, recomputed from the per-seed runs in ``results``."""
    print("| setting (20 rounds) | test accuracy (mean ± sample std, 3 seeds) | upload Mbit |")
    print("|---|---|---|")
    for name, r in results["table1"].items():
        print(f"| {name} | {mean_sd(r['runs'])} | {r['upload_mbit']:.1f} |")
    print()
    print("| setting (60 rounds) | test accuracy (mean ± sample std, 3 seeds) |")
    print("|---|---|")
    for name, r in results["table1b"].items():
        print(f"| {name} | {mean_sd(r['runs'])} |")
    print()
    print("| setting | rounds | upload Mbit | bytes_up MB | test accuracy |")
    print("|---|---|---|---|---|")
    for name, r in results["table2"].items():
        print(
            f"| {name} | {r['rounds']} | {r['upload_mbit']:.2f} | {r['bytes_up_mb']:.2f} "
            f"| {mean_sd(r['runs'])} |"
        )

if __name__ == "__main__":
    if "--tables" in sys.argv[1:]:  # the README's tables from results.json, nothing run
        print_tables(json.loads(Path(__file__).with_name("results.json").read_text()))
    elif "--resummarise" in sys.argv[1:]:  # summaries from the stored per-seed runs
        path = Path(__file__).with_name("results.json")
        stored = json.loads(path.read_text())
        for table in ("table1", "table1b", "table2"):
            for name, row in stored[table].items():
                extra = {"rounds": row["rounds"]} if "rounds" in row else {}
                stored[table][name] = {**extra, **summarise(row["runs"])}
        path.write_text(json.dumps(stored, indent=2) + "\n")
    else:
        main()
