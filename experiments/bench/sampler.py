"""Benchmark: the exact discrete Gaussian samplers, old (CKS 2020, vectorised) against new
(table-driven, fedsim.privacy.discrete_gaussian), measured in one run.

For each sigma in ``--sigmas`` (default 0.5, 1, 10, 100, 10^3, 10^4, 10^6) both samplers draw
``--draws`` values (131,072: one DDGauss client's noise at D = 2^17) from a seeded
``numpy.random.Generator``, ``--repeats`` times, old and new interleaved so that both see the
same machine load. Reported per sigma: the median wall seconds and the median CPU seconds of
this process (``time.process_time``: less sensitive to other processes on a shared machine) of
each sampler, their ratios old / new, and the new sampler's first call for that sigma with
an empty table cache (``cold_s``: table built, then the draws; later calls reuse the table).
``float_gaussian_s`` is numpy's ``Generator.normal`` for the same count, for scale. With
``--secure-sigma`` the same comparison in secure mode (``SecureRandom``), fewer repeats.

Prints one line per sigma and writes one JSON object to ``--out``
(default experiments/bench/sampler.json). Run: ``python experiments/bench/sampler.py``;
``--table-only`` prints the markdown table of the stored result (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fedsim.privacy import discrete_gaussian as fast  # noqa: E402
from fedsim.privacy.mechanisms import SecureRandom, cks_discrete_gaussian  # noqa: E402

DEFAULT_SIGMAS = (0.5, 1.0, 10.0, 100.0, 1e3, 1e4, 1e6)


def timed(call) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(sigma: float, draws: int, repeats: int, secure: bool) -> dict:
    """Old and new sampler at one sigma, interleaved; medians and ratios."""

    def source(seed: int):
        return SecureRandom() if secure else np.random.default_rng(seed)

    fast.table.cache_clear()
    cold_wall, _ = timed(lambda: fast.discrete_gaussian(draws, sigma, source(0)))
    cks_discrete_gaussian(draws, sigma, source(0))  # warm the reference too
    times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for r in range(repeats):
        order = (("old", cks_discrete_gaussian), ("new", fast.discrete_gaussian))
        for name, sampler in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(lambda s=sampler, r=r: s(draws, sigma, source(r + 1))))
    row: dict = {"sigma": sigma, "draws": draws, "repeats": repeats, "cold_s": cold_wall}
    for name, pairs in times.items():
        row[f"{name}_wall_s"] = statistics.median(p[0] for p in pairs)
        row[f"{name}_cpu_s"] = statistics.median(p[1] for p in pairs)
        row[f"{name}_wall_all_s"] = [p[0] for p in pairs]
    row["ratio_wall"] = row["old_wall_s"] / row["new_wall_s"]
    row["ratio_cpu"] = row["old_cpu_s"] / row["new_cpu_s"]
    tab = fast.table(Fraction(repr(float(sigma))) ** 2)
    row["table"] = {
        "blocks": tab.blocks,
        "width": tab.width,
        "alias_bits": tab.alias_bits,
        "acceptance": tab.acceptance,
    }
    return row


SIGMA_NAMES = {1e3: "10³", 1e4: "10⁴", 1e5: "10⁵", 1e6: "10⁶"}


def table(result: dict) -> str:
    """The markdown table of a stored result (docs/benchmarks.md quotes it)."""
    lines = [
        "| σ | CKS 2020 | table-driven | ratio | CPU-time ratio |",
        "|---|---|---|---|---|",
    ]
    for label, rows in (("", result["generator"]), (", secure mode", result["secure"])):
        for r in rows:
            sigma = SIGMA_NAMES.get(r["sigma"], f"{r['sigma']:g}")
            lines.append(
                f"| {sigma}{label} | {r['old_wall_s'] * 1e3:.1f} ms | "
                f"{r['new_wall_s'] * 1e3:.1f} ms | {r['ratio_wall']:.1f}× | {r['ratio_cpu']:.1f}× |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sigmas", type=float, nargs="+", default=list(DEFAULT_SIGMAS))
    parser.add_argument("--draws", type=int, default=131_072)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--secure-sigma", type=float, nargs="*", default=[1e3])
    parser.add_argument("--secure-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("sampler.json"))
    parser.add_argument(
        "--table-only", action="store_true", help="print the table of --out; measure nothing"
    )
    args = parser.parse_args()
    if args.table_only:
        print(table(json.loads(args.out.read_text())))
        return

    g = np.random.default_rng(0)
    normal = statistics.median(
        timed(lambda: g.normal(size=args.draws))[0] for _ in range(args.repeats)
    )
    rows, secure_rows = [], []
    print(f"{'sigma':>10} {'old ms':>8} {'new ms':>8} {'ratio':>6} {'cpu ratio':>9} {'cold ms':>8}")
    for label, sigmas, repeats, secure, out in (
        ("generator", args.sigmas, args.repeats, False, rows),
        ("secure", args.secure_sigma, args.secure_repeats, True, secure_rows),
    ):
        for sigma in sigmas:
            row = compare(sigma, args.draws, repeats, secure)
            out.append(row)
            print(
                f"{sigma:>10g} {row['old_wall_s'] * 1e3:>8.2f} {row['new_wall_s'] * 1e3:>8.2f} "
                f"{row['ratio_wall']:>6.1f} {row['ratio_cpu']:>9.1f} {row['cold_s'] * 1e3:>8.2f}"
                f"  {label}"
            )
    result = {
        "benchmark": "exact discrete Gaussian: CKS 2020 (old) vs table-driven (new)",
        "machine": f"{os.cpu_count()}-CPU {platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_average": list(os.getloadavg()),
        "float_gaussian_s": normal,
        "generator": rows,
        "secure": secure_rows,
        "min_ratio_wall": min(r["ratio_wall"] for r in rows),
        "min_ratio_cpu": min(r["ratio_cpu"] for r in rows),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"float Gaussian {normal * 1e3:.2f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()
