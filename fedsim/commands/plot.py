"""``fedsim plot RUN_DIR... [--metric NAME ...] [--out FILE.png]``: runs' curves as a PNG.

One panel per quantity: accuracy-like metrics, loss-like metrics, epsilon, bytes per round (up
and down), seconds per round, and a panel of its own for any other metric chosen with
``--metric`` (names: :mod:`fedsim.run_series`). Each run has its colour, each metric of a
panel its line style; the legend names runs by the config keys that differ between them. A
run that did not record a metric (no epsilon in a non-private run) has no line for it.
Matplotlib is imported when a figure is drawn (Agg canvas; pyplot's global state is not used).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config import ConfigError, require
from fedsim.run_series import (
    EPSILONS,
    RunSeries,
    best_is,
    check_metrics,
    default_metrics,
    load_runs,
    run_labels,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

#: the panels of the default figure, in order (other metrics follow, each in its own)
PANELS = ("accuracy", "loss", "epsilon", "bytes per round", "seconds per round")
_STYLES = ("-", "--", ":", "-.")
_MARKERS_UP_TO = 40  # series with at most this many points get a marker on each


def panel_of(metric: str) -> str:
    """The panel a metric is drawn in."""
    if metric in EPSILONS:
        return "epsilon"
    if metric in ("bytes_up", "bytes_down"):
        return "bytes per round"
    if metric == "seconds":
        return "seconds per round"
    if best_is(metric) == "max":
        return "accuracy"
    if "loss" in metric.rsplit("/", 1)[-1].lower():
        return "loss"
    return metric


def ordered_by_panel(metrics: Sequence[str]) -> list[str]:
    """``metrics`` with those of :data:`PANELS` first, in its order (a stable sort)."""
    rank = {title: i for i, title in enumerate(PANELS)}
    return sorted(metrics, key=lambda m: rank.get(panel_of(m), len(PANELS)))


def panels(metrics: Sequence[str]) -> dict[str, list[str]]:
    """Panel title -> its metrics, in the order the metrics are given."""
    out: dict[str, list[str]] = {}
    for metric in dict.fromkeys(metrics):
        out.setdefault(panel_of(metric), []).append(metric)
    return out


@dataclass
class RunPlot:
    """A drawn figure and its lines: ``lines[(metric, i)]`` is run ``i``'s line of ``metric``."""

    figure: Figure
    lines: dict[tuple[str, int], Line2D]


def plot_runs(runs: Sequence[RunSeries], metrics: Sequence[str]) -> RunPlot:
    """Draw ``metrics`` of ``runs`` against the round, one panel per quantity.

    A run's lines share its colour and a metric's its line style; a panel's legend names its
    metrics (when it has several, or there is one run), the figure's legend (below the panels)
    names the runs by :func:`~fedsim.run_series.run_labels`. A line's own label is
    ``"<run label>: <metric>"`` (just the metric with one run)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    grouped = panels(metrics)
    columns = 2 if len(grouped) == 4 else min(len(grouped), 3)
    rows = -(-len(grouped) // columns)
    labels = run_labels(runs)
    legend_rows = -(-len(runs) // 2) if len(runs) > 1 else 0
    height = 3.4 * rows + 0.3 * legend_rows
    figure = Figure(figsize=(4.8 * columns, height), dpi=100)
    FigureCanvasAgg(figure)
    lines: dict[tuple[str, int], Line2D] = {}
    for index, (title, names) in enumerate(grouped.items()):
        ax = figure.add_subplot(rows, columns, index + 1)
        for style, metric in enumerate(names):
            for i, run in enumerate(runs):
                if metric in run.series:
                    series = run.series[metric]
                    (lines[metric, i],) = ax.plot(
                        series.rounds,
                        series.values,
                        color=f"C{i % 10}",
                        linestyle=_STYLES[style % len(_STYLES)],
                        marker="." if len(series.rounds) <= _MARKERS_UP_TO else None,
                        label=f"{labels[i]}: {metric}" if len(runs) > 1 else metric,
                    )
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_ylabel(_y_label(title, names, runs))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if len(names) > 1 or len(runs) == 1:
            shade = "C0" if len(runs) == 1 else "0.3"
            styles = [
                Line2D([], [], color=shade, linestyle=_STYLES[k % len(_STYLES)])
                for k in range(len(names))
            ]
            ax.legend(styles, names, fontsize="small")
    if len(runs) > 1:
        colours = [Line2D([], [], color=f"C{i % 10}") for i in range(len(runs))]
        figure.legend(colours, labels, loc="lower center", ncols=2, fontsize="small")
    figure.tight_layout(rect=(0, (0.3 * legend_rows + 0.1) / height if legend_rows else 0, 1, 1))
    return RunPlot(figure, lines)


def _y_label(title: str, names: Sequence[str], runs: Sequence[RunSeries]) -> str:
    """The panel's unit; for epsilon, the delta it is at (when the runs share one)."""
    if title == "epsilon":
        deltas = {run.delta(name) for name in names for run in runs if name in run.series}
        (delta,) = deltas if len(deltas) == 1 else (None,)
        return "epsilon" if delta is None else f"epsilon at delta = {delta:g}"
    return {"bytes per round": "bytes", "seconds per round": "seconds"}.get(title, title)


def save_figure(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")


def add_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Add ``fedsim plot`` to ``fedsim``'s subcommands."""
    parser = subcommands.add_parser(
        "plot", help="learning curves, epsilon, bytes and seconds per round of runs, as a PNG"
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="directories of `fedsim run`/`flwr-run`"
    )
    parser.add_argument(
        "--metric",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="metrics to draw, e.g. central/accuracy train/train_loss privacy/epsilon bytes_up "
        "seconds (default: accuracy, loss, epsilon, bytes and seconds per round)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="PNG to write (default: RUN_DIR/plot.png with one run, plot.png here with several)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``fedsim plot``: errors print ``fedsim: error: ...`` and return 2."""
    try:
        runs = load_runs(args.run_dirs)
        metrics = args.metric or ordered_by_panel(default_metrics(runs))
        check_metrics(runs, metrics, "--metric")
        require(bool(metrics), "RUN_DIR", args.run_dirs, "runs that recorded a metric")
        out = _out_path(args.out, runs)
        drawn = plot_runs(runs, metrics)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    save_figure(drawn.figure, out)
    titles = [ax.get_title() for ax in drawn.figure.axes]
    print(f"fedsim: {len(runs)} run(s), panels {', '.join(titles)}; plot in {out}")
    return 0


def _out_path(out: str | None, runs: Sequence[RunSeries]) -> Path:
    if out is None:
        return runs[0].path / "plot.png" if len(runs) == 1 else Path("plot.png")
    require(Path(out).suffix.lower() == ".png", "--out", out, "a path ending in .png")
    return Path(out)
