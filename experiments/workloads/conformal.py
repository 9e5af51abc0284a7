"""Conformal prediction in a federation: per-client coverage of online calibration (plain ACI
vs multi-group conformal, groups = clients) and DPSM conformal training vs cross-entropy.

Workload: scikit-learn digits, 30 clients (Dirichlet alpha 0.5 label skew), an MLP with one
hidden layer of 32 units, all clients train and evaluate every round, one local epoch
(batch 16, SGD lr 0.1), FedAvg, the local engine, seeds 0, 1, 2.

Table 1 (20 rounds, alpha 0.1, eta 0.05): every round the clients send the nonconformity
scores (1 - p_y) of their local test rows; the server runs both calibrators on the same
stream (``strategies.methods.conformal.ConformalEvaluation`` with kind "multigroup" and a global
group, and a plain-ACI calibrator fed ``last_streams``). Per-client miss rates are over all
rounds (including the warm-up from theta = 0) and over the second half of the rounds.

Table 2 (split conformal): the final global model of CE-only training and of DPSM training
(``[client.conformal]``, lr_qr 0.01), scored on the 361 pooled test rows: accuracy, and
coverage and mean set size after split conformal calibration on a random half of them,
measured on the other half (mean over 50 random halves per seed); "short" is 20 rounds at
alpha 0.1 (about 1.5 min), "long" (with ``--long``, about 4 min more) 60 rounds at alpha
0.05, where the model has plateaued.

Writes ``conformal.json`` next to this file and prints the README's tables (mean ± sample
std, ddof = 1, over the seeds); ``--tables`` prints them from ``conformal.json`` only.
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
from fedsim.workloads.conformal import (  # noqa: E402
    OnlineCalibrator,
    OnlineConformal,
    class_scores,
    coverage_and_size,
    label_scores,
    split_conformal_threshold,
)
from fedsim.workloads.supervised import LocalTraining, make_client_app  # noqa: E402
from strategies.methods.conformal import ConformalEvaluation  # noqa: E402

CLIENTS, SEEDS, ETA, SPLITS = 30, (0, 1, 2), 0.05, 50
DATA = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=CLIENTS, seed=1)


def dpsm(alpha: float, mu_size: float, temperature: float) -> dict:
    return {"alpha": alpha, "mu_size": mu_size, "lr_qr": 0.01, "temperature": temperature}


# (table, rounds, alpha, {setting: [client.conformal] table or None for CE only})
TABLES = {
    "short": (
        20,
        0.1,
        {
            "CE only": None,
            "DPSM, mu 0.1, T = 1": dpsm(0.1, 0.1, 1.0),
            "DPSM, mu 0.1, T = 0.1": dpsm(0.1, 0.1, 0.1),
        },
    ),
    "long": (
        60,
        0.05,
        {
            "CE only": None,
            "DPSM, mu 0.1, T = 0.1": dpsm(0.05, 0.1, 0.1),
            "DPSM, mu 1, T = 0.1": dpsm(0.05, 1.0, 0.1),
        },
    ),
}


class Phases:
    def __init__(self) -> None:
        self.reports: list = []

    def phase_finished(self, report) -> None:
        self.reports.append(report)


def gaps(calibrator: OnlineCalibrator, late_misses: dict, late_points: dict, alpha: float) -> dict:
    """max and mean |miss - alpha| over clients, over all rounds and over the late rounds."""
    total = np.array(list(calibrator.miss_rates().values()))
    late = np.array([late_misses[g] / late_points[g] for g in sorted(late_points)])
    return {
        "max_gap": float(np.abs(total - alpha).max()),
        "mean_gap": float(np.abs(total - alpha).mean()),
        "miss": float(sum(calibrator.misses.values()) / sum(calibrator.points.values())),
        "max_gap_late": float(np.abs(late - alpha).max()),
        "mean_gap_late": float(np.abs(late - alpha).mean()),
    }


def run(
    engine, dataset, model, seed: int, conformal: dict | None, *, rounds: int, alpha: float
) -> dict:
    """One federated run; the final model's split-conformal metrics and the online gaps."""
    training = LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=seed, conformal=conformal)
    app = make_client_app(model, DATA, training)
    strategy = ConformalEvaluation(
        FedAvg(fraction_evaluate=1.0), OnlineConformal(kind="multigroup", alpha=alpha, eta=ETA)
    )
    aci = OnlineCalibrator(OnlineConformal(kind="aci", alpha=alpha, eta=ETA))
    late = {
        name: ({g: 0 for g in range(CLIENTS)}, {g: 0 for g in range(CLIENTS)})
        for name in ("aci", "multigroup")
    }

    def on_round(outcome) -> None:
        if outcome.server_round < 1:
            return
        streams = sorted((s for s in strategy.last_streams if len(s.scores)), key=lambda s: s.group)
        aci_metrics = aci.observe_round(streams)
        if outcome.server_round > rounds // 2:
            mg = dict(outcome.evaluate_metrics.items())
            for name, metrics in (("aci", aci_metrics), ("multigroup", mg)):
                misses, points = late[name]
                for stream, rate in zip(streams, metrics["conformal-group-miss"], strict=True):
                    misses[stream.group] += rate * len(stream.scores)
                    points[stream.group] += len(stream.scores)

    phases = Phases()
    random.seed(seed)  # Flower's node sampling
    grid = engine.open_run(app, CLIENTS, datasets=((DATA, dataset),), observer=phases)
    final = run_rounds(
        strategy, grid, to_record(initial_arrays(model, seed)), rounds, on_round=on_round
    )
    net = build_model(model)
    load_arrays(net, to_numpy(final))
    x = torch.as_tensor(np.asarray(dataset.test.x), dtype=torch.float32)
    y = np.asarray(dataset.test.y, dtype=np.int64)
    scores = class_scores(net, x)
    truth = label_scores(scores, y)
    rng = np.random.default_rng([seed, 7])
    coverage, size = [], []
    for _ in range(SPLITS):
        order = rng.permutation(len(y))
        calib, test = order[: len(y) // 2], order[len(y) // 2 :]
        q = split_conformal_threshold(truth[calib], alpha)
        c, s = coverage_and_size(scores[test], y[test], q)
        coverage.append(c)
        size.append(s)
    last_train = [r for r in phases.reports if r.message_type.startswith("train")][-1]
    return {
        "tau": last_train.client_metrics.get("dpsm-tau"),
        "test_quantile": float(np.quantile(truth, 1 - alpha)),
        "accuracy": float((scores.argmin(1) == y).mean()),
        "coverage": float(np.mean(coverage)),
        "set_size": float(np.mean(size)),
        "online": {
            "aci": gaps(aci, *late["aci"], alpha),
            "multigroup": gaps(strategy.calibrator, *late["multigroup"], alpha),
        },
    }


def mean_std(values) -> str:
    """Mean ± sample standard deviation (ddof = 1)."""
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def print_tables(results: dict) -> None:
    rounds, alpha, _ = TABLES["short"]
    print(f"\nTable 1: online calibration, CE-trained federation, {rounds} rounds, alpha {alpha}")
    print(
        "| calibrator | overall miss | max_k \\|miss_k − α\\| | mean_k \\|miss_k − α\\| "
        f"| max_k, rounds {rounds // 2 + 1}–{rounds} |"
    )
    print("|---|---|---|---|---|")
    labels = (("aci", "plain ACI (one θ)"), ("multigroup", "multi-group (θ per client + global θ)"))
    for kind, label in labels:
        rows = [r["online"][kind] for r in results["short"]["CE only"]]
        print(
            f"| {label} | {mean_std([r['miss'] for r in rows])} | "
            f"{mean_std([r['max_gap'] for r in rows])} | "
            f"{mean_std([r['mean_gap'] for r in rows])} | "
            f"{mean_std([r['max_gap_late'] for r in rows])} |"
        )
    for table, settings in results.items():
        rounds, alpha, _ = TABLES[table]
        print(f"\nTable ({table}): split conformal after {rounds} rounds, alpha {alpha}")
        print(
            "| training | test accuracy | coverage | mean set size | clients' τ | test quantile |"
        )
        print("|---|---|---|---|---|---|")
        for name, rows in settings.items():
            tau = mean_std([r["tau"] for r in rows]) if rows[0]["tau"] is not None else "—"
            print(
                f"| {name.replace('mu ', 'μ ')} | {mean_std([r['accuracy'] for r in rows])} | "
                f"{mean_std([r['coverage'] for r in rows])} | "
                f"{mean_std([r['set_size'] for r in rows])} | {tau} | "
                f"{mean_std([r['test_quantile'] for r in rows])} |"
            )


def main() -> None:
    if "--tables" in sys.argv[1:]:
        stored = json.loads(Path(__file__).with_name("conformal.json").read_text())
        print_tables(stored["results"])
        return
    tables = ["short", "long"] if "--long" in sys.argv[1:] else ["short"]
    started = time.perf_counter()
    dataset = build_dataset(DATA)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    results: dict = {}
    engine = Engine(EngineConfig(backend="local")).start()
    try:
        for table in tables:
            rounds, alpha, settings = TABLES[table]
            results[table] = {name: [] for name in settings}
            for name, conformal in settings.items():
                for seed in SEEDS:
                    row = run(engine, dataset, model, seed, conformal, rounds=rounds, alpha=alpha)
                    results[table][name].append(row)
                    print(f"{table} / {name} / seed {seed}: {row}", flush=True)
    finally:
        engine.close()
    seconds = time.perf_counter() - started
    out = Path(__file__).with_name("conformal.json")
    setup = {"clients": CLIENTS, "seeds": list(SEEDS), "eta": ETA, "splits": SPLITS}
    setup["tables"] = {t: TABLES[t] for t in tables}
    out.write_text(json.dumps({"setup": setup, "results": results, "seconds": seconds}, indent=2))
    print_tables(results)
    print(f"\n{seconds:.0f} s")


if __name__ == "__main__":
    main()
