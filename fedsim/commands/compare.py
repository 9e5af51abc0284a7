"""``fedsim compare RUN_DIR|SWEEP_DIR... [--json] [--per-seed] [--all]``: runs side by side
in the terminal.

Three tables: per run its rounds, final epsilon and delta (the run's, and with DP-SGD clients
the largest a client reports), seconds and bytes; per metric (:mod:`fedsim.frontend.run_series`)
each run's final value and best value, with the round of each (best = the largest for
accuracy-like metrics, the smallest for loss-like ones; the table says which, and gives no
best for other metrics); and the config keys whose values differ between the runs, with each
run's value (or "unknown" for runs whose config is not there: never "none" by default).
Damaged run files are refused by name and line (:func:`fedsim.frontend.run_series.load_run`). A
terminal gets rich tables; a pipe or file plain text; ``--json`` the same numbers as JSON.

Config differences show what differs: a key that is null (unset) where it is written and
absent elsewhere is not a difference, and when the runs' configs share no key at all (a
``fedsim run`` run next to a Flower app's run) each run's keys are counted, not listed;
``--all`` lists every key.

Runs that differ only in their seed (:mod:`fedsim.frontend.seed_groups`) are one group: the tables
give each group's mean ± sample sd (ddof=1) over its runs, and for two groups that ran the
same seeds the paired differences of their final values (later group minus earlier, seed by
seed) with their mean, sd and 95 % t-interval. ``--per-seed`` shows one column per run, as
when no two runs share a config. A sweep's directory stands for its points that ran
(:mod:`fedsim.frontend.sweep_index`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from fedsim.config import ConfigError
from fedsim.frontend.run_series import (
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
from fedsim.frontend.seed_groups import (
    INTERVAL_TEXT,
    SD_TEXT,
    Group,
    group_labels,
    group_runs,
    is_seed_key,
    paired_seeds,
    summarize,
)
from fedsim.frontend.sweep_index import expand_run_dirs
from fedsim.results_json import dumps

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


def compare_runs(runs: Sequence[RunSeries], show_all: bool = False) -> dict[str, Any]:
    """What ``fedsim compare --per-seed`` shows (one column per run), as JSON-ready data."""
    names, labels = run_names(runs), run_labels(runs)
    differences, hidden = shown_differences(runs, names, show_all)
    return {
        "runs": [
            {"name": name, "path": str(run.path), "label": label, **run_facts(run)}
            for name, label, run in zip(names, labels, runs)
        ],
        "metrics": metric_rows(runs),
        "config_differences": differences,
        "config_hidden": hidden,
        # runs whose config could not be read: their differences are unknown, not none
        "config_missing": [name for name, run in zip(names, runs) if not run.config],
    }


def shown_differences(
    runs: Sequence[RunSeries], names: Sequence[str], show_all: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The config differences to list (``{"key", "values": {name: value}}``; a run that
    lacks the key is left out of ``values``) and what was left unlisted (without
    ``show_all``): ``null_or_absent``, keys null where written and absent elsewhere, and
    ``only_in``, per run the number of keys the others lack, when the configs (of the runs
    that have one) share no key."""
    differences = config_differences(runs)
    hidden: dict[str, Any] = {}
    if not show_all:
        unset = [
            k for k, values in differences.items() if all(v is None or v is ABSENT for v in values)
        ]
        with_config = [run.config for run in runs if run.config]
        disjoint = len(with_config) > 1 and not set.intersection(*(set(c) for c in with_config))
        only_in: dict[str, int] = {}
        if disjoint:
            for key, values in differences.items():
                if key not in unset and any(v is ABSENT for v in values):
                    holder = next(n for n, v in zip(names, values) if v is not ABSENT)
                    only_in[holder] = only_in.get(holder, 0) + 1
        if unset:
            hidden["null_or_absent"] = len(unset)
        if only_in:
            hidden["only_in"] = only_in
        dropped = set(unset) | (
            {k for k, vs in differences.items() if any(v is ABSENT for v in vs)}
            if disjoint
            else set()
        )
        differences = {k: v for k, v in differences.items() if k not in dropped}
    listed = [
        {"key": key, "values": {n: v for n, v in zip(names, values) if v is not ABSENT}}
        for key, values in differences.items()
    ]
    return listed, hidden


# -- runs that differ only in seed ---------------------------------------------------------------

#: the facts of :func:`run_facts` a group summarises (its rounds, epsilons, costs)
GROUP_FACTS = (
    "rounds",
    "epsilon",
    "client_max_epsilon",
    "seconds_rounds",
    "seconds_total",
    "bytes_up",
    "bytes_down",
)


def grouped(runs: Sequence[RunSeries]) -> bool:
    """Whether two of ``runs`` differ only in their seed (the default view groups them)."""
    return any(len(group.runs) > 1 for group in group_runs(runs))


