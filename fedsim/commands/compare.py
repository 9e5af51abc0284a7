"""``fedsim compare RUN_DIR... [--json]``: runs side by side in the terminal.

Three tables: per run its rounds, final epsilon and delta (the run's, and with DP-SGD clients
the largest a client reports), seconds and bytes; per metric (:mod:`fedsim.run_series`) each
run's final value and best value, with the round of each (best = the largest for
accuracy-like metrics, the smallest for loss-like ones; the table says which, and gives no
best for other metrics); and the config keys whose values differ between the runs, with each
run's value (or "unknown" for runs whose config is not there: never "none" by default).
Damaged run files are refused by name and line (:func:`fedsim.run_series.load_run`). A
terminal gets rich tables; a pipe or file plain text; ``--json`` the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from fedsim.config import ConfigError
from fedsim.results_json import dumps
from fedsim.run_series import (
    ABSENT,
    COSTS,
    EPSILONS,
    RunSeries,
    as_number,
    best_is,
    config_differences,
    format_value,
    load_runs,
    metric_names,
    run_labels,
    run_names,
)

MISSING = "-"


def run_facts(run: RunSeries) -> dict[str, Any]:
    """A run's totals: its last round, final epsilons and deltas, seconds and bytes.

    ``seconds_rounds`` and the bytes add up the rounds' lines (rounds >= 1);
    ``seconds_total`` is summary.json's (set-up and rounds of the invocation that finished
    the run; None while it has not finished)."""
    totals = {key: sum(run.series[key].values) if key in run.series else 0 for key in COSTS}
    seconds = (run.summary or {}).get("seconds")
    return {
        "rounds": run.records[-1]["round"],
        "epsilon": run.final("privacy/epsilon"),
        "delta": run.delta("privacy/epsilon"),
        "client_max_epsilon": run.final("client_privacy/max_epsilon"),
        "client_delta": run.delta("client_privacy/max_epsilon"),
        "seconds_rounds": totals["seconds"],
        "seconds_total": as_number(seconds.get("total")) if isinstance(seconds, dict) else None,
        "bytes_up": int(totals["bytes_up"]),
        "bytes_down": int(totals["bytes_down"]),
    }


def metric_rows(runs: Sequence[RunSeries]) -> list[dict[str, Any]]:
    """Per metric (not the costs or epsilons, which :func:`run_facts` totals): each run's
    final and best value with their rounds (None where a run did not record it)."""
    rows = []
    for metric in metric_names(runs):
        if metric in COSTS or metric in EPSILONS:
            continue
        direction = best_is(metric)
        cells: list[dict[str, Any] | None] = []
        for run in runs:
            series = run.series.get(metric)
            if series is None:
                cells.append(None)
                continue
            final_round, final = series.final
            best_round, best = series.best(direction) if direction else (None, None)
            cells.append(
                {"final": final, "final_round": final_round, "best": best, "best_round": best_round}
            )
        rows.append({"metric": metric, "best_is": direction, "runs": cells})
    return rows


def compare_runs(runs: Sequence[RunSeries]) -> dict[str, Any]:
    """What ``fedsim compare`` shows, as JSON-ready data."""
    names, labels = run_names(runs), run_labels(runs)
    differences = config_differences(runs)
    return {
        "runs": [
            {"name": name, "path": str(run.path), "label": label, **run_facts(run)}
            for name, label, run in zip(names, labels, runs)
        ],
        "metrics": metric_rows(runs),
        "config_differences": [
            {
                "key": key,
                "values": {n: v for n, v in zip(names, values) if v is not ABSENT},
            }
            for key, values in differences.items()
        ],
        # runs whose config could not be read: their differences are unknown, not none
        "config_missing": [name for name, run in zip(names, runs) if not run.config],
    }


Table = tuple[str, list[str], list[list[str]]]


def tables(result: dict[str, Any]) -> list[Table]:
    """The three tables (title, header, rows) of a :func:`compare_runs` result."""
    names = [r["name"] for r in result["runs"]]
    facts = [
        ("rounds", "rounds", "{:d}"),
        ("epsilon", "epsilon", "{:.4g}"),
        ("delta", "delta", "{:g}"),
        ("client max epsilon", "client_max_epsilon", "{:.4g}"),
        ("client delta", "client_delta", "{:g}"),
        ("seconds (rounds)", "seconds_rounds", "{:.2f}"),
        ("seconds (total)", "seconds_total", "{:.2f}"),
        ("bytes up", "bytes_up", "{:,d}"),
        ("bytes down", "bytes_down", "{:,d}"),
    ]
    run_rows = [
        [title, *(_cell(r[key], fmt) for r in result["runs"])]
        for title, key, fmt in facts
        if any(r[key] is not None for r in result["runs"])
    ]
    header = ["metric", "best is"]
    for name in names:
        header += [f"{name} final", f"{name} best"]
    metric_table = []
    for row in result["metrics"]:
        cells = [row["metric"], row["best_is"] or MISSING]
        for cell in row["runs"]:
            if cell is None:
                cells += [MISSING, MISSING]
            else:
                cells.append(_at(cell["final"], cell["final_round"]))
                best = cell["best"]
                cells.append(MISSING if best is None else _at(best, cell["best_round"]))
        metric_table.append(cells)
    config_rows = [
        [d["key"], *(format_value(d["values"][n]) if n in d["values"] else ABSENT for n in names)]
        for d in result["config_differences"]
    ]
    config_title = "config differences"
    if result.get("config_missing"):
        missing = ", ".join(result["config_missing"])
        config_title += f" (unknown for {missing}: no config.json or app run config)"
        if not config_rows:
            config_title = f"config differences: unknown (no config in {missing})"
    return [
        ("runs", ["", *names], run_rows),
        ("metrics (final and best, @round)", header, metric_table),
        (config_title, ["key", *names], config_rows),
    ]


def _nothing(title: str) -> str:
    """What an empty table prints: its title's own verdict, else "<title>: none"."""
    return title if ": " in title else f"{title}: none"


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return MISSING
    if value == float("inf"):
        return "inf"
    return fmt.format(value)


def _at(value: float, round_: int) -> str:
    return f"{_cell(value, '{:.4g}')} @{round_}"


def render_plain(result: dict[str, Any]) -> str:
    """The tables as plain text: columns padded with spaces, a rule under each header."""
    blocks = []
    for title, header, rows in tables(result):
        if not rows:
            blocks.append(_nothing(title))
            continue
        widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
        lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_rich(result: dict[str, Any], console: Any) -> None:
    """Print the tables on a rich ``console``."""
    from rich.table import Table as RichTable  # noqa: PLC0415

    for title, header, rows in tables(result):
        if not rows:
            console.print(_nothing(title))
            continue
        table = RichTable(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def add_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Add ``fedsim compare`` to ``fedsim``'s subcommands."""
    parser = subcommands.add_parser(
        "compare", help="final and best values of runs and their config differences"
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="directories of `fedsim run`/`flwr-run`"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``fedsim compare``: errors print ``fedsim: error: ...`` and return 2."""
    try:
        result = compare_runs(load_runs(args.run_dirs))
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(dumps(result, indent=2))
    elif sys.stdout.isatty():
        from rich.console import Console  # noqa: PLC0415

        render_rich(result, Console())
    else:
        print(render_plain(result))
    return 0
