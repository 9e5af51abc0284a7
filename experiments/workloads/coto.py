"""Federated LoRA fine-tuning with and without CoTo: accuracy, pruning and merging robustness.

Workload: scikit-learn digits, 30 clients (Dirichlet alpha 0.5 label skew, as in run.py).
A base MLP (64 -> 64 -> 64 -> 64 -> 10, four Linear layers) is pre-trained centrally on the
pooled training rows of classes 0-4 only; the federation then adapts it to all ten classes
with LoRA (rank 4, alpha 8, on all four Linear layers; base frozen, only adapters travel):
FedAvg of adapters, all clients every round, 40 rounds (``--rounds``), two local epochs of
batch 16 with MARS-AdamW at lr 1e-2 (SGD at lr 0.05-0.2 diverges from the confident base
model), on the local engine. Compared: plain LoRA and CoTo (p0 = 0.1, ramp 0.75 of the
run's steps); full fine-tuning (FedAvg of all weights from the same base) for reference.

Scored on the 361 pooled test rows (all classes, and the new classes 5-9):
  * the final adapter (and its merge into the base weights, which must score the same);
  * layer-wise pruning: the adapter of 1 (resp. 2) of the 4 layers removed, mean over the
    4 (resp. 6) choices;
  * merging two federations: each setting runs twice per seed from the same initial
    adapter (seed s) with client seeds s and s + 100 (shuffling, CoTo draws); the two
    adapters are linearly interpolated (A and B, weight 0.5), and their merged weight
    deltas averaged (W + (dW_1 + dW_2) / 2).
Seeds 0, 1, 2 (base pre-training, adapter init, shuffling, CoTo draws); mean +- sample std
(ddof = 1).

Writes ``coto.json`` (``--rounds 40``, the default; ``coto_<rounds>.json`` otherwise) next to
this file and prints the README's table; ``--tables`` prints it from that file only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, load_arrays, model_arrays  # noqa: E402
from fedsim.record_codec import to_numpy, to_record  # noqa: E402
from fedsim.workloads.coto import (  # noqa: E402
    LoRATraining,
    adapter_groups,
    build_lora_model,
    initial_adapter_arrays,
    interpolate_adapters,
    load_adapter_arrays,
    merged_arrays,
    prune_adapters,
)
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from fedsim.workloads.training import evaluate_model  # noqa: E402

CLIENTS, SEEDS, SECOND_RUN = 30, (0, 1, 2), 100
DATA = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=CLIENTS, seed=1)
OLD_CLASSES = 5
# MARS-AdamW (a fresh optimiser each round): plain SGD diverges on the confident base model
LOCAL = dict(epochs=2, batch_size=16, optimizer={"name": "mars-adamw", "lr": 1e-2})


class Phases:
    def __init__(self) -> None:
        self.reports: list = []

    def phase_finished(self, report) -> None:
        self.reports.append(report)


def pretrain_base(model: ModelSpec, dataset, seed: int) -> dict[str, np.ndarray]:
    """Central pre-training on the pooled training rows of classes 0-4 (Adam, 60 epochs)."""
    x = torch.as_tensor(np.asarray(dataset.train.x), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(dataset.train.y), dtype=torch.int64)
    keep = y < OLD_CLASSES
    x, y = x[keep], y[keep]
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_model(model)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(60):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), 32):
            idx = order[start : start + 32]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            optimizer.step()
    return {k: v.copy() for k, v in model_arrays(net).items()}


def scores(net, test_x, test_y) -> dict[str, float]:
    new = test_y >= OLD_CLASSES
    return {
        "accuracy": evaluate_model(net, test_x, test_y)["accuracy"],
        "accuracy_new": evaluate_model(net, test_x[new], test_y[new])["accuracy"],
    }


def federate(engine, dataset, model, training, initial, rounds):
    phases = Phases()
    random.seed(training.seed)  # Flower's node sampling
    app = make_client_app(model, DATA, training)
    grid = engine.open_run(app, CLIENTS, datasets=((DATA, dataset),), observer=phases)
    final = run_rounds(FedAvg(fraction_evaluate=0.0), grid, to_record(initial), rounds)
    train = [r for r in phases.reports if r.message_type.startswith("train")]
    return {k: np.array(v) for k, v in to_numpy(final).items()}, sum(r.bytes_up for r in train)


def lora_setting(engine, dataset, model, lora, seed, test):
    """Two federations (seeds s and s + 100), each scored; pruning; merging the two."""
    x, y = test
    adapters, runs = [], []
    for run_seed in (seed, seed + SECOND_RUN):
        training = LocalTraining(**LOCAL, seed=run_seed, lora=lora)
        initial = initial_adapter_arrays(model, lora, seed)  # same start, other seeds
        adapter, bytes_up = federate(engine, dataset, model, training, initial, lora.rounds)
        net = build_lora_model(model, lora)
        load_adapter_arrays(net, adapter)
        plain = build_model(model)
        load_arrays(plain, merged_arrays(net))
        groups = adapter_groups(adapter)
        pruned = {}
        for k in (1, 2):
            accs = []
            for drop in itertools.combinations(groups, k):
                load_adapter_arrays(net, prune_adapters(adapter, drop))
                accs.append(evaluate_model(net, x, y)["accuracy"])
            pruned[f"pruned_{k}"] = float(np.mean(accs))
        load_adapter_arrays(net, adapter)
        runs.append(
            {
                **scores(net, x, y),
                "merged_accuracy": evaluate_model(plain, x, y)["accuracy"],
                **pruned,
                "bytes_up": bytes_up,
            }
        )
        adapters.append((adapter, merged_arrays(net)))
    (first, merged_first), (second, merged_second) = adapters
    net = build_lora_model(model, lora)
    load_adapter_arrays(net, interpolate_adapters(first, second, 0.5))
    plain = build_model(model)
    load_arrays(plain, {k: (merged_first[k] + merged_second[k]) / 2 for k in merged_first})
    return {
        **runs[0],
        "second_run": runs[1],
        "interpolated": scores(net, x, y)["accuracy"],
        "delta_merged": scores(plain, x, y)["accuracy"],
    }


def full_setting(engine, dataset, model, base, seed, test, rounds):
    training = LocalTraining(**LOCAL, seed=seed)
    final, bytes_up = federate(engine, dataset, model, training, base, rounds)
    net = build_model(model)
    load_arrays(net, final)
    return {**scores(net, *test), "bytes_up": bytes_up}


def summarise(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    out = {f"{k}_mean": float(np.mean([r[k] for r in runs])) for k in keys}
    out |= {f"{k}_std": float(np.std([r[k] for r in runs], ddof=1)) for k in keys}
    return {**out, "std_ddof": 1, "bytes_up": runs[0]["bytes_up"], "runs": runs}


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    dataset = build_dataset(DATA)
    model = ModelSpec(
        kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(64, 64, 64)
    )
    test = (
        torch.as_tensor(np.asarray(dataset.test.x), dtype=torch.float32),
        torch.as_tensor(np.asarray(dataset.test.y), dtype=torch.int64),
    )
    results: dict = {"rounds": rounds, "seeds": list(SEEDS), "settings": {}}
    per_setting: dict[str, list] = {"base (classes 0-4)": [], "full fine-tuning": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(backend="local")) as engine:
        for seed in SEEDS:
            base = pretrain_base(model, dataset, seed)
            path = Path(tmp) / f"base{seed}.npz"
            np.savez(path, **base)
            net = build_model(model)
            load_arrays(net, base)
            per_setting["base (classes 0-4)"].append({**scores(net, *test), "bytes_up": 0})
            per_setting["full fine-tuning"].append(
                full_setting(engine, dataset, model, base, seed, test, rounds)
            )
            plain = LoRATraining(rank=4, alpha=8.0, coto=False, rounds=rounds, base=str(path))
            for name, lora in (("LoRA", plain), ("LoRA + CoTo", replace(plain, coto=True))):
                run = lora_setting(engine, dataset, model, lora, seed, test)
                per_setting.setdefault(name, []).append(run)
                print(f"seed {seed} {name}: {run['accuracy']:.3f}", flush=True)
    for name, runs in per_setting.items():
        results["settings"][name] = summarise(runs)
    results["seconds"] = time.perf_counter() - started
    name = "coto.json" if rounds == 40 else f"coto_{rounds}.json"
    Path(__file__).with_name(name).write_text(json.dumps(results, indent=2) + "\n")

    print_tables(results)
    print(f"\n{results['seconds']:.0f} s")


def print_tables(results: dict) -> None:
    """The README's table, recomputed from the per-seed runs (mean ± sample std, ddof = 1)."""
    rounds = results["rounds"]

    def cell(r: dict, key: str) -> str:
        if key not in r["runs"][0]:
            return "—"
        values = np.array([run[key] for run in r["runs"]])
        return f"{values.mean():.3f} ± {values.std(ddof=1):.3f}"

    print(
        f"| setting ({rounds} rounds) | accuracy | new classes 5–9 | merged into base "
        "| 1 of 4 adapters pruned | 2 of 4 pruned | 2 runs interpolated "
        "| 2 runs' deltas averaged | bytes_up per round |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    labels = {
        "base (classes 0-4)": "base (classes 0–4)",
        "full fine-tuning": "full fine-tuning (FedAvg)",
    }
    for name, r in results["settings"].items():
        cells = [
            cell(r, k)
            for k in (
                "accuracy",
                "accuracy_new",
                "merged_accuracy",
                "pruned_1",
                "pruned_2",
                "interpolated",
                "delta_merged",
            )
        ]
        sent = f"{r['bytes_up'] / rounds / 1e3:.1f} kB" if r["bytes_up"] else "—"
        print(f"| {labels.get(name, name)} | {' | '.join(cells)} | {sent} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--tables", action="store_true", help="print the table from the stored JSON only"
    )
    parser.add_argument(
        "--resummarise", action="store_true", help="means and sample sds again from the runs"
    )
    args = parser.parse_args()
    name = "coto.json" if args.rounds == 40 else f"coto_{args.rounds}.json"
    if args.tables:
        print_tables(json.loads(Path(__file__).with_name(name).read_text()))
    elif args.resummarise:  # the summaries again from the stored per-seed runs
        path = Path(__file__).with_name(name)
        stored = json.loads(path.read_text())
        for setting, row in stored["settings"].items():
            stored["settings"][setting] = summarise(row["runs"])
        path.write_text(json.dumps(stored, indent=2) + "\n")
    else:
        main(args.rounds)