def compare_groups(runs: Sequence[RunSeries], show_all: bool = False) -> dict[str, Any]:
    """What ``fedsim compare`` shows when runs differ only in seed, as JSON-ready data:
    ``groups`` (each its runs, seeds and facts as :func:`~fedsim.frontend.seed_groups.summarize`
    gives them: n, mean, sd, low, high), ``metrics`` (per metric and group, the summaries
    of the runs' final and best values), ``paired`` (per metric and pair of groups with
    seeds in common, the summary of ``b - a`` over those seeds), the config differences
    between the groups (seed keys left out) and each run's own facts (``runs``)."""
    groups = group_runs(runs)
    labels = group_labels(groups)
    names = run_names(runs)
    name_of = {id(run): name for run, name in zip(runs, names)}
    per_run = compare_runs(runs, show_all)
    facts = {id(run): entry for run, entry in zip(runs, per_run["runs"])}
    group_rows = []
    for i, (label, group) in enumerate(zip(labels, groups)):
        summaries = {}
        for key in GROUP_FACTS:
            values = [facts[id(r)][key] for r in group.runs if facts[id(r)][key] is not None]
            summaries[key] = summarize(values) if values else None
        group_rows.append(
            {
                "name": f"g{i + 1}",
                "label": label,
                "runs": [name_of[id(r)] for r in group.runs],
                "seeds": group.seed_texts,
                "n": len(group.runs),
                **summaries,
            }
        )
    representatives = [
        replace(g.runs[0], config={k: v for k, v in g.runs[0].config.items() if not is_seed_key(k)})
        for g in groups
    ]
    differences, hidden = shown_differences(
        representatives, [g["name"] for g in group_rows], show_all
    )
    return {
        "view": "seed groups",
        "sd": SD_TEXT,
        "interval": INTERVAL_TEXT,
        "groups": group_rows,
        "metrics": group_metric_rows(groups),
        "paired": paired_rows(groups, [g["name"] for g in group_rows]),
        "config_differences": differences,
        "config_hidden": hidden,
        "config_missing": [
            g["name"] for g, rep in zip(group_rows, representatives) if not rep.config
        ],
        "runs": per_run["runs"],
    }


def group_metric_rows(groups: Sequence[Group]) -> list[dict[str, Any]]:
    """Per metric (as :func:`metric_rows`) and group: the summaries of its runs' final and
    best values (over the runs that recorded the metric; None where none did)."""
    rows = []
    runs = [run for group in groups for run in group.runs]
    for row in metric_rows(runs):
        cells = iter(row["runs"])
        per_group: list[dict[str, Any] | None] = []
        for group in groups:
            mine = [c for c in (next(cells) for _ in group.runs) if c is not None]
            if not mine:
                per_group.append(None)
                continue
            best = [c["best"] for c in mine if c["best"] is not None]
            per_group.append(
                {
                    "final": summarize([c["final"] for c in mine]),
                    "final_rounds": [c["final_round"] for c in mine],
                    "best": summarize(best) if best else None,
                }
            )
        rows.append({"metric": row["metric"], "best_is": row["best_is"], "groups": per_group})
    return rows


