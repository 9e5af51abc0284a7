"""Accounting study: epsilon against rounds for three mechanisms at the same noise multiplier.

One federation (``--population`` clients, about ``--cohort`` per round, each round's clipped sum
noised with std ``z * C``), three ways of releasing it, each accounted by the accountant fedsim's
own runs use:

* **DP-FedAvg, Poisson sampling** (``dp-fedavg``, ``sampling = "poisson"``): each client in each
  round with probability q = cohort / population; the Gaussian mechanism amplified by Poisson
  subsampling, composed over rounds (:func:`fedsim.privacy.epsilon.epsilon_curve`, what
  ``fedsim account sweep dp-fedavg`` plots; add/remove neighbours).
* **DP-FTRL / BandMF matrix mechanism** (``matrix-mechanism``, ``sampling = "min-separation"``):
  clients in b = population / cohort groups, each group every b rounds, so a client takes part
  in at most k = ceil(rounds / b) rounds; a banded factorization with b bands optimised for that
  schedule (:mod:`fedsim.privacy.matrix.build`, what ``fedsim factorize`` builds); epsilon after
  T rounds from ``fedsim account matrix --rounds T`` (the Gaussian on the rows released so far,
  sensitivity sens_T of the factorization actually used; equal to the strategy's ledger).
* **DDGauss** (``ddgauss``: the distributed discrete Gaussian over secure aggregation): every
  client of the cohort adds its share of discrete Gaussian noise to its rounded update, with the
  granularity the strategy picks for ``--dim`` parameters and a ``--bits`` modular sum
  (:meth:`strategies.methods.ddgauss.strategy.DDGauss.encoder_for`); each round recorded in a
  :class:`~fedsim.privacy.ledger.PrivacyLedger` as KLS21 Theorem 1's zCDP bound for the noise
  of the clients that did not drop out (``--dropout``), with no amplification by sampling, for
  zero-out neighbours (one client's update zeroed, its noise share kept: what the bound proves).

Writes ``epsilon.csv`` (one row per round count, one column per mechanism), ``epsilon.json``
(the settings, the quantities each bound rests on, the curves) and ``epsilon.png`` (log scale)
to ``--out``; prints the final epsilons.

    python examples/accounting_study/study.py --rounds 100 --out examples/accounting_study/results
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedsim.cli import _parser as fedsim_parser  # noqa: E402
from fedsim.commands import account  # noqa: E402
from fedsim.privacy import ddgauss as ddgauss_privacy  # noqa: E402
from fedsim.privacy.epsilon import epsilon_curve  # noqa: E402
from fedsim.privacy.matrix.build import Spec, cached  # noqa: E402
from fedsim.privacy.sampling import PoissonSampling  # noqa: E402
from strategies.methods.ddgauss.strategy import DDGauss  # noqa: E402

MECHANISMS = ("dp-fedavg-poisson", "matrix-bandmf", "ddgauss")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="rounds n (the horizon)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="z, all three")
    parser.add_argument("--population", type=int, default=1000, help="registered clients N")
    parser.add_argument("--cohort", type=int, default=100, help="clients per round")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta")
    parser.add_argument("--dim", type=int, default=650, help="model parameters (DDGauss)")
    parser.add_argument("--bits", type=int, default=20, help="DDGauss's modular sum, in bits")
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="share of DDGauss's cohort that drops out"
    )
    parser.add_argument("--points", type=int, default=20, help="round counts on the curves")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    for flag, value, ok, allowed in (
        ("--rounds", args.rounds, args.rounds >= 1, "an integer >= 1"),
        ("--population", args.population, args.population >= 1, "an integer >= 1"),
        ("--cohort", args.cohort, 1 <= args.cohort <= args.population, "in [1, --population]"),
        ("--points", args.points, args.points >= 2, "an integer >= 2"),
        ("--dropout", args.dropout, 0 <= args.dropout < 1, "a fraction in [0, 1)"),
        ("--dim", args.dim, args.dim >= 1, "an integer >= 1"),
    ):
        if not ok:
            parser.error(f"{flag} = {value!r} is not allowed: {allowed}")
    return args


def round_grid(rounds: int, points: int) -> list[int]:
    """Up to ``points`` distinct round counts in [1, rounds], evenly spread, ending at rounds."""
    return sorted({max(1, round(rounds * i / points)) for i in range(1, points + 1)})


def dp_fedavg_curve(args: argparse.Namespace, grid: list[int]) -> tuple[list[float], dict]:
    q = args.cohort / args.population
    eps = epsilon_curve(args.noise_multiplier, PoissonSampling(q), grid, args.delta)
    return eps, {"sampling_rate": q, "relation": "add_remove", "accountant": "rdp"}


def matrix_curve(
    args: argparse.Namespace, grid: list[int], out: Path
) -> tuple[list[float], dict]:
    """BandMF under b-min-separation; each point from ``fedsim account matrix --rounds T``."""
    b = max(1, round(args.population / args.cohort))
    k = math.ceil(args.rounds / b)
    bands = min(b, args.rounds)
    spec = Spec(kind="banded", rounds=args.rounds, bands=bands, participations=k, min_sep=b)
    path = out / f"bandmf-n{args.rounds}-b{b}-k{k}.npz"
    cached(spec, path)
    eps, last = [], {}
    for rounds in grid:
        command = fedsim_parser().parse_args(
            [
                "account", "matrix", "--factorization", str(path),
                "--noise-multiplier", str(args.noise_multiplier), "--delta", str(args.delta),
                "--rounds", str(rounds), "--participations", str(k), "--min-sep", str(b),
            ]
        )  # fmt: skip
        last = account.run(command)
        eps.append(last["epsilon"])
    details = {
        "factorization": str(path.name),
        "min_sep": b,
        "participations": k,
        "bands": bands,
        "sensitivity": last["sensitivity"],
        "sensitivity_exact": last["sensitivity_exact"],
        "relation": last["relation"],
        "accountant": last["accountant"],
    }
    return eps, details


def ddgauss_curve(args: argparse.Namespace, grid: list[int]) -> tuple[list[float], dict]:
    """The strategy's encoder and its ledger's event for the clients whose noise is present."""
    strategy = DDGauss(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=args.noise_multiplier,
        expected_clients=args.cohort,
        seed=0,
        mode="plaintext",
        bits=args.bits,
        delta=args.delta,
    )
    encoder = strategy.encoder_for(args.dim)
    survivors = args.cohort - round(args.dropout * args.cohort)
    event = ddgauss_privacy.round_event(
        encoder.l2_bound, encoder.l1_bound, encoder.scaled_noise_std, survivors, encoder.padded_dim
    )
    ledger = strategy.ledger
    eps = []
    for server_round in range(1, grid[-1] + 1):
        ledger.record(server_round, event)
        if server_round in grid:
            eps.append(ledger.epsilon())
    details = {
        "gamma": encoder.gamma,
        "l2_bound": encoder.l2_bound,
        "l1_bound": encoder.l1_bound,
        "scaled_noise_std": encoder.scaled_noise_std,
        "padded_dim": encoder.padded_dim,
        "noise_clients": survivors,
        "relation": strategy.privacy_report()["relation"],  # zero-out: what KLS21 proves
        "accountant": "rdp",
    }
    return eps, details


def plot(path: Path, grid: list[int], curves: dict[str, list[float]], title: str) -> None:
    """epsilon against rounds, one line per mechanism (Agg canvas, log scale)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, eps in curves.items():
        ax.plot(grid, eps, marker="o", markersize=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("rounds")
    ax.set_ylabel("epsilon")
    ax.set_title(title, fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = round_grid(args.rounds, args.points)
    with account.quiet_dp_accounting():
        results = {
            "dp-fedavg-poisson": dp_fedavg_curve(args, grid),
            "matrix-bandmf": matrix_curve(args, grid, out),
            "ddgauss": ddgauss_curve(args, grid),
        }
    curves = {name: eps for name, (eps, _) in results.items()}
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    with (out / "epsilon.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["rounds", *MECHANISMS])
        for i, rounds in enumerate(grid):
            writer.writerow([rounds, *(repr(curves[m][i]) for m in MECHANISMS)])
    report = {
        "settings": settings,
        "rounds": grid,
        "epsilon": curves,
        "details": {name: details for name, (_, details) in results.items()},
    }
    (out / "epsilon.json").write_text(json.dumps(report, indent=2) + "\n")
    title = (
        f"z = {args.noise_multiplier:g}, N = {args.population}, {args.cohort} per round, "
        f"delta = {args.delta:g}"
    )
    plot(out / "epsilon.png", grid, curves, title)
    for name in MECHANISMS:
        print(f"{name}: epsilon = {curves[name][-1]:.4f} after {grid[-1]} rounds")
    print(f"written: {out / 'epsilon.csv'}, {out / 'epsilon.json'}, {out / 'epsilon.png'}")
    return report


if __name__ == "__main__":
    main()
