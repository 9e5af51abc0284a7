"""Summaries, fits, ratios, the plot, the merge and the Markdown table of
``experiments/bench/secure_scale.py``'s measurements (medians over measured rounds)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
from pathlib import Path
from typing import Any

import numpy as np


# ----------------------------------------------------------------------------- per round
class Rounds:
    """Per-round totals of the grid's phase reports (a :class:`PhaseObserver`)."""

    def __init__(self) -> None:
        self.phases: dict[int, dict[str, float]] = {}
        self.train_nodes: dict[int, set[int]] = {}  # per round: who got a train instruction
        self.lock = threading.Lock()

    def phase_finished(self, report) -> None:
        with self.lock:
            row = self.phases.setdefault(
                report.server_round or 0,
                {"client_s": 0.0, "bytes_up": 0, "bytes_down": 0, "exchanges": 0, "failed": 0},
            )
            row["client_s"] += report.compute_s
            kind = report.message_type.removeprefix("query.")
            if kind == "train":
                self.train_nodes.setdefault(report.server_round or 0, set()).update(report.nodes)
            row[f"client_s.{kind}"] = row.get(f"client_s.{kind}", 0.0) + report.compute_s
            row[f"wall_s.{kind}"] = row.get(f"wall_s.{kind}", 0.0) + report.wall_s
            row["bytes_up"] += report.bytes_up
            row["bytes_down"] += report.bytes_down
            row["exchanges"] += 1
            row["failed"] += report.failed + report.dropped

    def attach(self, row: dict[str, Any], cohort: int, training: dict | None) -> None:
        """Add round ``row["round"]``'s client seconds (total and by exchange; with
        ``training``, the clients' own training seconds per round: ``train_s``, ``train_calls``
        and ``secure_s`` = ``client_s`` - ``train_s``), exchanges and bytes per cohort client
        to ``row``."""
        phases = self.phases.get(row["round"], {})
        row["client_s"] = phases.get("client_s", 0.0)
        if training is not None:
            trained = training.get(row["round"], {"train_s": 0.0, "train_calls": 0})
            row.update(trained, secure_s=row["client_s"] - trained["train_s"])
        row["by_exchange"] = {
            k: v for k, v in phases.items() if k.startswith(("client_s.", "wall_s."))
        }
        row["exchanges"] = phases.get("exchanges", 0)
        row["bytes_up_per_client"] = phases.get("bytes_up", 0) / cohort
        row["bytes_down_per_client"] = phases.get("bytes_down", 0) / cohort


# ----------------------------------------------------------------------------- summaries
_PER_ROUND = (
    "round_s",
    "client_s",
    "train_s",
    "secure_s",
    "train_calls",
    "server_cpu_s",
    "bytes_up_per_client",
    "bytes_down_per_client",
    "global_change_l2",
)
"""Per-round values whose median a summary holds (``train_s``, ``secure_s``, ``train_calls``:
workloads that train, else None)."""
_COMMITTEE = ("committee_cpu_s", "bytes_per_member")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every measured round of every repetition; the largest memory peaks."""
    rounds = [row for run in runs for row in run["rounds"]]
    out: dict[str, Any] = {"measured_rounds": len(rounds)}
    for key in (*_PER_ROUND, *_COMMITTEE):
        values = [row[key] for row in rounds if row.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    exchanges = sorted({k for row in rounds for k in row.get("by_exchange", {})})
    out["by_exchange"] = {
        k: statistics.median(row["by_exchange"].get(k, 0.0) for row in rounds) for k in exchanges
    }
    survivors = [row["survivors"] for row in rounds if row.get("survivors") is not None]
    out["median_survivors"] = statistics.median(survivors) if survivors else None
    out["aborted_rounds"] = sum(int(row.get("aborted") or 0) for row in rounds)
    peaks = [run["peak_rss_mb"] for run in runs]
    out["peak_rss_mb"] = {
        "driver": max(p["driver"] for p in peaks),
        "workers": [max(w) for w in zip(*(p["workers"] for p in peaks))],
        "total": max(p["total"] for p in peaks),
    }
    out["clients_with_state"] = max(run["clients_with_state"] for run in runs)
    out["per_round"] = [run["rounds"] for run in runs]
    return out


def fit_exponent(cohorts: list[int], seconds: list[float]) -> float | None:
    """a in t = b * C^a, least squares on log t against log C (None below two cohorts)."""
    if len(set(cohorts)) < 2:
        return None
    slope, _ = np.polyfit(np.log(cohorts), np.log(seconds), 1)
    return float(slope)


def exponents(points: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The fitted exponent of round time against cohort, per mode and d."""
    out: dict[str, dict[str, float | None]] = {}
    for mode in sorted({p["mode"] for p in points}):
        for dim in sorted({p["dim"] for p in points}):
            rows = sorted(
                (p["cohort"], p["summary"]["round_s"])
                for p in points
                if p["mode"] == mode and p["dim"] == dim
            )
            if rows:
                out.setdefault(mode, {})[str(dim)] = fit_exponent(*map(list, zip(*rows)))
    return out


