"""pFedHB vs pFedVEM, pFedBayes, FedAvg, FedAvg + FT and local-only under label skew.

Runs every (federation, method, seed) on fedsim's engine (local backend by
default, ``--backend ray`` for Ray workers) and writes ``results.json``,
``table.md`` and ``accuracy.png`` next to this file.

    python experiments/pfedhb/run.py               # the README's table
    python experiments/pfedhb/run.py --rounds 4 --seeds 1 --federations digits-shards5
    python experiments/pfedhb/run.py --federations femnist-dir0.1 --merge  # add to results

Personalised accuracy: unweighted mean over clients of the accuracy of each
client's personal model (posterior mean) on its own held-out rows (which hold
that client's classes). Global accuracy: the global model (posterior mean) on
the pooled test rows of all clients. ECE: pooled over clients, MC predictive
(10 draws) for the Bayesian methods.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import numpy as np  # noqa: E402

FEDERATIONS = {
    "digits-shards5": dict(source="digits", partition="shards", classes_per_client=5),
    "digits-dir0.1": dict(source="digits", partition="dirichlet", alpha=0.1),
    "digits-dir0.5": dict(source="digits", partition="dirichlet", alpha=0.5),
    "femnist-shards5": dict(
        source="femnist", partition="shards", classes_per_client=5, samples_per_client=40
    ),
    # added later (issue 8, item 5): FEMNIST-like Dirichlet, and 5-class shards whose
    # sizes are skewed too (client weights ~ LogNormal(0, 1), see shard_partition)
    "femnist-dir0.1": dict(
        source="femnist", partition="dirichlet", alpha=0.1, samples_per_client=40
    ),
    "femnist-dir0.5": dict(
        source="femnist", partition="dirichlet", alpha=0.5, samples_per_client=40
    ),
    "digits-shards5-qs": dict(
        source="digits", partition="shards", classes_per_client=5, shard_sigma=1.0
    ),
    "femnist-shards5-qs": dict(
        source="femnist",
        partition="shards",
        classes_per_client=5,
        shard_sigma=1.0,
        samples_per_client=40,
    ),
}
METHODS = ("pfedhb", "pfedvem", "pfedbayes", "fedavg", "fedavg-ft", "local")
ABLATIONS = ("pfedhb-lam0", "pfedhb-detbody", "pfedhb-sampled")


def strategy_for(method: str, rounds: int, seed: int, evaluate_every: int = 2):
    from strategies.personalised import Cohorts, FedAvgReference, LocalOnly  # noqa: PLC0415
    from strategies.pfedbayes import PFedBayes  # noqa: PLC0415
    from strategies.pfedhb import HBConfig, PFedHB  # noqa: PLC0415
    from strategies.pfedvem import PFedVEM  # noqa: PLC0415

    every = dict(fraction=0.1, evaluate_every=evaluate_every, num_rounds=rounds, seed=seed)
    if method == "pfedhb":
        return PFedHB(HBConfig(lam_mu=5.0, lam_sigma=5.0), Cohorts(schedule="all", **every))
    if method == "pfedhb-lam0":  # ablation: moment matching (no hyper-prior penalty)
        return PFedHB(HBConfig(lam_mu=0.0, lam_sigma=0.0), Cohorts(schedule="all", **every))
    if method == "pfedhb-detbody":  # ablation: deterministic body, as pFedVEM's
        return PFedHB(HBConfig(body_bayesian=False), Cohorts(schedule="all", **every))
    if method == "pfedhb-sampled":  # only the sampled clients train
        return PFedHB(HBConfig(), Cohorts(schedule="sampled", **every))
    if method == "pfedvem":
        return PFedVEM(Cohorts(schedule="all", **every))
    if method == "pfedbayes":
        return PFedBayes(Cohorts(schedule="all", **every))
    if method == "local":
        return LocalOnly(Cohorts(schedule="all", **every))
    finetune = 5 if method == "fedavg-ft" else 0
    return FedAvgReference(Cohorts(schedule="sampled", **every), finetune_epochs=finetune)


def run_one(job: tuple[str, str, int, int, str, int]) -> dict:
    """One (federation, method, seed) run; returns its evaluations."""
    federation, method, seed, rounds, backend, evaluate_every = job
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    from fedsim.data import DatasetSpec, cached_dataset  # noqa: PLC0415
    from fedsim.engine import Engine, EngineConfig  # noqa: PLC0415
    from fedsim.engine.rounds import run_rounds  # noqa: PLC0415
    from fedsim.records import to_numpy, to_record  # noqa: PLC0415
    from fedsim.workloads.bayesian import BayesSpec, build_bayes_model, model_arrays  # noqa: PLC0415
    from fedsim.workloads.personalised import (  # noqa: PLC0415
        PersonalTraining,
        global_metrics,
        make_personal_app,
    )

    data = DatasetSpec(num_clients=100, seed=seed, test_fraction=0.25, **FEDERATIONS[federation])
    dataset = cached_dataset(data)
    in_features = int(np.prod(dataset.feature_shape))
    spec = BayesSpec(
        in_features=in_features, hidden=(64,), num_classes=dataset.num_classes, rho_init=-4.0
    )
    training = PersonalTraining(
        head_steps=10,
        body_epochs=5,
        mc_samples=3,
        personal_steps=3,
        head_lr=0.05,
        body_lr=0.05,
        zeta=0.01,
        sgd_lr=0.1,
        sgd_epochs=5,
        seed=seed,
    )
    app = make_personal_app(spec, data, training)
    engine = Engine(EngineConfig(backend=backend, workers=1)).start()
    grid = engine.open_run(app, 100, raise_errors=backend == "local")
    x_test, y_test = dataset.central_test
    evaluator = build_bayes_model(spec, seed)
    curve: list[dict] = []
    name = "fedavg" if method == "fedavg-ft" else method.split("-")[0]
    strategy = strategy_for(method, rounds, seed, evaluate_every)
    strategy.method = name

    def on_round(outcome) -> None:
        if outcome.evaluate_metrics is None:
            return
        row = {"round": outcome.server_round, **dict(outcome.evaluate_metrics)}
        if method != "local":
            row.update(global_metrics(evaluator, to_numpy(outcome.arrays), x_test, y_test))
        curve.append(row)

    start = time.perf_counter()
    init = model_arrays(build_bayes_model(spec, seed))
    run_rounds(strategy, grid, to_record(init), rounds, on_round=on_round)
    engine.close()
    return {
        "federation": federation,
        "method": method,
        "seed": seed,
        "seconds": time.perf_counter() - start,
        "curve": curve,
    }


def summarise(results: list[dict]) -> str:
    keys = [
        ("personal_acc_mean", "personalised acc"),
        ("global_acc", "global acc"),
        ("personal_ece_mc", "ECE (MC)"),
        ("personal_ece_mean", "ECE (mean)"),
    ]
    lines = []
    for federation in dict.fromkeys(r["federation"] for r in results):
        lines += [f"\n**{federation}**\n", "| method | " + " | ".join(k[1] for k in keys) + " |"]
        lines.append("|---" * (len(keys) + 1) + "|")
        for method in (*METHODS, *ABLATIONS):
            runs = [r for r in results if r["federation"] == federation and r["method"] == method]
            if not runs:
                continue
            cells = []
            for key, _ in keys:
                values = [r["curve"][-1].get(key, float("nan")) for r in runs]
                if np.all(np.isnan(values)):
                    cells.append("–")
                    continue
                scale = 100.0 if "acc" in key else 1.0
                v = np.asarray(values) * scale
                cells.append(
                    f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0:.1f}"
                    if scale > 1
                    else f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0:.3f}"
                )
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    federations = list(dict.fromkeys(r["federation"] for r in results))
    cols = min(4, len(federations))
    rows = -(-len(federations) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.ravel()[len(federations) :]:
        ax.set_visible(False)
    for ax, federation in zip(axes.ravel(), federations, strict=False):
        for method in (*METHODS, *ABLATIONS):
            runs = [r for r in results if r["federation"] == federation and r["method"] == method]
            if not runs:
                continue
            rounds = [row["round"] for row in runs[0]["curve"]]
            acc = np.array([[row["personal_acc_mean"] for row in r["curve"]] for r in runs]) * 100
            ax.errorbar(rounds, acc.mean(0), yerr=acc.std(0), label=method, capsize=2)
        ax.set_title(federation)
        ax.set_xlabel("round")
        ax.set_ylabel("personalised accuracy (%)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--evaluate-every", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--federations", nargs="*", default=list(FEDERATIONS))
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"also {ABLATIONS}")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add to (or replace the same runs in) the results.json already in --out",
    )
    args = parser.parse_args()
    jobs = [
        (f, m, s, args.rounds, args.backend, args.evaluate_every)
        for f in args.federations
        for s in range(args.seeds)
        for m in args.methods
    ]
    start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.processes > 1 and args.backend == "local":
        with mp.get_context("spawn").Pool(args.processes) as pool:
            results = []
            for r in pool.imap_unordered(run_one, jobs):
                results.append(r)
                print(
                    f"{r['federation']} {r['method']} seed {r['seed']}: {r['seconds']:.0f}s "
                    f"pers {r['curve'][-1]['personal_acc_mean']:.3f}",
                    flush=True,
                )
    else:
        results = [run_one(job) for job in jobs]
    if args.merge and (args.out / "results.json").exists():
        new = {(r["federation"], r["method"], r["seed"]) for r in results}
        old = json.loads((args.out / "results.json").read_text())
        results += [r for r in old if (r["federation"], r["method"], r["seed"]) not in new]
    order = (*METHODS, *ABLATIONS)
    results.sort(key=lambda r: (r["federation"], order.index(r["method"]), r["seed"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = summarise(results)
    (args.out / "table.md").write_text(table + "\n")
    plot(results, args.out / "accuracy.png")
    print(table)
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
