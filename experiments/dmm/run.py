"""DMM against DDGauss, central BandMF, central tree, DP-FedAvg and non-private.

Two sources (``--source``):

* ``digits`` (default): scikit-learn digits split iid over ``--clients`` clients (default 150,
  the first, small study), multinomial logistic regression (650 parameters, D = 1024 after
  padding), one local epoch of SGD (batch 16, lr 0.1);
* ``femnist-like``: the generated FEMNIST-like writers (:func:`fedsim.data.sources.femnist_like`,
  62 classes, one client per writer, natural partition, default 500 writers), images
  average-pooled ``--pool`` x ``--pool`` (default 4: 7x7) and multinomial logistic regression on
  them (49 x 62 + 62 = 3,100 parameters, D = 4096 after padding, so that the DMM / DDGauss
  clients' exact discrete Gaussian noise rows cost about 2 ms each), one local epoch of SGD
  (batch 32, lr 1.0). The pooled dataset is saved once under ``--cache`` and read back as an
  ``npy`` source, so every method trains on identical arrays.

``--rounds`` rounds (default 20) under 5-min-separation
(:class:`fedsim.engine.participation.MinSeparationCohort`: 5 groups of ``clients / 5``, each
client trains every 5th round, ``ceil(rounds / 5)`` times), clipping norm 1, delta 1e-5, server
learning rate 1. Every private method is calibrated to the target epsilon under that
participation:

* ``dp-fedavg``: Gaussian noise each round, ``calibrate_noise`` for ``ceil(rounds / 5)``
  compositions;
* ``central-bandmf`` / ``central-tree``: :class:`strategies.matrix_mechanism.MatrixMechanism`
  with a 5-banded BandMF C and Honaker's online tree (one Gaussian mechanism, sens(C) under
  5-min-separation);
* ``ddgauss``: :class:`strategies.ddgauss.DDGauss` (20-bit sum), z bisected so that the rounds
  a client is in compose to the target (KLS21 bound; its ledger re-read with
  ``MinSeparation(5, k)``);
* ``dmm-tree`` / ``dmm-banded``: :class:`strategies.dmm.DMM` with committees of n = 10
  (t = 2, k = 3), f = 12 fractional bits, the Honaker tree / the same BandMF; z bisected on the
  accounting of the implemented integer matrix C' (:mod:`fedsim.privacy.dmm`). Run in
  ``mode="ideal"``: the same integers as ``full`` (tests/test_dmm_strategy.py checks bit
  equality), without the cryptography's run time.

Epsilon per run is read back from each strategy. Writes ``results{tag}.json`` (after every run,
so a stopped process keeps what it finished), ``table{tag}.md`` (accuracy mean ± std over seeds
and DMM minus central / DDGauss differences) and ``accuracy{tag}.png``; ``--merge`` combines
results files of the same setup (e.g. one process per seed).

    python experiments/dmm/run.py [--source digits|femnist-like] [--clients N] [--rounds R]
        [--lr LR] [--pool 1|2|4] [--epsilons 1 2 4 8] [--seeds 0 1 2] [--methods ...] [--tag S]
    python experiments/dmm/run.py --merge results_a.json results_b.json --tag S
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dp_accounting as dpa  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedsim.data import DatasetSpec, build_dataset  # noqa: E402
from fedsim.data.dataset import FederatedDataset  # noqa: E402
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
SEP, DELTA, CLIP = 5, 1e-5, 1.0
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


@dataclass(frozen=True)
class Setting:
    """One study's population and schedule: ``clients`` registered, ``rounds`` rounds,
    ``per_round = clients / SEP`` trained per round, each client ``k`` times."""

    source: str
    clients: int
    rounds: int

    @property
    def per_round(self) -> int:
        return self.clients // SEP

    @property
    def k(self) -> int:
        return math.ceil(self.rounds / SEP)


#: Local training per source (one epoch of SGD).
LOCAL = {
    "digits": LocalTraining(epochs=1, batch_size=16, lr=0.1, seed=0),
    "femnist-like": LocalTraining(epochs=1, batch_size=32, lr=1.0, seed=0),
}


def factorizations(rounds: int) -> dict:
    return {"tree": honaker_tree(rounds), "bandmf": banded(rounds, SEP)}


def pooled_femnist(clients: int, pool: int, cache: Path) -> DatasetSpec:
    """The FEMNIST-like writers (natural partition, data seed 0) average-pooled ``pool`` x
    ``pool`` (28 / pool pixels a side), saved once under ``cache`` and described as an ``npy``
    source."""
    side = 28 // pool
    directory = cache / f"femnist_like_{clients}_pool{pool}"
    cache.mkdir(parents=True, exist_ok=True)
    if not (directory / "meta.json").is_file():
        raw = build_dataset(
            DatasetSpec(source="femnist", partition="natural", num_clients=clients, seed=0)
        )
        arrays = dict(raw.to_arrays())
        for split in ("train_x", "test_x"):
            x = np.asarray(arrays[split], dtype=np.float32)
            arrays[split] = x.reshape(len(x), 1, side, pool, side, pool).mean(axis=(3, 5))
        pooled = FederatedDataset.from_arrays(arrays, raw.num_classes, f"{raw.name}-pool{pool}")
        staging = Path(tempfile.mkdtemp(prefix=directory.name, dir=cache))
        pooled.save(staging)
        try:  # atomic, so that concurrent runs never read a half-written copy
            staging.rename(directory)
        except OSError:  # another run got there first; its copy is identical
            shutil.rmtree(staging)
    return DatasetSpec(source="npy", partition="natural", num_clients=clients, path=str(directory))


def make_strategy(method: str, epsilon: float, seed: int, facs: dict, dim: int, st: Setting):
    rounds, per_round, k = st.rounds, st.per_round, st.k
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=0)
    if method == "non-private":
        return inner, None
    if method == "dp-fedavg":
        z = acc.calibrate_noise(epsilon, DELTA, acc.MinSeparation(SEP, k), rounds)
        return DPFedAvg(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            rng=np.random.default_rng([seed, 11]),
            sampling=acc.MinSeparation(SEP, k),
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
            expected_clients=per_round,
            seed=seed,
            min_separation=SEP,
            max_participations=k,
            delta=DELTA,
        ), z
    if method == "ddgauss":
        probe = DDGauss(
            inner, clipping_norm=CLIP, noise_multiplier=1.0, expected_clients=per_round, seed=seed
        )

        def eps_of(z):
            probe.noise_multiplier, probe.encoder = z, None
            enc = probe.encoder_for(dim)
            eps = ddgauss_privacy.zcdp_epsilon(
                enc.l2_bound, enc.l1_bound, enc.scaled_noise_std, per_round, enc.padded_dim
            )
            return rdp_epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1 / eps), k))

        z = bisect(eps_of, epsilon)
        return DDGauss(
            inner,
            clipping_norm=CLIP,
            noise_multiplier=z,
            expected_clients=per_round,
            seed=seed,
            mode="plaintext",
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
        expected_clients=per_round,
        seed=seed,
        mode="ideal",
        participation=Participation(kind="min_sep", min_sep=SEP, max_participations=k),
        delta=DELTA,
    )
    probe = DMM(inner, noise_multiplier=1.0, **options)

    def eps_of(z):
        probe.noise_multiplier = z
        enc = probe.check(dim)
        eps = dmm_privacy.run_zcdp_epsilon(
            probe.noising,
            rounds,
            enc.l2_bound,
            enc.l1_bound,
            probe._scaled_noise_std,
            per_round,
            enc.padded_dim,
        )
        return rdp_epsilon(dpa.GaussianDpEvent(1 / eps))

    z = bisect(eps_of, epsilon)
    return DMM(inner, noise_multiplier=z, **options), z


def reported_epsilon(method: str, strategy, st: Setting) -> float | None:
    if method == "non-private":
        return None
    if method == "ddgauss":  # its ledger composes every round; a client is in k of them
        ledger = acc.PrivacyLedger("add_remove", DELTA, acc.MinSeparation(SEP, st.k))
        for r, event in strategy.ledger.entries:
            ledger.record(r, event)
        return ledger.epsilon()
    return float(strategy.privacy_report()["epsilon"])


def run_one(engine, setup, method, epsilon, seed, facs, st: Setting) -> dict:
    data, dataset, model, apps, test = setup
    dim = sum(v.size for v in to_numpy(to_record(initial_arrays(model, 0))).values())
    strategy, z = make_strategy(method, epsilon, seed, facs, dim, st)
    app = apps.get(method.split("-")[0], apps["plain"])
    grid = engine.open_run(
        app,
        st.clients,
        run_config={"seed": seed},
        participation=MinSeparationCohort(st.clients, SEP, seed),
        datasets=((data, dataset),),
    )
    start = time.perf_counter()
    final = run_rounds(strategy, grid, to_record(initial_arrays(model, seed)), st.rounds)
    grid.wait_idle()
    net = build_model(model)
    load_arrays(net, to_numpy(final))
    accuracy = float(evaluate_model(net, *test)["accuracy"])
    return {
        "method": method,
        "target_epsilon": epsilon,
        "epsilon": reported_epsilon(method, strategy, st),
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


#: (DMM variant, reference) pairs of the difference table.
DIFFERENCES = (
    ("dmm-banded", "central-bandmf"),
    ("dmm-tree", "central-tree"),
    ("dmm-banded", "ddgauss"),
    ("dmm-tree", "ddgauss"),
)


def difference_table(rows: list[dict], epsilons: list[float]) -> str:
    """Mean accuracy of each DMM variant minus its reference, per epsilon, with the standard
    error of the difference, sqrt(s_a^2 / n_a + s_b^2 / n_b) over seeds."""

    def accs(method, eps):
        return [r["accuracy"] for r in rows if r["method"] == method and r["target_epsilon"] == eps]

    head = " | ".join(f"{a} − {b}" for a, b in DIFFERENCES)
    lines = [f"| ε | {head} |", "|---" * (len(DIFFERENCES) + 1) + "|"]
    for eps in epsilons:
        cells = []
        for a, b in DIFFERENCES:
            xa, xb = accs(a, eps), accs(b, eps)
            if len(xa) < 2 or len(xb) < 2:
                cells.append("-")
                continue
            se = math.sqrt(statistics.variance(xa) / len(xa) + statistics.variance(xb) / len(xb))
            cells.append(f"{statistics.mean(xa) - statistics.mean(xb):+.3f} ± {se:.3f}")
        lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], epsilons: list[float], path: Path, title: str) -> None:
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
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("digits", "femnist-like"), default="digits")
    parser.add_argument("--clients", type=int, help="registered clients (default 150 / 500)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lr", type=float, help="local SGD step (default 0.1 / 1.0)")
    parser.add_argument(
        "--pool", type=int, default=4, choices=(1, 2, 4), help="femnist-like: average pooling"
    )
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    parser.add_argument(
        "--cache", type=Path, default=Path("/tmp/fedsim-dmm-data"), help="pooled FEMNIST-like"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="only combine these results files (same setup)"
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.tag)
    clients = args.clients or (150 if args.source == "digits" else 500)
    if clients < 2 * SEP or clients % SEP:
        parser.error(f"--clients {clients}: need a multiple of {SEP} that is >= {2 * SEP}")
    st = Setting(args.source, clients, args.rounds)
    local = LOCAL[args.source]
    if args.lr is not None:
        local = replace(local, lr=args.lr)
    torch.set_num_threads(1)
    if args.source == "digits":
        data = DatasetSpec(source="digits", partition="iid", num_clients=clients, seed=0)
    else:
        data = pooled_femnist(clients, args.pool, args.cache)
    dataset = build_dataset(data)
    model = ModelSpec(
        kind="logreg", input_shape=tuple(dataset.feature_shape), num_classes=dataset.num_classes
    )
    inner = make_client_app(model, data, local)
    apps = {"plain": inner, "ddgauss": ddgauss_client_app(inner), "dmm": dmm_client_app(inner)}
    test = (
        torch.as_tensor(np.array(dataset.test.x), dtype=torch.float32),
        torch.as_tensor(np.array(dataset.test.y), dtype=torch.int64),
    )
    setup = (data, dataset, model, apps, test)
    facs = factorizations(st.rounds)
    out = {
        "setup": {
            "source": st.source,
            "clients": st.clients,
            "rounds": st.rounds,
            "min_separation": SEP,
            "participations": st.k,
            "per_round": st.per_round,
            "model": f"logreg on {list(dataset.feature_shape)}",
            "local": asdict(local),
            "clip": CLIP,
            "delta": DELTA,
        },
        "rows": [],
    }
    # seed, then epsilon, then method: a run cut short still leaves whole (seed, epsilon) cells
    plan = [(seed, None, "non-private") for seed in args.seeds if "non-private" in args.methods]
    plan = [
        *plan,
        *(
            (seed, eps, method)
            for seed in args.seeds
            for eps in args.epsilons
            for method in args.methods
            if method != "non-private"
        ),
    ]
    plan.sort(key=lambda step: args.seeds.index(step[0]))
    with Engine(EngineConfig(backend="local")) as engine:
        for seed, eps, method in plan:
            row = run_one(engine, setup, method, eps, seed, facs, st)
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            write_results(out, args.tag)  # after every run, so partial results survive
    return report(out, sorted(args.epsilons), args.tag)


def write_results(out: dict, tag: str) -> None:
    (HERE / f"results{tag}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")


def report(out: dict, epsilons: list[float], tag: str) -> dict:
    """Write ``results{tag}.json``, ``table{tag}.md`` and ``accuracy{tag}.png``."""
    write_results(out, tag)
    st = out["setup"]
    text = table(out["rows"], epsilons)
    diffs = difference_table(out["rows"], epsilons)
    (HERE / f"table{tag}.md").write_text(
        text + "\n\nDMM minus reference (mean ± s.e.):\n\n" + diffs + "\n"
    )
    title = (
        f"{st.get('source', 'digits')}, {st['clients']} clients ({st['per_round']} per round), "
        f"{st['rounds']} rounds, {SEP}-min-separation"
    )
    plot(out["rows"], epsilons, HERE / f"accuracy{tag}.png", title)
    print(text + "\n\n" + diffs)
    return out


def merge(paths: list[Path], tag: str) -> dict:
    """Combine the rows of several ``results*.json`` of the same setup (e.g. one per seed)."""
    outs = [json.loads(Path(p).read_text()) for p in paths]
    for path, other in zip(paths[1:], outs[1:], strict=True):
        if other["setup"] != outs[0]["setup"]:
            raise ValueError(f"--merge: {path} has setup {other['setup']}, not {outs[0]['setup']}")
    rows, seen = [], {}
    for row in (row for other in outs for row in other["rows"]):
        key = (row["method"], row["target_epsilon"], row["seed"])
        if key in seen:  # the same run in two files: runs are deterministic, so equal
            if seen[key]["accuracy"] != row["accuracy"]:
                raise ValueError(
                    f"--merge: run {key} has accuracies {seen[key]['accuracy']} and "
                    f"{row['accuracy']} in different files"
                )
            continue
        seen[key] = row
        rows.append(row)
    epsilons = sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] is not None})
    return report({"setup": outs[0]["setup"], "rows": rows}, epsilons, tag)


if __name__ == "__main__":
    main()
