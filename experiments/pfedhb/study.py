"""pFedHB (Adam and exact server) vs pFedVEM, pFedBayes and FedAvg + FT at the reference's
hyper-parameters, from run configs.

Every (federation, method, seed) is one ``fedsim run`` config (``config_for``), run on the
local engine; its run directory goes under ``--work`` (git-ignored) and its evaluations
are stored as ``runs/<federation>__<method>__s<seed>.json`` next to this file. Finished
runs are skipped, an interrupted one resumes from its last checkpoint, so the study can be
stopped and restarted at will::

    nice -n 19 python experiments/pfedhb/study.py run            # the whole study
    nice -n 19 python experiments/pfedhb/study.py run --federations digits-pairs \\
        --methods pfedhb-adam --seeds 0 --rounds 5                # a timing run
    python experiments/pfedhb/study.py table                      # README tables from runs/
    python experiments/pfedhb/study.py config digits-pairs pfedhb-adam 0 > run.toml

``table`` rewrites the parts of README.md between ``<!-- study:begin -->`` and
``<!-- study:end -->`` and the ``scale-supports`` and ``scale-findings`` regions from the
stored runs (and ``crosscheck.json``) only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from experiments.pfedhb import findings, tuning  # noqa: E402

RUNS = HERE / "runs"
CROSSCHECK = HERE / "crosscheck.json"
README = HERE / "README.md"

#: label skew as in the reference code: pairs of clients split the classes (each client
#: half of them), every class cut into random unequal chunks (quantity skew)
FEDERATIONS: dict[str, dict[str, Any]] = {
    "digits-pairs": {
        "source": "digits",
        "partition": "split-classes",
        "classes_per_client": 5,
        "num_clients": 50,
        "test_fraction": 0.25,
    },
    # the generated FEMNIST-like writers, restricted to FEMNIST's 10 digit classes (28 x 28
    # inputs and 10 classes, as the reference's FMNIST runs), pooled and re-split in pairs
    "femnist-pairs": {
        "source": "femnist",
        "femnist_classes": 10,
        "partition": "split-classes",
        "classes_per_client": 5,
        "num_clients": 50,
        "samples_per_client": 60,
        "test_fraction": 0.25,
    },
    # the reference's data scale: 500 rows a writer before the pools (300 training rows a
    # client on average), each client tested on the global test pool's rows of its 5 classes
    "femnist-pairs-300": {
        "source": "femnist",
        "femnist_classes": 10,
        "partition": "split-classes",
        "classes_per_client": 5,
        "num_clients": 50,
        "samples_per_client": 500,
        "test_fraction": 0.2,
        "client_test": "class-pool",
    },
}
#: the scale study's federations, each with its validation twin (the same training rows,
#: tested on the validation pool) on which the KL weights are chosen (:mod:`tuning`)
SCALE = ("femnist-pairs-300",)
for _name in SCALE:
    FEDERATIONS[_name + tuning.VALIDATION] = {
        **FEDERATIONS[_name],
        "client_test": "class-pool-validation",
    }

#: the reference code's client settings (experiment/configs/fmnist.json of pFedHB)
PERSONAL = {
    "head_steps": 10,  # local_head_epochs (full batch)
    "head_lr": 1e-3,  # local_lr_head (Adam)
    "body_lr": 1e-3,  # local_lr_base (Adam)
    "body_epochs": 2,  # local_base_epochs
    "batch_size": 50,
    "mc_samples": 5,  # n_mc
    "body_kl": 1e-6,  # kl_coeff_base
    "eval_samples": 10,
    "ece_bins": 10,
}

#: method -> ([strategy] name, [strategy.options], [personal] overrides)
METHODS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "pfedhb-adam": ("pfedhb", {"server_solver": "adam"}, {}),
    "pfedhb-exact": ("pfedhb", {"server_solver": "exact"}, {}),
    "pfedvem": ("pfedvem", {}, {}),
    # pFedBayes (Zhang et al. 2022): zeta = 10, K = 5 personal steps per local-global step
    "pfedbayes": ("pfedbayes", {}, {"zeta": 10.0, "personal_steps": 5}),
    # the same with zeta = 0.01: at 10 the KL to w_i outweighs the likelihood of the
    # client's 27-45 training rows and the personal model does not learn (see README)
    "pfedbayes-z0.01": ("pfedbayes", {}, {"zeta": 0.01, "personal_steps": 5}),
    # FedAvg + FT: SGD (lr 0.05, 2 epochs of batch 50) and 2 fine-tuning epochs
    "fedavg-ft": ("fedavg-ft", {"finetune_epochs": 2}, {"sgd_lr": 0.05, "sgd_epochs": 2}),
}
#: the ablation (see README, digits-pairs only): the head's KL to its prior weighted by
#: 0.05, about (training rows per client here, 27) / (per client in the reference's FMNIST
#: runs, 600), so that the prior weighs against the likelihood as it does there
KL_005 = {"head_kl": 0.05}
ABLATIONS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "pfedhb-adam-kl0.05": ("pfedhb", {"server_solver": "adam"}, KL_005),
    "pfedhb-exact-kl0.05": ("pfedhb", {"server_solver": "exact"}, KL_005),
    "pfedvem-kl0.05": ("pfedvem", {}, KL_005),
}
#: (pFedHB variant, other) pairs of the paired-difference table
PAIRS = (
    *(
        (hb, other)
        for hb in ("pfedhb-adam", "pfedhb-exact")
        for other in ("pfedvem", "pfedbayes", "pfedbayes-z0.01")
    ),
    *(
        (hb, other)
        for hb in ("pfedhb-adam-kl0.05", "pfedhb-exact-kl0.05")
        for other in ("pfedvem-kl0.05", "pfedbayes-z0.01")
    ),
)
#: the scale study's rows: every Bayesian method at its KL weight chosen on validation
TUNED = tuple(tuning.tuned(m) for m in tuning.GRID)
#: and its paired differences
SCALE_PAIRS = tuple(
    (tuning.tuned(hb), tuning.tuned(other))
    for hb in ("pfedhb-adam", "pfedhb-exact")
    for other in ("pfedvem", "pfedbayes")
)
ORDER = tuple(dict.fromkeys((*METHODS, *ABLATIONS, *TUNED, *tuning.variants())))


def method_settings(method: str, federation: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``method``'s (strategy name, strategy options, [personal] overrides); a grid point
    (``pfedbayes-z0.1``) or a tuned method (``pfedbayes-tuned``: its weight chosen on
    ``federation``'s validation runs) is its base method with that weight."""
    if method in METHODS or method in ABLATIONS:
        return {**METHODS, **ABLATIONS}[method]
    grid = tuning.variants()
    if method in grid:
        base, key, value = grid[method]
    elif method in TUNED:
        base = method.removesuffix("-tuned")
        key, value = tuning.GRID[base][0], tuning.choose(load_runs(), federation, base)
    else:
        raise ValueError(f"method {method!r}: allowed {', '.join(ORDER)}")
    name, options, personal = METHODS[base]
    return name, options, {**personal, key: value}


