"""The scale study's KL weights, chosen on validation rows only.

Every Bayesian method has one KL weight to choose: pFedBayes's ζ (the weight of
KL(q_i ‖ w_i)) and, for pFedHB (both solvers) and pFedVEM, the head's KL to its prior
(``personal.head_kl``; 1 in the reference code). Each value of :data:`GRID` runs as its own
method (``<method>-z<ζ>`` / ``<method>-kl<w>``) on the *validation* federation
(``<federation>-validation``: the same training rows, each client tested on the
validation pool's rows of its classes; :mod:`fedsim.data.class_pool`) under the tuning seeds
:data:`TUNING_SEEDS`, which no reported run uses. ``<method>-tuned`` is then the value with the
highest mean final personalised accuracy on those runs (ties: the earlier value of the grid),
run on the test federation under the reported seeds. No test row enters the choice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

#: method -> (its [personal] key, the values tried)
GRID: dict[str, tuple[str, tuple[float, ...]]] = {
    "pfedbayes": ("zeta", (10.0, 1.0, 0.1, 0.01, 0.001)),
    "pfedhb-adam": ("head_kl", (1.0, 0.1, 0.01, 0.001)),
    "pfedhb-exact": ("head_kl", (1.0, 0.1, 0.01, 0.001)),
    "pfedvem": ("head_kl", (1.0, 0.1, 0.01, 0.001)),
}
TUNING_SEEDS = (100,)
VALIDATION = "-validation"
SUFFIX = {"zeta": "z", "head_kl": "kl"}


def variant(method: str, value: float) -> str:
    """The grid point's method name, e.g. ``pfedbayes-z0.1``."""
    return f"{method}-{SUFFIX[GRID[method][0]]}{value:g}"


def variants() -> dict[str, tuple[str, str, float]]:
    """Every grid point's name -> (its method, the [personal] key, the value)."""
    return {variant(m, v): (m, key, v) for m, (key, values) in GRID.items() for v in values}


def tuned(method: str) -> str:
    return f"{method}-tuned"


def validation_scores(runs: list[dict[str, Any]], federation: str, method: str) -> list[dict]:
    """Per grid value of ``method``: the tuning runs' mean final personalised accuracy on
    ``federation``'s validation rows (None while a tuning seed is missing)."""
    key, values = GRID[method]
    rows = []
    for value in values:
        name = variant(method, value)
        accs = [
            float(r["curve"][-1]["personal_acc_mean"])
            for r in runs
            if r["federation"] == federation + VALIDATION
            and r["method"] == name
            and r["seed"] in TUNING_SEEDS
        ]
        done = len(accs) == len(TUNING_SEEDS)
        rows.append({"method": name, key: value, "validation_acc": np.mean(accs) if done else None})
    return rows


def choose(runs: list[dict[str, Any]], federation: str, method: str) -> float:
    """The grid value of ``method`` with the best mean validation accuracy on
    ``federation``; a ValueError naming the missing runs until every one is stored."""
    scores = validation_scores(runs, federation, method)
    missing = [s["method"] for s in scores if s["validation_acc"] is None]
    if missing:
        raise ValueError(
            f"{tuned(method)} on {federation}: the tuning runs {missing} on "
            f"{federation + VALIDATION} (seeds {list(TUNING_SEEDS)}) are not all stored; "
            f"run them first (study.py scale)"
        )
    best = max(range(len(scores)), key=lambda i: (scores[i]["validation_acc"], -i))
    return float(scores[best][GRID[method][0]])


def load(runs_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]


def table(runs: list[dict[str, Any]], federation: str) -> list[str]:
    """Markdown lines: every grid value's validation accuracy and the chosen value."""
    width = max(len(values) for _, values in GRID.values())
    lines = [
        f"\nKL weights on **{federation}**, chosen on its validation rows (tuning seeds "
        f"{', '.join(map(str, TUNING_SEEDS))}; final personalised accuracy, %):\n",
        "| method | key | "
        + " | ".join("value " + str(i + 1) for i in range(width))
        + " | chosen |",
        "|---" * (width + 3) + "|",
    ]
    for method, (key, _) in GRID.items():
        scores = validation_scores(runs, federation, method)
        try:
            chosen = f"{choose(runs, federation, method):g}"
        except ValueError:
            chosen = "(runs missing)"
        cells = [f"{s[key]:g}: " + _percent(s["validation_acc"]) for s in scores]
        cells += [""] * (width - len(cells))
        lines.append(f"| {method} | {key} | " + " | ".join(cells) + f" | {chosen} |")
    return lines


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"
