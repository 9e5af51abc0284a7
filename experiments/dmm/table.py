"""Tables of the DMM study, from the results :mod:`experiments.dmm.run` stored.

For every setting directory under ``--results`` (default experiments/dmm/results; one per
source, population and rounds) it reads ``setup.json``, the runs (``{method}_eps{e}_seed{s}.json``)
and the full-vs-ideal checks (``check_*.json``) and writes ``tables.md`` next to this script:

* test accuracy, mean ± standard deviation over seeds, per method and epsilon;
* DMM-banded minus DDGauss and minus central BandMF, DMM-tree minus DDGauss and minus the
  central tree, per epsilon: difference of the means ± its standard error
  sqrt(s_a^2 / n_a + s_b^2 / n_b), s^2 the sample variances over seeds (ddof = 1);
* the full mode's cost per round (wall seconds, bytes per client, bytes per committee member sent
  and received, total protocol bytes), mean over the DMM runs;
* the mode checks: DMM full against ideal, DDGauss plaintext against full, same root.

    python experiments/dmm/table.py [--results DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = (
    "non-private",
    "dp-fedavg",
    "ddgauss",
    "central-tree",
    "central-bandmf",
    "dmm-tree",
    "dmm-banded",
)
DIFFERENCES = (
    ("dmm-banded", "ddgauss"),
    ("dmm-banded", "central-bandmf"),
    ("dmm-tree", "ddgauss"),
    ("dmm-tree", "central-tree"),
)
COSTS = (
    ("seconds", "s / round"),
    ("dmm-bytes-per-client", "B / client"),
    ("dmm-bytes-per-member-sent", "B sent / member"),
    ("dmm-bytes-per-member-received", "B received / member"),
    ("dmm-bytes", "protocol B / round"),
)


def load(directory: Path) -> tuple[dict, list[dict], list[dict]]:
    """(setup, runs, checks) stored in one setting directory."""
    setup = json.loads((directory / "setup.json").read_text())
    runs, checks = [], []
    for path in sorted(directory.glob("*.json")):
        if path.name == "setup.json":
            continue
        (checks if path.name.startswith("check_") else runs).append(json.loads(path.read_text()))
    return setup, runs, checks


def _accuracies(runs, method, eps) -> list[float]:
    return [
        r["accuracy"]
        for r in runs
        if r["method"] == method and (eps is None or r["target_epsilon"] == eps)
    ]


def accuracy_table(runs: list[dict], epsilons: list[float]) -> str:
    def cell(values):
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.3f} (n=1)"
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} (n={len(values)})"

    lines = ["| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |"]
    lines.append("|---" * (len(epsilons) + 1) + "|")
    for method in METHODS:
        eps_of = (lambda e: None) if method == "non-private" else (lambda e: e)
        cells = [cell(_accuracies(runs, method, eps_of(e))) for e in epsilons]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difference_table(runs: list[dict], epsilons: list[float]) -> str:
    head = " | ".join(f"{a} − {b}" for a, b in DIFFERENCES)
    lines = [f"| ε | {head} |", "|---" * (len(DIFFERENCES) + 1) + "|"]
    for eps in epsilons:
        cells = []
        for a, b in DIFFERENCES:
            xa, xb = _accuracies(runs, a, eps), _accuracies(runs, b, eps)
            if len(xa) < 2 or len(xb) < 2:
                cells.append("-")
                continue
            se = math.sqrt(statistics.variance(xa) / len(xa) + statistics.variance(xb) / len(xb))
            cells.append(f"{statistics.mean(xa) - statistics.mean(xb):+.3f} ± {se:.3f}")
        lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(runs: list[dict]) -> str:
    lines = ["| method | runs | " + " | ".join(label for _, label in COSTS) + " |"]
    lines.append("|---" * (len(COSTS) + 2) + "|")
    for method in ("dmm-banded", "dmm-tree"):
        mine = [r for r in runs if r["method"] == method and r.get("mode") == "full"]
        if not mine:
            continue
        cells = []
        for key, _ in COSTS:
            values = [r["cost_per_round"][key] for r in mine if key in r.get("cost_per_round", {})]
            cells.append(f"{statistics.mean(values):,.1f}" if values else "-")
        lines.append(f"| {method} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks_table(checks: list[dict]) -> str:
    if not checks:
        return "(no mode checks stored)"
    lines = ["| method | ε | seed | modes | bit-identical | seconds |", "|---" * 6 + "|"]
    for c in checks:
        lines.append(
            f"| {c['method']} | {c['target_epsilon']:g} | {c['seed']} | "
            f"{' vs '.join(c['modes'])} | {c['identical']} | "
            f"{' / '.join(f'{x:.0f}' for x in c['seconds'])} |"
        )
    return "\n".join(lines)


def section(directory: Path) -> str:
    setup, runs, checks = load(directory)
    epsilons = sorted({r["target_epsilon"] for r in runs if r["target_epsilon"] is not None})
    title = (
        f"## {setup['source']}: {setup['clients']} clients, {setup['per_round']} per round, "
        f"{setup['rounds']} rounds, {setup['min_separation']}-min-separation"
    )
    return "\n\n".join(
        [
            title,
            "Test accuracy (mean ± sample std over seeds, ddof = 1):",
            accuracy_table(runs, epsilons),
            "Differences of mean accuracy ± the standard error of that difference, "
            "sqrt(s_a²/n_a + s_b²/n_b) with sample variances (ddof = 1) over seeds:",
            difference_table(runs, epsilons),
            "DMM full-mode cost per round (committee actors):",
            cost_table(runs),
            "Mode checks (the same run in the other mode, same root):",
            checks_table(checks),
        ]
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE / "tables.md")
    args = parser.parse_args(argv)
    settings = sorted(p for p in args.results.iterdir() if (p / "setup.json").is_file())
    if not settings:
        raise SystemExit(f"--results {args.results}: no stored study (setup.json) found")
    text = "# DMM study tables (generated by experiments/dmm/table.py)\n\n"
    text += "\n\n".join(section(p) for p in settings) + "\n"
    args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