def config_for(federation: str, method: str, seed: int, rounds: int) -> dict[str, Any]:
    """The run config (as a TOML-shaped dict) of one (federation, method, seed)."""
    name, options, personal = method_settings(method, federation)
    return {
        "name": f"{federation}/{method}/s{seed}",
        "seed": seed,
        "rounds": rounds,
        "checkpoint_every": 10,
        "data": dict(FEDERATIONS[federation]),
        "model": {"kind": "bayes-mlp", "hidden": [100], "head_layers": 1, "rho_init": -4.0},
        "personal": {**PERSONAL, **personal},
        "strategy": {
            "name": name,
            "clients_per_round": max(1, round(0.1 * FEDERATIONS[federation]["num_clients"])),
            "sampling": "poisson",  # Binomial(N, 0.1), at least 2: the reference sampler
            "options": options,
        },
        "evaluation": {"every": 5},
        "engine": {"backend": "local"},
    }


def result_path(federation: str, method: str, seed: int) -> Path:
    return RUNS / f"{federation}__{method}__s{seed}.json"


def _claim(lock: Path) -> bool:
    """Take a job's lock file (its holder's pid), or take it over from a holder that died."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(lock.read_text() or 0), 0)
                return False  # its holder is alive
            except (ProcessLookupError, ValueError, OSError):
                lock.unlink(missing_ok=True)
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def run_one(job: tuple[str, str, int, int, str]) -> dict[str, Any]:
    """Run (or resume) one config and store its evaluations; returns the stored record.

    Several invocations may share the runs: a job another live process holds is waited for,
    a job already stored is returned as stored (``"skipped": True``)."""
    federation, method, seed, rounds, work = job
    path = result_path(federation, method, seed)
    lock = Path(work) / federation / method / f"s{seed}.lock"
    while not path.exists() and not _claim(lock):
        time.sleep(30)
    if path.exists():
        if lock.exists() and lock.read_text() == str(os.getpid()):
            lock.unlink()
        return {**json.loads(path.read_text()), "skipped": True}
    try:
        return _run_and_store(job)
    finally:
        lock.unlink(missing_ok=True)


def _run_and_store(job: tuple[str, str, int, int, str]) -> dict[str, Any]:
    federation, method, seed, rounds, work = job
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    from fedsim.checkpoint import CONFIG_FILE, STATE_FILE, checkpoint_files  # noqa: PLC0415
    from fedsim.config import to_mapping  # noqa: PLC0415
    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415
    from fedsim.frontend.results import read_rounds  # noqa: PLC0415
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415

    config = ExperimentConfig.from_dict(config_for(federation, method, seed, rounds))
    out = Path(work) / federation / method / f"s{seed}"
    resume = (out / CONFIG_FILE).exists()  # started before: continue from its checkpoint
    cpu, wall = time.process_time(), time.perf_counter()
    summary = run_experiment(config, out, resume=resume, progress=False)
    curve = []
    for record in read_rounds(out / "rounds.jsonl"):
        if "aggregated_evaluate" in record or "central" in record:
            curve.append(
                {
                    "round": record["round"],
                    **record.get("aggregated_evaluate", {}),
                    **record.get("central", {}),
                }
            )
    stored = {
        "federation": federation,
        "method": method,
        "seed": seed,
        "rounds": rounds,
        "config": to_mapping(config),
        "dataset": summary["dataset"],
        "cpu_seconds": time.process_time() - cpu,
        "process_cpu_seconds": time.process_time(),  # with the imports (one run a process)
        "wall_seconds": time.perf_counter() - wall,
        "resumed": resume,
        "curve": curve,
    }
    path = result_path(federation, method, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=1) + "\n")
    tmp.replace(path)
    for bulky in (out / STATE_FILE, *checkpoint_files(out)):  # the clients' states: megabytes
        bulky.unlink(missing_ok=True)
    return stored


def cmd_run(args: argparse.Namespace) -> None:
    jobs = [
        (f, m, s, args.rounds, str(args.work))
        for s in args.seeds
        for f in args.federations
        for m in args.methods
        if args.force or not result_path(f, m, s).exists()
    ]
    if args.reverse:  # a second invocation starts from the other end of the list
        jobs.reverse()
    run_jobs(jobs, args.processes)


def cmd_scale(args: argparse.Namespace) -> None:
    """The scale study: every grid point on the validation twins under the tuning seeds,
    then the tuned methods and FedAvg + FT on the test federations under ``--seeds``."""
    for federation in SCALE:
        grid = [
            (federation + tuning.VALIDATION, m, s, args.rounds, str(args.work))
            for s in tuning.TUNING_SEEDS
            for m in tuning.variants()
        ]
        run_jobs([j for j in grid if not result_path(*j[:3]).exists()], args.processes)
        rows = [
            (federation, m, s, args.rounds, str(args.work))
            for s in args.seeds
            for m in (*TUNED, "fedavg-ft")
        ]
        run_jobs([j for j in rows if not result_path(*j[:3]).exists()], args.processes)


def run_jobs(jobs: list[tuple[str, str, int, int, str]], processes: int) -> None:
    print(f"{len(jobs)} runs to do", flush=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    start = time.perf_counter()
    # every run in a fresh process: its CPU time is the process's, imports included
    with mp.get_context("spawn").Pool(processes, maxtasksperchild=1) as pool:
        for r in pool.imap_unordered(run_one, jobs):
            _report(r, start)


def _report(r: dict[str, Any], start: float) -> None:
    last = r["curve"][-1]
    print(
        f"[{time.perf_counter() - start:7.0f}s] {r['federation']} {r['method']} s{r['seed']}: "
        f"cpu {r['cpu_seconds']:.0f}s wall {r['wall_seconds']:.0f}s "
        f"personal {last.get('personal_acc_mean', float('nan')):.3f} "
        f"global {last.get('global_acc', float('nan')):.3f}",
        flush=True,
    )


# --------------------------------------------------------------------------- tables

METRICS = (
    ("personal_acc_mean", "personalised acc (%)", 100.0, 1),
    ("global_acc", "global acc (%)", 100.0, 1),
    ("personal_ece_mc", "personal ECE (MC)", 1.0, 3),
    ("personal_ece_mean", "personal ECE (mean)", 1.0, 3),
    ("global_ece", "global ECE", 1.0, 3),
)


def load_runs() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))]


def final(run: dict[str, Any], key: str) -> float:
    return float(run["curve"][-1].get(key, float("nan")))


def mean_sd(values: np.ndarray, scale: float, digits: int) -> str:
    """``mean ± sample standard deviation`` (ddof = 1) of the values times ``scale``."""
    v = np.asarray(values, dtype=np.float64) * scale
    sd = v.std(ddof=1) if v.size > 1 else float("nan")
    return f"{v.mean():.{digits}f} ± {sd:.{digits}f}"


def tables(runs: list[dict[str, Any]]) -> str:
    """The README's tables (final round, mean ± sample std over seeds) and paired gaps."""
    from scipy import stats  # noqa: PLC0415

    lines: list[str] = []
    for federation in FEDERATIONS:
        mine = [r for r in runs if r["federation"] == federation]
        if not mine or federation.endswith(tuning.VALIDATION):
            continue
        rounds = {r["rounds"] for r in mine}
        first = {}  # one run per seed: every method of a seed has the same split
        for r in mine:
            first.setdefault(r["seed"], r)
        sizes = [r["dataset"]["train"]["sizes"] for r in first.values()]
        rows = (
            f"; training rows per client: mean {np.mean([z['mean'] for z in sizes]):.1f}, "
            f"{min(z['min'] for z in sizes):.0f}–{max(z['max'] for z in sizes):.0f} over "
            f"{len(sizes)} seeds"
            if sizes
            else ""
        )
        lines += [
            f"\n**{federation}** (round {', '.join(map(str, sorted(rounds)))}; "
            f"mean ± sample std, ddof = 1, over seeds{rows})\n",
            "| method | seeds | " + " | ".join(m[1] for m in METRICS) + " |",
            "|---" * (len(METRICS) + 2) + "|",
        ]
        for method in ORDER:
            sel = [r for r in mine if r["method"] == method]
            if not sel:
                continue
            cells = [mean_sd([final(r, k) for r in sel], s, d) for k, _, s, d in METRICS]
            lines.append(f"| {method} | {len(sel)} | " + " | ".join(cells) + " |")
    lines += [
        "\nPaired per-seed differences, pFedHB − other (points of accuracy; mean ± sample std, "
        "ddof = 1, over seeds; p: two-sided paired t-test):\n",
        "| federation | pFedHB | vs | personalised acc | p | global acc | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for federation in FEDERATIONS:
        for solver, other in (*PAIRS, *SCALE_PAIRS):
            cells = []
            for key, _ in findings.KEYS:
                differences = findings.paired(runs, federation, solver, other, key)
                if len(differences) < 2:
                    break
                # the paired t-test: a one-sample t-test of the differences against zero
                p = stats.ttest_1samp(differences, 0.0).pvalue
                cells += [mean_sd(differences, 1.0, 1), f"{p:.2g}"]
            else:
                lines.append(f"| {federation} | {solver} | {other} | " + " | ".join(cells) + " |")
    for federation in SCALE:
        if any(r["federation"] == federation + tuning.VALIDATION for r in runs):
            lines += tuning.table(runs, federation)
    cpu = sum(r.get("process_cpu_seconds", r["cpu_seconds"]) for r in runs)
    lines.append(
        f"\n{len(runs)} runs stored in `runs/`; their CPU time (each run in its own process "
        f"with one torch thread, imports included): {cpu / 3600:.2f} h."
    )
    return "\n".join(lines)


def scale_text(runs: list[dict[str, Any]]) -> str:
    """The scale study's findings per federation and, once stored, the cross-check."""
    parts = [findings.scale_findings(runs, federation) for federation in SCALE]
    parts += [findings.plateau(runs, federation) for federation in SCALE]
    if CROSSCHECK.exists():
        parts.append(findings.crosscheck_table(json.loads(CROSSCHECK.read_text()), runs))
    return "\n".join(p for p in parts if p)


def write_region(name: str, text: str) -> None:
    """README.md between ``<!-- name:begin -->`` and ``<!-- name:end -->`` becomes ``text``."""
    readme = README.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin in readme and end in readme:
        head, rest = readme.split(begin, 1)
        _, tail = rest.split(end, 1)
        README.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def cmd_table(args: argparse.Namespace) -> None:
    runs = load_runs()
    text = tables(runs)
    print(text)
    write_region("study", text)
    write_region("scale-findings", scale_text(runs))
    write_region(
        "scale-supports",
        "\n".join(findings.supports(runs, f, tuning.tuned("pfedhb-adam")) for f in SCALE),
    )
    plot(runs, HERE / "accuracy.png")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Personalised accuracy over rounds, mean ± sample std over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    federations = [
        f
        for f in FEDERATIONS
        if not f.endswith(tuning.VALIDATION) and any(r["federation"] == f for r in runs)
    ]
    if not federations:
        return
    fig, axes = plt.subplots(1, len(federations), figsize=(5 * len(federations), 3.6))
    for ax, federation in zip(np.atleast_1d(axes), federations, strict=True):
        for method in ORDER:
            sel = [r for r in runs if r["federation"] == federation and r["method"] == method]
            if not sel:
                continue
            rounds = [row["round"] for row in sel[0]["curve"]]
            acc = np.array([[row["personal_acc_mean"] for row in r["curve"]] for r in sel]) * 100
            sd = acc.std(0, ddof=1) if len(sel) > 1 else np.zeros(acc.shape[1])
            ax.errorbar(rounds, acc.mean(0), yerr=sd, label=method, capsize=2)
        ax.set_title(federation)
        ax.set_xlabel("round")
        ax.set_ylabel("personalised accuracy (%)")
        ax.legend(fontsize=7)  # each panel has its own methods
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def toml(config: dict[str, Any]) -> str:
    """``config`` (scalars, lists and nested tables) as a TOML document for ``fedsim run``."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)

    lines = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for table, body in config.items():
        if isinstance(body, dict):
            lines += ["", f"[{table}]", *(f"{k} = {value(v)}" for k, v in body.items())]
    return "\n".join(lines) + "\n"


def cmd_config(args: argparse.Namespace) -> None:
    print(toml(config_for(args.federation, args.method, args.seed, args.rounds)), end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("config", help="print one run's config as TOML (for fedsim run)")
    one.add_argument("federation", choices=list(FEDERATIONS))
    one.add_argument("method", choices=ORDER)
    one.add_argument("seed", type=int)
    one.add_argument("--rounds", type=int, default=50)
    run = sub.add_parser("run", help="run the missing (federation, method, seed) configs")
    run.add_argument(
        "--federations",
        nargs="*",
        default=["digits-pairs", "femnist-pairs"],
        choices=list(FEDERATIONS),
    )
    run.add_argument("--methods", nargs="*", default=list(METHODS), choices=ORDER)
    run.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    run.add_argument("--rounds", type=int, default=50)
    run.add_argument("--processes", type=int, default=2)
    run.add_argument("--work", type=Path, default=ROOT / "results" / "pfedhb-study")
    run.add_argument("--force", action="store_true", help="rerun stored runs too")
    run.add_argument("--reverse", action="store_true", help="last jobs first")
    scale = sub.add_parser("scale", help="the scale study: KL weights on validation, then tuned")
    scale.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    scale.add_argument("--rounds", type=int, default=50)
    scale.add_argument("--processes", type=int, default=1)
    scale.add_argument("--work", type=Path, default=ROOT / "results" / "pfedhb-study")
    sub.add_parser("table", help="README tables and accuracy.png from the stored runs")
    args = parser.parse_args()
    commands = {"run": cmd_run, "scale": cmd_scale, "table": cmd_table, "config": cmd_config}
    commands[args.command](args)


if __name__ == "__main__":
    main()
