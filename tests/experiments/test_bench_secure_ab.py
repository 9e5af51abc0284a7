"""experiments/bench/secure_ab.py: each cell is the median over a tree's runs of the value each
run computed itself (a ratio inside its own run), never a ratio of medians."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.bench.secure_ab import table  # noqa: E402


def _run(fedavg: float, ddgauss: float, dmm: float) -> dict:
    def point(mode, seconds, **extra):
        summary = {"round_s": seconds, "client_s": 10 * seconds, "server_cpu_s": seconds / 4}
        summary["committee_cpu_s"] = seconds / 2 if mode == "dmm" else None
        return {"mode": mode, "summary": summary, "ratio_round_s": seconds / fedavg, **extra}

    return {
        "points": [
            point("fedavg", fedavg),
            point("ddgauss", ddgauss),
            point("dmm", dmm, ratio_vs_ddgauss=dmm / ddgauss),
        ]
    }


def test_cells_are_medians_of_each_runs_own_values(tmp_path):
    runs = {"before": [(1, 10, 30), (2, 12, 30), (4, 30, 70)], "after": [(1, 5, 10)]}
    for tree, values in runs.items():
        for i, (fedavg, ddgauss, dmm) in enumerate(values, 1):
            path = tmp_path / f"syn_{tree}_{i}.json"
            path.write_text(json.dumps(_run(fedavg, ddgauss, dmm)))
    rows = {
        tuple(cells[1:5]): cells[5:]
        for line in table(tmp_path).splitlines()[2:]
        for cells in [[c.strip() for c in line.split("|")]]
    }
    assert list(rows)[0] == ("syn", "before", "3", "fedavg")  # before first, in mode order
    before = rows[("syn", "before", "3", "ddgauss")]
    assert before[0] == "12.00"  # median of 10, 12, 30
    assert before[1] == "7.50"  # median of 10/1, 12/2, 30/4 (the medians' ratio is 6)
    dmm = rows[("syn", "before", "3", "dmm")]
    assert dmm[1] == "17.50" and dmm[2] == "2.50"  # of 30, 15, 17.5 and of 3, 2.5, 2.33
    assert dmm[5] == "15.0" and before[5] == "–"  # committee CPU only where DMM ran
    assert rows[("syn", "after", "1", "dmm")][2] == "2.00"


def test_a_directory_without_runs_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no <workload>_<tree>_<i>.json runs"):
        table(tmp_path)