def paired_rows(groups: Sequence[Group], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per metric and pair of groups (a before b) that ran seeds in common: the final values'
    differences ``b - a`` seed by seed, and their summary (the paired t-interval)."""
    rows = []
    runs = [run for group in groups for run in group.runs]
    pairs = [
        (names[i], names[j], paired_seeds(groups[i], groups[j]))
        for i in range(len(groups))
        for j in range(i + 1, len(groups))
    ]
    for metric in (row["metric"] for row in metric_rows(runs)):
        for a, b, seeds in pairs:
            both = [(x, y, s) for x, y, s in seeds if metric in x.series and metric in y.series]
            if not both:
                continue
            differences = [y.final(metric) - x.final(metric) for x, y, _ in both]
            rows.append(
                {
                    "metric": metric,
                    "a": a,
                    "b": b,
                    "seeds": [s for _, _, s in both],
                    "differences": differences,
                    **summarize(differences),
                }
            )
    return rows


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
    return [
        ("runs", ["", *names], run_rows),
        ("metrics (final and best, @round)", header, metric_table),
        config_table(result, names),
    ]


def config_table(result: dict[str, Any], names: Sequence[str]) -> Table:
    """The config differences of a :func:`compare_runs` or :func:`compare_groups` result,
    its title saying what is unknown and what was counted rather than listed."""
    config_rows = [
        [d["key"], *(format_value(d["values"][n]) if n in d["values"] else ABSENT for n in names)]
        for d in result["config_differences"]
    ]
    config_title = "config differences"
    notes = []
    if result.get("config_missing"):
        missing = ", ".join(result["config_missing"])
        notes.append(f"unknown for {missing}: no config.json or app run config")
        if not config_rows:
            config_title = f"config differences: unknown (no config in {missing})"
    hidden = result.get("config_hidden") or {}
    if "only_in" in hidden:
        counts = ", ".join(f"{n} keys only in {name}" for name, n in hidden["only_in"].items())
        notes.append(f"the configs share no key: {counts}")
    if "null_or_absent" in hidden:
        notes.append(
            f"{hidden['null_or_absent']} keys unset (null) in some runs, absent in the rest"
        )
    if hidden:
        notes.append("--all lists them")
    if notes and ": unknown" not in config_title:
        config_title += f" ({'; '.join(notes)})"
    return (config_title, ["key", *names], config_rows)


def _metric_table(result: dict[str, Any], names: list[str]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the metrics table: each metric's final and best value per
    group (mean ± sd)."""
    header = ["metric", "best is"]
    for name in names:
        header += [f"{name} final", f"{name} best"]
    metric_table = []
    for row in result["metrics"]:
        cells = [row["metric"], row["best_is"] or MISSING]
        for cell in row["groups"]:
            if cell is None:
                cells += [MISSING, MISSING]
            else:
                cells += [_mean_sd(cell["final"]), _mean_sd(cell["best"])]
        metric_table.append(cells)
    return header, metric_table


def group_tables(result: dict[str, Any]) -> list[Table]:
    """The tables of a :func:`compare_groups` result: the groups, their facts and metrics
    as mean ± sd, the paired differences and the config differences between groups."""
    groups = result["groups"]
    names = [g["name"] for g in groups]
    sd = result["sd"]
    group_rows = [
        [g["name"], g["label"], str(g["n"]), ", ".join(g["seeds"]), ", ".join(g["runs"])]
        for g in groups
    ]
    facts = [
        ("rounds", "rounds", "{:.4g}"),
        ("epsilon", "epsilon", "{:.4g}"),
        ("client max epsilon", "client_max_epsilon", "{:.4g}"),
        ("seconds (rounds)", "seconds_rounds", "{:.2f}"),
        ("seconds (total)", "seconds_total", "{:.2f}"),
        ("bytes up", "bytes_up", "{:,.0f}"),
        ("bytes down", "bytes_down", "{:,.0f}"),
    ]
    fact_rows = [
        [title, *(_mean_sd(g[key], fmt) for g in groups)]
        for title, key, fmt in facts
        if any(g[key] is not None for g in groups)
    ]
    header, metric_table = _metric_table(result, names)
    paired = [
        [
            p["metric"],
            f"{p['b']} - {p['a']}",
            str(p["n"]),
            _cell(p["mean"], "{:.4g}"),
            _cell(p["sd"], "{:.3g}"),
            MISSING if p["low"] is None else f"[{p['low']:.4g}, {p['high']:.4g}]",
        ]
        for p in result["paired"]
    ]
    return [
        (
            "seed groups (runs that differ only in seed)",
            ["", "group", "runs", "seeds", "dirs"],
            group_rows,
        ),
        (f"runs (mean ± {sd} over each group's runs)", ["", *names], fact_rows),
        (f"metrics (final and best, mean ± {sd})", header, metric_table),
        (
            f"paired differences of final values (seed by seed, on the seeds both groups ran; "
            f"{result['interval']})",
            ["metric", "difference", "n seeds", "mean", "sd", "95 % interval"],
            paired,
        ),
        config_table(result, names),
    ]


def _mean_sd(summary: dict[str, Any] | None, fmt: str = "{:.4g}") -> str:
    """``mean ± sd`` (just the mean for one run, or where the sd is undefined)."""
    if summary is None or summary["mean"] is None:
        return MISSING
    mean = _cell(summary["mean"], fmt)
    return mean if summary["sd"] is None else f"{mean} ± {summary['sd']:.2g}"


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


def _tables_of(result: dict[str, Any]) -> list[Table]:
    return group_tables(result) if result.get("view") == "seed groups" else tables(result)


def render_plain(result: dict[str, Any]) -> str:
    """The tables as plain text: columns padded with spaces, a rule under each header."""
    blocks = []
    for title, header, rows in _tables_of(result):
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

    for title, header, rows in _tables_of(result):
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
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="directories of `fedsim run`/`flwr-run`, or of `fedsim sweep` (its points)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--per-seed",
        action="store_true",
        help="one column per run, also for runs that differ only in seed (no mean ± sd)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="list every differing config key (also keys unset or absent, and every key of "
        "runs whose configs share none)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``fedsim compare``: errors print ``fedsim: error: ...`` and return 2."""
    try:
        given = expand_run_dirs(args.run_dirs)
        runs = load_runs(given.paths)
        if not args.per_seed and grouped(runs):
            result = compare_groups(runs, args.all)
        else:
            result = compare_runs(runs, args.all)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    if given.left_out:
        result["left_out"] = given.left_out
        for point in given.left_out:
            print(f"fedsim: left out {point}: it has not run", file=sys.stderr)
    if args.json:
        print(dumps(result, indent=2))
    elif sys.stdout.isatty():
        from rich.console import Console  # noqa: PLC0415

        render_rich(result, Console())
    else:
        print(render_plain(result))
    return 0
