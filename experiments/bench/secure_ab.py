"""Table: secure_scale runs of two trees, alternated, as medians per tree, workload and mode.

Each run (``experiments/bench/secure_scale.py --out``) holds one point per mode at one (C, d),
every ratio taken inside that run (a secure round over the same run's FedAvg round, DMM's over
its DDGauss round). A noisy machine moves whole runs, so the trees run alternately and each
cell is the median over a tree's runs of the per-run value:

    .venv/bin/python experiments/bench/secure_ab.py experiments/bench/secure_ab_v5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

COLUMNS = (
    ("s/round", lambda p: p["summary"]["round_s"], ".2f"),
    ("×FedAvg", lambda p: p.get("ratio_round_s"), ".2f"),
    ("DMM/DDGauss", lambda p: p.get("ratio_vs_ddgauss"), ".2f"),
    ("client s", lambda p: p["summary"]["client_s"], ".1f"),
    ("driver CPU s", lambda p: p["summary"].get("server_cpu_s"), ".2f"),
    ("committee CPU s", lambda p: p["summary"].get("committee_cpu_s"), ".1f"),
)
"""Per point: the column, its value in one run (None: not this mode's), its format."""


def runs(directory: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(workload, tree) -> its runs, from ``<workload>_<tree>_<i>.json`` in ``directory``."""
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*_*_*.json")):
        workload, tree, _ = path.stem.rsplit("_", 2)
        found.setdefault((workload, tree), []).append(json.loads(path.read_text()))
    if not found:
        raise SystemExit(f"{directory}: no <workload>_<tree>_<i>.json runs")
    return found


def cell(values: list[float | None], spec: str) -> str:
    values = [v for v in values if v is not None]
    return format(statistics.median(values), spec) if values else "–"


def table(directory: Path) -> str:
    """One row per (workload, tree, mode): the median over the tree's runs of each column."""
    lines = [
        "| workload | tree | runs | mode | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for (workload, tree), measured in sorted(runs(directory).items(), key=_order):
        for mode in ("fedavg", "ddgauss", "dmm"):
            points = [p for run in measured for p in run["points"] if p["mode"] == mode]
            if not points:
                continue
            cells = [cell([get(p) for p in points], spec) for _, get, spec in COLUMNS]
            head = f"| {workload} | {tree} | {len(points)} | {mode} | "
            lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _order(item) -> tuple[str, int]:
    (workload, tree), _ = item
    return workload, 0 if tree == "before" else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    sys.stdout.write(table(args.directory))


if __name__ == "__main__":
    main()
