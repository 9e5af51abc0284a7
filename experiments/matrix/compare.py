"""Central BandMF against DP-FedAvg at the same epsilon, on digits.

Both runs use ``configs/bandmf.toml`` / ``configs/dp_fedavg.toml``: the same 300 clients, the
same min-separation schedule (10 groups of 30; each client trains every 10th round, k = 10
times in 100 rounds), the same clipping norm, server learning rate 1 and client training. Only
the noise differs. For each target epsilon (delta = 1e-5, RDP):

* DP-FedAvg: independent noise each round, ``z`` calibrated for k compositions of the Gaussian
  (:func:`fedsim.privacy.calibration.calibrate_noise` with ``Participation.separated(10, 10)``);
* BandMF: the whole run is one Gaussian mechanism, so ``z`` is calibrated for one Gaussian;
  the fresh noise std is ``z * clip * sens(C)`` with ``sens(C) = sqrt(k)`` for the 10-banded,
  column-normalised C, correlated across rounds through ``C^{-1}``.

Each run's reported epsilon is read back from its summary.json (its ledger), not assumed.
Secrets: the study root in ``--secrets`` (default ``~/.fedsim/matrix.key``, kept outside the
results) gives each seed its own root (:mod:`experiments.roots`), and every run (method, epsilon,
seed) mixes its own fresh public nonce into it (:func:`fedsim.frontend.experiment.run_experiment`,
:mod:`fedsim.frontend.run_root`): the clients' secrets and the server's noise of two points never
share a stream, and each invocation draws new noise. ``results.json`` records the root's fingerprint
and every run's nonce (``run_nonces``, in the order of ``seeds``). Writes ``results.json`` and
the table in ``README.md`` (between the markers) with the mean and sample standard deviation
(ddof = 1) of the final central test accuracy over ``--seeds``; ``--table-only`` rebuilds the
README table from the stored ``results.json``.

    python experiments/matrix/compare.py [--epsilons 2 4 8] [--seeds 0 1 2] [--backend ray]
        [--secrets FILE] [--table-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
STUDY = "matrix"  # its roots: experiments/roots.py
DELTA = 1e-5
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def noise_multipliers(epsilon: float, rounds: int, min_separation: int) -> dict[str, float]:
    """``z`` for each method at ``epsilon`` (see the module docstring)."""
    from fedsim.privacy.calibration import calibrate_noise  # noqa: PLC0415
    from fedsim.privacy.participation import Participation  # noqa: PLC0415
    from fedsim.privacy.sampling import FullParticipation  # noqa: PLC0415

    k = -(-rounds // min_separation)
    return {
        "dp-fedavg": calibrate_noise(
            epsilon, DELTA, Participation.separated(min_separation, k), rounds
        ),
        "bandmf": calibrate_noise(epsilon, DELTA, FullParticipation(), 1),
    }


def run_one(config, out: Path, engine, secrets) -> dict:
    from fedsim.frontend.experiment import run_experiment  # noqa: PLC0415

    summary = run_experiment(config, out, progress=False, engine=engine, secrets=secrets)
    from fedsim.frontend.run_root import RUN_FILE  # noqa: PLC0415

    return {
        "nonce": json.loads((out / RUN_FILE).read_text())["nonce"],
        "accuracy": summary["final"]["central"]["accuracy"],
        "epsilon": summary.get("privacy", {}).get("epsilon"),
        "rounds": summary["rounds"],
        "seconds": summary["seconds"]["total"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--backend", default="ray", choices=("ray", "local"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite README.md")
    parser.add_argument("--secrets", type=Path, help="study root (default ~/.fedsim/matrix.key)")
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild the README table from --out"
    )
    args = parser.parse_args(argv)
    if args.table_only:
        write_table(json.loads(Path(args.out).read_text()), not args.no_readme)
        return 0
    from experiments.roots import default_key, seed_root, study_root  # noqa: PLC0415

    root = study_root(args.secrets or default_key(STUDY), HERE)
    logging.getLogger("absl").setLevel(logging.ERROR)
    from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415

    FLOWER_LOGGER.setLevel(logging.WARNING)
    from fedsim.engine import Engine  # noqa: PLC0415
    from fedsim.frontend.run_config import ExperimentConfig  # noqa: PLC0415

    base = {
        "bandmf": ExperimentConfig.load(HERE / "configs" / "bandmf.toml"),
        "dp-fedavg": ExperimentConfig.load(HERE / "configs" / "dp_fedavg.toml"),
    }
    rounds = base["bandmf"].rounds
    groups = round(base["bandmf"].data.num_clients / base["bandmf"].strategy.clients_per_round)
    engine_config = dataclasses.replace(
        base["bandmf"].engine, backend=args.backend, workers=args.workers
    )
    engine = Engine(engine_config).start()
    started = time.perf_counter()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for epsilon in [*args.epsilons, None]:
                zs = noise_multipliers(epsilon, rounds, groups) if epsilon else None
                methods = ("bandmf", "dp-fedavg") if epsilon else ("fedavg",)
                for method in methods:
                    runs = []
                    for seed in args.seeds:
                        config = base["dp-fedavg" if method == "fedavg" else method]
                        strategy = config.strategy
                        if zs is None:  # the non-private reference: no clipping, no noise
                            strategy = dataclasses.replace(strategy, name="fedavg", options={})
                        else:
                            options = {**strategy.options, "noise_multiplier": zs[method]}
                            strategy = dataclasses.replace(strategy, options=options)
                        config = dataclasses.replace(
                            config, seed=seed, strategy=strategy, name=f"{method}-{seed}"
                        )
                        out = Path(tmp) / f"{method}-{epsilon}-{seed}"
                        secrets = seed_root(root, STUDY, seed)
                        runs.append(run_one(config, out, engine, secrets))
                        print(method, epsilon, seed, runs[-1], file=sys.stderr, flush=True)
                    accs = [r["accuracy"] for r in runs]
                    rows.append(
                        {
                            "method": method,
                            "target_epsilon": epsilon,
                            "noise_multiplier": None if zs is None else zs[method],
                            "epsilon": max(r["epsilon"] for r in runs) if zs else None,
                            "rounds": runs[0]["rounds"],
                            "accuracy_mean": statistics.mean(accs),
                            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                            "accuracy": accs,
                            "seeds": args.seeds,
                            "run_nonces": [r["nonce"] for r in runs],
                        }
                    )
    finally:
        engine.close()
    result = {
        "experiment": "matrix",
        "delta": DELTA,
        "min_separation": groups,
        "participations": -(-rounds // groups),
        "clipping_norm": base["bandmf"].strategy.options["clipping_norm"],
        "bands": base["bandmf"].strategy.options["bands"],
        "backend": args.backend,
        "secrets_fingerprint": root.fingerprint(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    write_table(result, not args.no_readme)
    return 0


def write_table(result: dict, readme: bool) -> None:
    """Print the table of ``result`` and, with ``readme``, put it between the markers."""
    table = markdown(result)
    print(table)
    if readme:
        path = HERE / "README.md"
        text = path.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        path.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def markdown(result: dict) -> str:
    """The README table: one row per method and target epsilon."""
    lines = [
        "| method | target ε | ε reported | noise multiplier z | rounds "
        "| accuracy (mean ± sample sd, ddof = 1) |",
        "|---|---|---|---|---|---|",
    ]
    names = {"bandmf": "BandMF (matrix-mechanism)", "dp-fedavg": "DP-FedAvg", "fedavg": "FedAvg"}
    for row in result["rows"]:
        target = "∞" if row["target_epsilon"] is None else f"{row['target_epsilon']:g}"
        eps = "∞ (no noise)" if row["epsilon"] is None else f"{row['epsilon']:.3f}"
        z = "–" if row["noise_multiplier"] is None else f"{row['noise_multiplier']:.3f}"
        lines.append(
            f"| {names[row['method']]} | {target} | {eps} | {z} | {row['rounds']} | "
            f"{row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