def plot(points: list[dict[str, Any]], fits: dict, path: Path) -> None:
    """Seconds per round against cohort size, log-log, one line per mode and d."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    styles = {"fedavg": "o-", "ddgauss": "s-", "dmm": "^-", "dmm-unfolded": "v--"}
    for mode in sorted({p["mode"] for p in points}):
        for dim in sorted({p["dim"] for p in points}):
            rows = sorted(
                (p["cohort"], p["summary"]["round_s"])
                for p in points
                if p["mode"] == mode and p["dim"] == dim
            )
            if not rows:
                continue
            exponent = fits.get(mode, {}).get(str(dim))
            label = f"{mode}, d = {dim:.0e}" + (
                f" (t ∝ C^{exponent:.2f})" if exponent is not None else ""
            )
            ax.plot(*zip(*rows), styles.get(mode, "x-"), label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round C")
    ax.set_ylabel("seconds per round (median)")
    ax.set_title("Secure aggregation at scale: time per round (2 workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each secure point's round time over FedAvg's at the same (C, d), and each DMM point's
    over DDGauss's (``dmm/ddgauss``), keyed for reading."""
    out = {
        f"{r['mode']} C={r['cohort']} d={r['dim']}": r["ratio_round_s"]
        for r in rows
        if r["mode"] != "fedavg"
    }
    for r in rows:
        if r.get("ratio_vs_ddgauss") is not None:
            out[f"{r['mode']}/ddgauss C={r['cohort']} d={r['dim']}"] = r["ratio_vs_ddgauss"]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Set each row's ``ratio_round_s`` (over FedAvg's median round at its (C, d)) and, for
    DMM rows, ``ratio_vs_ddgauss`` (over DDGauss's); None where the reference is missing."""

    def reference(mode: str, row: dict[str, Any]) -> float | None:
        found = [
            r["summary"]["round_s"]
            for r in rows
            if r["mode"] == mode and (r["cohort"], r["dim"]) == (row["cohort"], row["dim"])
        ]
        return found[0] if found else None

    for row in rows:
        fedavg, ddgauss = reference("fedavg", row), reference("ddgauss", row)
        mine = row["summary"]["round_s"]
        row["ratio_round_s"] = mine / fedavg if fedavg else None
        if row["mode"].startswith("dmm"):
            row["ratio_vs_ddgauss"] = mine / ddgauss if ddgauss else None


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}"


