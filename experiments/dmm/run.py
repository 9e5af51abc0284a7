"""DMM against DDGauss, central BandMF, central tree, DP-FedAvg and non-private, on digits.

Workload (scaled to run in a few minutes on two busy cores): scikit-learn digits split iid over
150 clients, multinomial logistic regression (650 parameters, D = 1024 after padding), one local
epoch of SGD (batch 16, lr 0.1), 20 rounds. Participation is 5-min-separation
(:class:`fedsim.engine.participation.MinSeparationCohort`: 5 groups of 30, each client trains
every 5th round, 4 times), clipping norm 1, delta 1e-5. Every private method is calibrated to
the target epsilon under that participation:

* ``dp-fedavg``: Gaussian noise each round, ``calibrate_noise`` for 4 compositions;
* ``central-bandmf`` / ``central-tree``: :class:`strategies.matrix_mechanism.MatrixMechanism`
  with a 5-banded BandMF C and Honaker's online tree (one Gaussian mechanism, sens(C) under
  5-min-separation);
* ``ddgauss``: :class:`strategies.ddgauss.DDGauss` (20-bit sum), z bisected so that the 4 rounds
  a client is in compose to the target (KLS21 bound; its ledger re-read with
  ``MinSeparation(5, 4)``);
* ``dmm-tree`` / ``dmm-banded``: :class:`strategies.dmm.DMM` with committees of n = 10
  (t = 2, k = 3), f = 12 fractional bits, the Honaker tree / the same BandMF; z bisected on the
  accounting of the implemented integer matrix C' (:mod:`fedsim.privacy.dmm`). Run in
  ``mode="ideal"``: the same integers as ``full`` (tests/test_dmm_strategy.py checks bit
  equality), without the cryptography's run time.

Epsilon per run is read back from each strategy. Writes ``results.json`` and the table and plot
(``accuracy.png``) referenced by README.md.

    python experiments/dmm/run.py [--epsilons 1 2 4 8] [--seeds 0 1 2] [--methods ...] [--tag S]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dp_accounting as dpa  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.engine.participation import MinSeparationCohort  # noqa: E402
from fedsim.engine.rounds import run_rounds  # noqa: E402
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays  # noqa: E402
from fedsim.privacy import accounting as acc  # noqa: E402
from fedsim.privacy import ddgauss as ddgauss_privacy  # noqa: E402
from fedsim.privacy import dmm as dmm_privacy  # noqa: E402
from fedsim.privacy.matrix.banded import banded  # noqa: E402
from fedsim.privacy.matrix.sensitivity import Participation  # noqa: E402
from fedsim.privacy.matrix.tree import honaker_tree  # noqa: E402
from fedsim.records import to_numpy, to_record  # noqa: E402
from fedsim.workloads.supervised import LocalTraining, evaluate_model, make_client_app  # noqa: E402
from strategies.ddgauss import DDGauss, ddgauss_client_app  # noqa: E402
from strategies.dmm import DMM, dmm_client_app  # noqa: E402
from strategies.dp_fedavg import DPFedAvg  # noqa: E402
from strategies.matrix_mechanism import MatrixMechanism  # noqa: E402

HERE = Path(__file__).resolve().parent
CLIENTS, ROUNDS, SEP, DELTA, CLIP = 150, 20, 5, 1e-5, 1.0
PER_ROUND = CLIENTS // SEP
K = math.ceil(ROUNDS / SEP)
METHODS = (
    "non-private",
    "dp-fedavg",
    "ddgauss",
    "central-tree",
    "central-bandmf",
    "dmm-tree",
    "dmm-banded",
)


def rdp_epsilon(event: dpa.DpEvent) -> float:
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def bisect(eps_of, target: float) -> float:
    """Smallest z (relative 1e-3) with eps_of(z) <= target; eps_of decreasing in z."""
    lo, hi = 0.05, 1.0
    while eps_of(hi) > target:
        lo, hi = hi, hi * 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps_of(mid) <= target else (mid, hi)
    return hi


def factorizations() -> dict:
    return {"tree": honaker_tree(ROUNDS), "bandmf": banded(ROUNDS, SEP)}


def make_strategy(method: str, epsilon: float, seed: int, facs: dict, dim: int):
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0)
    if method == "non-private":
        return inner, None
    if method == "dp-fedavg":
        z = acc.calibrate_noise(epsilon, DELTA, acc.MinSeparation(SEP, K), ROUNDS)
        return DPFedAvg(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=PER_ROUND,
            rng=np.random.default_rng([seed, 11]),
            sampling=acc.MinSeparation(SEP, K),
            delta=DELTA,
        ), z
    if method.startswith("central"):
        z = acc.calibrate_noise(epsilon, DELTA, acc.FullParticipation(), 1)
        fac = facs["tree" if method.endswith("tree") else "bandmf"]
        return MatrixMechanism(
            inner,
            factorization=fac,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=PER_ROUND,
            seed=seed,
            min_separation=SEP,
            max_participations=K,
            delta=DELTA,
        ), z
    if method == "ddgauss":
        probe = DDGauss(
            inner, clipping_norm=CLIP, noise_multiplier=1.0, expected_clients=PER_ROUND, seed=seed
        )

        def eps_of(z):
            probe.noise_multiplier, probe.encoder = z, None
            enc = probe.encoder_for(dim)
            eps = ddgauss_privacy.zcdp_epsilon(
                enc.l2_bound, enc.l1_bound, enc.scaled_noise_std, PER_ROUND, enc.padded_dim
            )
            return rdp_epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1 / eps), K))

        z = bisect(eps_of, epsilon)
        return DDGauss(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=PER_ROUND,
            seed=seed,
            mode="ideal",
            delta=DELTA,
        ), z
    fac = facs["tree" if method.endswith("tree") else "bandmf"]
    options = dict(
        factorization=fac,
        committee_size=10,
        threshold=2,
        packing=3,
        fractional_bits=12,
        clipping_norm=CLIP,
        expected_clients=PER_ROUND,
        seed=seed,
        mode="ideal",
        participation=Participation(kind="min_sep", min_sep=SEP, max_participations=K),
        delta=DELTA,
    )
    probe = DMM(inner, noise_multiplier=1.0, **options)

    def eps_of(z):
        probe.noise_multiplier = z
        enc = probe.check(dim)
        eps = dmm_privacy.run_zcdp_epsilon(
            probe.noising,
            ROUNDS,
            enc.l2_bound,
            enc.l1_bound,
            probe._scaled_noise_std,
            PER_ROUND,
            enc.padded_dim,
        )
        return rdp_epsilon(dpa.GaussianDpEvent(1 / eps))

    z = bisect(eps_of, epsilon)
    return DMM(inner, noise_multiplier=z, **options), z


def reported_epsilon(method: str, strategy) -> float | None:
    if method == "non-private":
        return None
    if method == "ddgauss":  # its ledger composes every round; a client is in K of them
        ledger = acc.PrivacyLedger("add_remove", DELTA, acc.MinSeparation(SEP, K))
        for r, event in strategy.ledger.entries:
            ledger.record(r, event)
        return ledger.epsilon()
    return float(strategy.privacy_report()["epsilon"])


def run_one(engine, setup, method, epsilon, seed, facs) -> dict:
    data, dataset, model, apps, test = setup
    dim = sum(v.size for v in to_numpy(to_record(initial_arrays(model, 0))).values())
    strategy, z = make_strategy(method, epsilon, seed, facs, dim)
    app = apps.get(method.split("-")[0], apps["plain"])
    grid = engine.open_run(
        app,
        CLIENTS,
        run_config={"seed": seed},
        participation=MinSeparationCohort(CLIENTS, SEP, seed),
        datasets=((data, dataset),),
    )
    start = time.perf_counter()
    final = run_rounds(strategy, grid, to_record(initial_arrays(model, seed)), ROUNDS)
    grid.wait_idle()
    net = build_model(model)
    load_arrays(net, to_numpy(final))
    accuracy = float(evaluate_model(net, *test)["accuracy"])
    return {
        "method": method,
        "target_epsilon": epsilon,
        "epsilon": reported_epsilon(method, strategy),
        "noise_multiplier": z,
        "seed": seed,
        "accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict], epsilons: list[float]) -> str:
    def cell(method, eps):
        accs = [
            r["accuracy"]
            for r in rows
            if r["method"] == method and (eps is None or r["target_epsilon"] == eps)
        ]
        if not accs:
            return "-"
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        return f"{statistics.mean(accs):.3f} ± {spread:.3f}"

    lines = ["| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |"]
    lines.append("|---" * (len(epsilons) + 1) + "|")
    for method in METHODS:
        if method == "non-private":
            lines.append(f"| {method} | " + " | ".join(cell(method, None) for _ in epsilons) + " |")
        else:
            lines.append(f"| {method} | " + " | ".join(cell(method, e) for e in epsilons) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], epsilons: list[float], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        if not any(r["method"] == method for r in rows):
            continue
        if method == "non-private":
            accs = [r["accuracy"] for r in rows if r["method"] == method]
            ax.axhline(statistics.mean(accs), color="k", ls="--", label=method)
            continue
        means, errs = [], []
        for e in epsilons:
            accs = [
                r["accuracy"] for r in rows if r["method"] == method and r["target_epsilon"] == e
            ]
            means.append(statistics.mean(accs))
            errs.append(statistics.stdev(accs) if len(accs) > 1 else 0.0)
        ax.errorbar(epsilons, means, yerr=errs, marker="o", capsize=3, label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits, 150 clients, 20 rounds, 5-min-separation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = DatasetSpec(source="digits", partition="iid", num_clients=CLIENTS, seed=0)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0))
    apps = {"plain": inner, "ddgauss": ddgauss_client_app(inner), "dmm": dmm_client_app(inner)}
    test = (
        torch.as_tensor(dataset.test.x, dtype=torch.float32),
        torch.as_tensor(dataset.test.y, dtype=torch.int64),
    )
    setup = (data, dataset, model, apps, test)
    facs = factorizations()
    rows = []
    with Engine(EngineConfig(backend="local")) as engine:
        for seed in args.seeds:
            for method in args.methods:
                for eps in [None] if method == "non-private" else args.epsilons:
                    row = run_one(engine, setup, method, eps, seed, facs)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    out = {
        "setup": {
            "clients": CLIENTS,
            "rounds": ROUNDS,
            "min_separation": SEP,
            "participations": K,
            "per_round": PER_ROUND,
            "clip": CLIP,
            "delta": DELTA,
        },
        "rows": rows,
    }
    (HERE / f"results{args.tag}.json").write_text(json.dumps(out, indent=2) + "\n")
    text = table(rows, args.epsilons)
    (HERE / f"table{args.tag}.md").write_text(text + "\n")
    plot(rows, args.epsilons, HERE / f"accuracy{args.tag}.png")
    print(text)
    return out


if __name__ == "__main__":
    main()
