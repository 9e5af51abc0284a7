"""Synthetic checks at study scale: QODA on min-max games, R-AdaZO vs ZO-AdaMM on a quadratic.

QODA: a 6x6 game split over 4 workers (``LinearGame.random``, seed 1), bilinear (mu 0) and
strongly monotone (mu 0.2), 2000 exchanges, lr 2, exact (32-bit) uploads or layer-wise
quantised ones at 8 / 4 / 2 bits; relative distance of the last and the averaged iterate
to the equilibrium, and the bits each worker sent. Plain dual averaging (no optimism)
is the control.

Zeroth order: f(x) = |x|^2 / 2 in 10 dimensions from x = 1 (f = 5), 500 steps, q = 2,
mu 5e-3, default betas, mean over 5 generator seeds, at four learning rates.

Writes ``synthetic.json`` next to this file and prints the README's tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedsim.workloads.compression import Quantization  # noqa: E402
from fedsim.workloads.minmax import LinearGame, qoda  # noqa: E402
from fedsim.workloads.optim import RAdaZO, ZOAdaMM  # noqa: E402


def distance(point, target):
    return float(np.sqrt(sum(np.sum((point[k] - target[k]) ** 2) for k in target)))


def qoda_table():
    rows = []
    for mu in (0.0, 0.2):
        game = LinearGame.random(np.random.default_rng(1), 6, 6, 4, mu=mu)
        star = game.equilibrium()
        start = {"x": np.zeros(6), "y": np.zeros(6)}
        d0 = distance(start, star)
        operators = [game.operator(k) for k in range(4)]
        for label, bits, optimistic in (
            ("DA, exact", None, False),
            ("QODA, exact", None, True),
            ("QODA, 8-bit", 8, True),
            ("QODA, 4-bit", 4, True),
            ("QODA, 2-bit", 2, True),
        ):
            result = qoda(
                operators,
                start,
                2000,
                lr=2.0,
                quantization=None if bits is None else Quantization(bits=bits),
                rng=np.random.default_rng(0),
                optimistic=optimistic,
            )
            rows.append(
                {
                    "mu": mu,
                    "method": label,
                    "last": distance(result.last, star) / d0,
                    "average": distance(result.average, star) / d0,
                    "kbit_per_worker": result.bits_per_worker / 1e3,
                }
            )
    return rows


def zo_loss(cls, lr, seed, steps=500, dim=10):
    x = torch.nn.Parameter(torch.ones(dim, dtype=torch.float64))
    optimizer = cls([x], generator=torch.Generator().manual_seed(seed), lr=lr)
    for _ in range(steps):
        optimizer.step(lambda: 0.5 * (x * x).sum())
    return 0.5 * float((x.detach() ** 2).sum())


def zo_table():
    return [
        {
            "lr": lr,
            "r_adazo": float(np.mean([zo_loss(RAdaZO, lr, s) for s in range(5)])),
            "zo_adamm": float(np.mean([zo_loss(ZOAdaMM, lr, s) for s in range(5)])),
        }
        for lr in (1e-4, 1e-3, 1e-2, 1e-1)
    ]


def main() -> None:
    results = {"qoda": qoda_table(), "zeroth_order": zo_table()}
    Path(__file__).with_name("synthetic.json").write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)


def print_tables(results: dict) -> None:
    print("| game | method | last / d0 | average / d0 | kbit per worker |")
    print("|---|---|---|---|---|")
    for r in results["qoda"]:
        game = "bilinear" if r["mu"] == 0 else f"mu = {r['mu']}"
        print(
            f"| {game} | {r['method']} | {r['last']:.2e} | {r['average']:.2e} "
            f"| {r['kbit_per_worker']:.0f} |"
        )
    print()
    print("| lr | R-AdaZO f | ZO-AdaMM f |")
    print("|---|---|---|")
    for r in results["zeroth_order"]:
        print(f"| {r['lr']:g} | {r['r_adazo']:.3g} | {r['zo_adamm']:.3g} |")

if __name__ == "__main__":
    if "--tables" in sys.argv[1:]:  # from synthetic.json, nothing run
        print_tables(json.loads(Path(__file__).with_name("synthetic.json").read_text()))
    else:
        main()
