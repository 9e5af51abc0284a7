"""The scale study's findings and the cross-check against the authors' code, from stored runs.

Each finding is one paired comparison on the test federation: the per-seed difference of the
final (round-``rounds``) accuracy, its mean and 95 % t interval (:mod:`experiments.paired`),
and what the interval supports ("ahead" / "behind" where it excludes zero, else "level").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.paired import interval, verdict
from experiments.pfedhb import tuning

#: (a, b) pairs of the scale study's findings: pFedHB (both solvers) against each other
#: method, every Bayesian method at its KL weight chosen on validation
COMPARISONS = tuple(
    (tuning.tuned(hb), other)
    for hb in ("pfedhb-adam", "pfedhb-exact")
    for other in (tuning.tuned("pfedvem"), tuning.tuned("pfedbayes"), "fedavg-ft")
)
KEYS = (("personal_acc_mean", "personalised"), ("global_acc", "global"))


def paired(runs: list[dict[str, Any]], federation: str, a: str, b: str, key: str) -> list[float]:
    """``a − b`` per seed both have on ``federation``, final ``key`` in points (× 100)."""
    by = {(r["method"], r["seed"]): r for r in runs if r["federation"] == federation}
    seeds = sorted(s for m, s in by if m == a and (b, s) in by)
    return [100 * (by[(a, s)]["curve"][-1][key] - by[(b, s)]["curve"][-1][key]) for s in seeds]


def span(differences: list[float]) -> str:
    """``+0.62 [+0.51, +0.73] points (n = 5)``: the mean and its 95 % t interval."""
    mean, low, high = interval(differences)
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}] points (n = {len(differences)})"


def supports(runs: list[dict[str, Any]], federation: str, a: str) -> str:
    """One sentence: ``a``'s personalised-accuracy difference to each method it is compared
    with in :data:`COMPARISONS`, with the interval and its verdict."""
    parts = []
    for first, b in COMPARISONS:
        differences = paired(runs, federation, first, b, KEYS[0][0])
        if first == a and len(differences) > 1:
            parts.append(f"against {b} {span(differences)}, {verdict(differences)}")
    return f"{a} on {federation}, personalised accuracy: " + "; ".join(parts) + "."


def scale_findings(runs: list[dict[str, Any]], federation: str) -> str:
    """One line per :data:`COMPARISONS` pair with two or more paired seeds."""
    lines = []
    for a, b in COMPARISONS:
        cells = []
        for key, label in KEYS:
            differences = paired(runs, federation, a, b, key)
            if len(differences) < 2:
                continue
            cells.append(f"{label} {span(differences)}, **{verdict(differences)}**")
        if cells:
            lines.append(f"- **{a} − {b}**: " + "; ".join(cells) + ".")
    return "\n".join(lines)


def plateau(runs: list[dict[str, Any]], federation: str) -> str:
    """How far each reported method's seed-mean accuracy still moves over the last 20 % of
    rounds: from the first evaluation at or after round 0.8 · rounds to the final one."""
    methods = dict.fromkeys(m for pair in COMPARISONS for m in pair)
    cells, start, end = [], None, None
    for method in methods:
        sel = [r for r in runs if r["federation"] == federation and r["method"] == method]
        if not sel:
            continue
        curve = sel[0]["curve"]
        end = curve[-1]["round"]
        i = next(j for j, row in enumerate(curve) if row["round"] >= 0.8 * end)
        start = curve[i]["round"]
        moves = [
            100 * np.mean([r["curve"][-1][key] - r["curve"][i][key] for r in sel])
            for key, _ in KEYS
        ]
        cells.append(f"{method} {moves[0]:+.1f} / {moves[1]:+.1f}")
    if not cells:
        return ""
    return (
        f"\nHow much the models still move on {federation}, round {start} → {end} (the "
        f"last 20 % of rounds; seed-mean personalised / global accuracy, points): "
        + ", ".join(cells)
        + "."
    )


def crosscheck_table(stored: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The reference's run and ours on the same split, at the final round, with the spread
    of our tuned pFedHB-Adam over the reported seeds for scale."""
    final = str(stored["final_round"])
    ours, theirs = stored["ours"], stored["reference"]
    rows = [
        "| run | personalised acc (%) | global acc (%) | CPU s |",
        "|---|---|---|---|",
        f"| ours (`{stored['method']}`, seed {stored['seed']}) | "
        f"{100 * ours['personal_acc'][final]:.1f} | {100 * ours['global_acc'][final]:.1f} | "
        f"{ours['cpu_seconds']:.0f} |",
        f"| reference (`{theirs['repository']}` @ `{theirs['commit']}`) | "
        f"{100 * theirs['personal_acc'][final]:.1f} | {100 * theirs['global_acc'][final]:.1f} | "
        f"{theirs['cpu_seconds']:.0f} |",
    ]
    test = stored["federation"].removesuffix(tuning.VALIDATION)
    tuned = [r for r in runs if r["federation"] == test and r["method"] == "pfedhb-adam-tuned"]
    spread = ""
    if len(tuned) > 1:
        sd = np.std([100 * r["curve"][-1]["personal_acc_mean"] for r in tuned], ddof=1)
        spread = (
            f" For scale: the sample sd (ddof = 1) of pfedhb-adam-tuned's final personalised "
            f"accuracy over its {len(tuned)} reported seeds on {test} is {sd:.1f} points."
        )
    difference = 100 * (ours["personal_acc"][final] - theirs["personal_acc"][final])
    return (
        f"\nThe authors' code on the split of `{stored['federation']}`, seed {stored['seed']}, "
        f"round {final}:\n\n"
        + "\n".join(rows)
        + f"\n\nOurs − reference, personalised accuracy: {difference:+.1f} points (one draw "
        f"each: the runs share the data, not their random draws).{spread}"
    )