def markdown(result: dict[str, Any]) -> str:
    """The table of ``result`` (medians per point), generated from the JSON: one row per
    (cohort, mode), with the load average each point saw."""
    settings = result.get("settings", {})
    title = f"# Secure aggregation against FedAvg: workload `{settings.get('workload')}`\n\n"
    head = title + (
        f"Workload `{settings.get('workload', 'synthetic')}`, {settings.get('population'):,} "
        f"registered clients, {settings.get('warmup')} warm-up + {settings.get('rounds')} "
        f"measured rounds per point, {settings.get('workers')} workers, dropout "
        f"{settings.get('dropout')}, DDGauss's mask PRG {settings.get('prg', 'chacha20')}, "
        f"{result.get('cpu_count')} CPUs. Medians over the measured "
        "rounds; `train s` and `secure s` split `client s` (seconds inside the ClientApps, "
        "summed over the cohort) into the clients' training and the rest (encoding, noise, "
        "masking, sharing, sealing, the protocol's further exchanges).\n\n"
    )
    columns = (
        "| C | mode | s/round | ×FedAvg | DMM/DDGauss | client s | train s | secure s | "
        "B up/client | B down/client | load avg (1 min) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in sorted(result["points"], key=lambda r: (r["dim"], r["cohort"])):
        s = row["summary"]
        load = row.get("load_average") or [None]
        lines.append(
            f"| {row['cohort']} | {row['mode']} | {_cell(s['round_s'])} | "
            f"{_cell(row.get('ratio_round_s'))}× | {_cell(row.get('ratio_vs_ddgauss'))} | "
            f"{_cell(s['client_s'])} | {_cell(s.get('train_s'))} | {_cell(s.get('secure_s'))} | "
            f"{_cell(s['bytes_up_per_client'])} | {_cell(s['bytes_down_per_client'])} | "
            f"{_cell(load[0])} |"
        )
    return head + columns + "\n".join(lines) + "\n"


def merge(paths: list[Path], out: Path | None, plot_path: Path | None) -> dict[str, Any]:
    """One result from several runs' JSON: their points (a later run's point replaces an
    earlier one at the same mode, cohort, d and population), each run's settings, the
    exponents refitted over all points, and the first memory sweep found."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    points: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        for row in run["points"]:
            row = {"settings": run.get("settings"), **row}  # a merged run's rows keep theirs
            points[(row["mode"], row["cohort"], row["dim"], row["population"])] = row
    rows = sorted(points.values(), key=lambda r: (r["dim"], r["cohort"], r["mode"] != "fedavg"))
    result = {
        "merged_from": [str(p) for p in paths],
        "cpu_count": os.cpu_count(),
        "points": rows,
        "exponents": exponents(rows),
        "ratios": _ratios(rows),
    }
    sweeps = [run["population_sweep"] for run in runs if "population_sweep" in run]
    if sweeps:
        result["population_sweep"] = sweeps[0]
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    if plot_path is not None:
        plot(rows, result["exponents"], plot_path)
    return result


def _population_sweep(sweep: list[Any], runs: dict[Any, list[dict]]) -> dict[str, Any]:
    """Per mode: round time and peak memory at each population, and largest / smallest."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(p.mode for p in sweep):
        mine = sorted((p for p in sweep if p.mode == mode), key=lambda p: p.population)
        table = {str(p.population): summarise(runs[p]) for p in mine}
        small, large = table[str(mine[0].population)], table[str(mine[-1].population)]
        out[mode] = {
            "cohort": mine[0].cohort,
            "dim": mine[0].dim,
            "populations": {
                n: {"round_s": s["round_s"], "peak_rss_mb": s["peak_rss_mb"]}
                for n, s in table.items()
            },
            "ratio_round_s": large["round_s"] / small["round_s"],
            "ratio_total_peak_rss": large["peak_rss_mb"]["total"] / small["peak_rss_mb"]["total"],
        }
    return out


def report(
    args: argparse.Namespace, points: list[Any], sweep: list[Any], runs: dict[Any, list]
) -> dict[str, Any]:
    """The JSON of the points measured so far (a mode's ratio once FedAvg's point is in)."""
    rows = [
        {**{k: getattr(p, k) for k in ("mode", "cohort", "dim", "population")},
         "summary": summarise(runs[p])}
        for p in points
        if runs[p]
    ]  # fmt: skip
    for row, p in zip(rows, [p for p in points if runs[p]], strict=True):
        row["load_average"] = runs[p][0]["load_average"]["before"]  # 1, 5, 15 min
        row["load_average_after"] = runs[p][-1]["load_average"]["after"]
    add_ratios(rows)
    result = {
        "settings": {
            k: getattr(args, k)
            for k in (
                "population",
                "rounds",
                "warmup",
                "repeats",
                "workers",
                "dropout",
                "secagg_degree",
                "ring_bits",
                "noise_multiplier",
                "seed",
                "state_memory_mb",
                "workload",
                "prg",
            )
        },  # fmt: skip
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),  # at this report; each point has its own
        "points": rows,
        "exponents": exponents(rows),
        "ratios": _ratios(rows),
    }
    if args.workload == "lenet":
        result["settings"].update(writers=args.writers, rows_per_writer=args.rows_per_writer)
    done = [p for p in sweep if runs[p]]
    if done:
        result["population_sweep"] = _population_sweep(done, runs)
    return result
