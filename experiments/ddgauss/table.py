"""The README's table of the DDGauss digits run, from the stored ``results.json``.

    python experiments/ddgauss/table.py     # rewrites the table between the README's markers

Standard library only (``run.py`` writes ``results.json`` and then calls this).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- ddgauss-table:begin -->", "<!-- ddgauss-table:end -->"


def table(results: dict) -> str:
    """One row per round: survivors, epsilon and test accuracy without and with dropout."""
    lines = [
        "| round | survivors (0 %) | eps (0 %) | acc (0 %) | survivors (10 %) | eps (10 %) "
        "| acc (10 %) |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(results["full_dropout0.0"]["rounds"], results["full_dropout0.1"]["rounds"]):
        lines.append(
            f"| {a['round']} | {a['survivors']} | {a['epsilon']:.3f} | {a['accuracy']:.3f} | "
            f"{b['survivors']} | {b['epsilon']:.3f} | {b['accuracy']:.3f} |"
        )
    return "\n".join(lines)


def write_readme(results: dict, readme: Path = HERE / "README.md") -> None:
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


if __name__ == "__main__":
    write_readme(json.loads((HERE / "results.json").read_text()))
