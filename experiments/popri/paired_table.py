"""Paired differences between the POPri study's rows over its seeds, with 95 % intervals.

Each replicate (a seed: ``runs/<name>``, ``runs/<name>-seed<S>``) gives every row one
accuracy per report; a comparison ``A − B`` pairs the two rows' accuracies by replicate and
reports the mean difference in points with its 95 % t interval and verdict
(:mod:`experiments.paired`). Two reports, each named as in :mod:`experiments.popri.epochs`:
``fixed schedule`` (the last epoch / round) and ``best epoch (paper)`` (the best epoch / round
on the evaluation texts). The rows come from the stored files only:

* POPri, PE, base generator: ``OUT/epochs/results.json`` (:mod:`experiments.popri.epochs`);
* tuned DP-FedAvg: ``OUT/tuned/results.json`` (:mod:`experiments.popri.tuned_dp_fedavg`);
* fully private: ``OUT/stages/public.json`` (no fine-tune: one value for every report).

    python experiments/popri/paired_table.py experiments/popri/configs/cpu-all.toml \\
        --replicates experiments/popri/runs/cpu-all-seed1 experiments/popri/runs/cpu-all-seed2

Writes ``OUT/paired.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from experiments.paired import interval, verdict  # noqa: E402
from experiments.popri.run import config_and_out, eps_key  # noqa: E402

REPORTS = ("fixed schedule", "best epoch (paper)")
ROWS = {
    "POPri": "popri",
    "Private Evolution": "pe",
    "base generator": "base",
    "DP-FedAvg (tuned)": "dp-fedavg-tuned",
    "fully private": "public",
}
COMPARISONS = (
    ("POPri", "base generator"),
    ("POPri", "Private Evolution"),
    ("POPri", "DP-FedAvg (tuned)"),
    ("POPri", "fully private"),
    ("Private Evolution", "fully private"),
    ("DP-FedAvg (tuned)", "fully private"),
)


def row_accuracy(out: Path, row: str, epsilon: str, report: str) -> float:
    """Evaluation accuracy of ``row`` (a key of :data:`ROWS`) at ``epsilon`` under ``report``
    in replicate ``out``, from its stored files."""
    stage = ROWS[row]
    if stage == "public":
        return json.loads((out / "stages" / "public.json").read_text())["accuracy"]
    if stage == "dp-fedavg-tuned":
        tuned = json.loads((out / "tuned" / "results.json").read_text())
        return tuned[epsilon][report]["accuracy"]
    epochs = json.loads((out / "epochs" / "results.json").read_text())["stages"]
    name = stage if stage == "base" else f"{stage}-eps{epsilon}"
    return epochs[name][report]["test"]


def paired_results(epsilons: list[str], outs: list[Path]) -> list[dict[str, Any]]:
    """One entry per comparison, report and epsilon: the per-replicate differences (points),
    their mean, 95 % interval and verdict."""
    found = []
    for first, second in COMPARISONS:
        for report in REPORTS:
            for epsilon in epsilons:

                def accuracy(out: Path, row: str) -> float:
                    return row_accuracy(out, row, epsilon, report)  # noqa: B023

                diffs = [
                    100 * (accuracy(o, first) - accuracy(o, second))
                    for o in outs
                ]
                mean, low, high = interval(diffs)
                found.append(
                    {
                        "comparison": f"{first} − {second}",
                        "report": report,
                        "epsilon": epsilon,
                        "differences": diffs,
                        "mean": mean,
                        "low": low,
                        "high": high,
                        "verdict": verdict(diffs),
                    }
                )
    return found


def table(epsilons: list[str], results: list[dict[str, Any]]) -> str:
    """The markdown table: one row per comparison and report, one column per epsilon."""
    lines = ["| comparison | report | " + " | ".join(f"ε = {e}" for e in epsilons) + " |"]
    lines.append("|---" * (len(epsilons) + 2) + "|")
    cells: dict[tuple[str, str], list[str]] = {}
    for r in results:
        text = f"{_signed(r['mean'])} [{_signed(r['low'])}, {_signed(r['high'])}] {r['verdict']}"
        cells.setdefault((r["comparison"], r["report"]), []).append(text)
    for (comparison, report), row in cells.items():
        lines.append(f"| {comparison} | {report} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _signed(value: float) -> str:
    return f"{value:+.2f}".replace("-", "−")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=None, help="override the config's seed")
    parser.add_argument(
        "--replicates", type=Path, nargs="+", required=True, help="the other seeds' folders"
    )
    args = parser.parse_args(argv)
    config, out = config_and_out(args)
    epsilons = [eps_key(e) for e in config.epsilons]
    results = paired_results(epsilons, [out, *args.replicates])
    replicates = [str(p.name) for p in (out, *args.replicates)]
    data = {"replicates": replicates, "unit": "accuracy points", "comparisons": results}
    (out / "paired.json").write_text(json.dumps(data, indent=1) + "\n")
    text = table(epsilons, results)
    print(text)
    return text


if __name__ == "__main__":
    main()
