"""``fedsim plot RUN_DIR|SWEEP_DIR... [--metric NAME ...] [--band sd|ci95] [--per-seed]
[--out FILE.png]``: runs' curves as a PNG.

One panel per quantity: accuracy-like metrics, loss-like metrics, epsilon, bytes per round (up
and down), seconds per round, and a panel of its own for any other metric chosen with
``--metric`` (names: :mod:`fedsim.frontend.run_series`). Each run has its colour, each metric of a
panel its line style; the legend names runs by the config keys that differ between them. A
run that did not record a metric (no epsilon in a non-private run) has no line for it.
Matplotlib is imported when a figure is drawn (Agg canvas; pyplot's global state is not used).

Runs that differ only in their seed (:mod:`fedsim.frontend.seed_groups`) are drawn as one line,
their mean at the rounds every one of them recorded, with a band: ± one sample sd (``--band sd``,
ddof=1, the default) or the 95 % t-interval of the mean (``--band ci95``); the figure's
legend says which. ``--per-seed`` draws one line per run, as when no two runs share a config.
A sweep's directory (``fedsim sweep``'s ``--out``) stands for its points that ran
(:mod:`fedsim.frontend.sweep_index`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config import ConfigError, require
from fedsim.frontend.run_series import (
    EPSILONS,
    RunSeries,
    best_is,
    check_metrics,
    default_metrics,
    load_runs,
    run_labels,
)
from fedsim.frontend.seed_groups import (
    INTERVAL_TEXT,
    SD_TEXT,
    Group,
    group_labels,
    group_runs,
    mean_curve,
)
from fedsim.frontend.sweep_index import expand_run_dirs

if TYPE_CHECKING:
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

#: the panels of the default figure, in order (other metrics follow, each in its own)
PANELS = ("accuracy", "loss", "epsilon", "bytes per round", "seconds per round")
_STYLES = ("-", "--", ":", "-.")
_MARKERS_UP_TO = 40  # series with at most this many points get a marker on each
#: ``--band`` -> what the band is, as the legend says it
BANDS = {"sd": f"± 1 {SD_TEXT}", "ci95": INTERVAL_TEXT}


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
    """A drawn figure and its lines: ``lines[(metric, i)]`` is run ``i``'s line of ``metric``
    (group ``i``'s mean when seeds are grouped, and ``bands[(metric, i)]`` its band)."""

    figure: Figure
    lines: dict[tuple[str, int], Line2D]
    bands: dict[tuple[str, int], PolyCollection] = field(default_factory=dict)


#: one line of a figure: metric -> (rounds, values, band low, band high; None: no band)
Curves = dict[str, tuple[Sequence[int], Sequence[float], Any, Any]]


def plot_runs(runs: Sequence[RunSeries], metrics: Sequence[str]) -> RunPlot:
    """Draw ``metrics`` of ``runs`` against the round, one panel per quantity.

    A run's lines share its colour and a metric's its line style; a panel's legend names its
    metrics (when it has several, or there is one run), the figure's legend (below the panels)
    names the runs by :func:`~fedsim.frontend.run_series.run_labels`. A line's own label is
    ``"<run label>: <metric>"`` (just the metric with one run)."""
    curves: list[Curves] = [
        {m: (s.rounds, s.values, None, None) for m, s in run.series.items()} for run in runs
    ]
    return _draw(curves, metrics, run_labels(runs), runs, None)


def plot_groups(groups: Sequence[Group], metrics: Sequence[str], band: str) -> RunPlot:
    """Draw each group of runs that differ only in seed as its mean (at the rounds all its
    runs recorded) with a ``band`` (:data:`BANDS`) shaded around it; a group of one run is
    its line. The figure's legend names the groups
    (:func:`~fedsim.frontend.seed_groups.group_labels`) under a title that says what the line and
    the band are."""
    curves: list[Curves] = []
    for group in groups:
        drawn: Curves = {}
        for metric in metrics:
            curve = mean_curve(group, metric, band)
            if curve is not None:
                rounds, mean, low, high = curve
                one = len(group.runs) == 1
                drawn[metric] = (rounds, list(mean), None if one else low, None if one else high)
        curves.append(drawn)
    title = f"line: mean over seeds; band: {BANDS[band]}"
    runs = [run for group in groups for run in group.runs]
    return _draw(curves, metrics, group_labels(groups), runs, title)


def _plot_panel(
    ax: Any,
    names: Sequence[str],
    curves: Sequence[Curves],
    labels: Sequence[str],
    lines: dict[tuple[str, int], Any],
    bands: dict[tuple[str, int], Any],
) -> None:
    """Draw metrics ``names`` of every curve on ``ax`` (a line style per metric, a colour
    per curve, its band where it has one), filing them in ``lines`` and ``bands``."""
    for style, metric in enumerate(names):
        for i, curve in enumerate(curves):
            if metric not in curve:
                continue
            xs, ys, low, high = curve[metric]
            colour = f"C{i % 10}"
            (lines[metric, i],) = ax.plot(
                xs,
                ys,
                color=colour,
                linestyle=_STYLES[style % len(_STYLES)],
                marker="." if len(xs) <= _MARKERS_UP_TO else None,
                label=f"{labels[i]}: {metric}" if len(curves) > 1 else metric,
            )
            if low is not None:
                bands[metric, i] = ax.fill_between(
                    xs, low, high, color=colour, alpha=0.2, linewidth=0
                )


def _draw(
    curves: Sequence[Curves],
    metrics: Sequence[str],
    labels: Sequence[str],
    runs: Sequence[RunSeries],
    legend_title: str | None,
) -> RunPlot:
    """The figure of ``curves`` (one per run or group, labelled ``labels``); a figure legend
    when there are several, or a ``legend_title`` to show."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    grouped = panels(metrics)
    columns = 2 if len(grouped) == 4 else min(len(grouped), 3)
    rows = -(-len(grouped) // columns)
    several = len(curves) > 1
    figure_legend = several or legend_title is not None
    legend_rows = (-(-len(curves) // 2) + (legend_title is not None)) if figure_legend else 0
    height = 3.4 * rows + 0.3 * legend_rows
    figure = Figure(figsize=(4.8 * columns, height), dpi=100)
    FigureCanvasAgg(figure)
    lines: dict[tuple[str, int], Line2D] = {}
    bands: dict[tuple[str, int], PolyCollection] = {}
    for index, (title, names) in enumerate(grouped.items()):
        ax = figure.add_subplot(rows, columns, index + 1)
        _plot_panel(ax, names, curves, labels, lines, bands)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_ylabel(_y_label(title, names, runs))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if len(names) > 1 or not several:
            shade = "C0" if not several else "0.3"
            styles = [
                Line2D([], [], color=shade, linestyle=_STYLES[k % len(_STYLES)])
                for k in range(len(names))
            ]
            ax.legend(styles, names, fontsize="small")
    if figure_legend:
        colours = [Line2D([], [], color=f"C{i % 10}") for i in range(len(curves))]
        figure.legend(
            colours,
            labels,
            loc="lower center",
            ncols=2 if several else 1,
            fontsize="small",
            title=legend_title,
            title_fontsize="small",
        )
    bottom = (0.3 * legend_rows + 0.1) / height if legend_rows else 0
    figure.tight_layout(rect=(0, bottom, 1, 1))
    return RunPlot(figure, lines, bands)


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
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="directories of `fedsim run`/`flwr-run`, or of `fedsim sweep` (its points)",
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
        "--band",
        choices=tuple(BANDS),
        default="sd",
        help="the band around the mean of runs that differ only in seed: sd = ± 1 sample sd "
        "(ddof=1), ci95 = the 95%% t-interval of the mean (default: sd)",
    )
    parser.add_argument(
        "--per-seed",
        action="store_true",
        help="one line per run, also for runs that differ only in seed (no mean, no band)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="PNG to write (default: RUN_DIR/plot.png with one run or one sweep, plot.png "
        "here otherwise)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``fedsim plot``: errors print ``fedsim: error: ...`` and return 2."""
    try:
        given = expand_run_dirs(args.run_dirs)
        runs = load_runs(given.paths)
        metrics = args.metric or ordered_by_panel(default_metrics(runs))
        check_metrics(runs, metrics, "--metric")
        require(bool(metrics), "RUN_DIR", args.run_dirs, "runs that recorded a metric")
        out = _out_path(args.out, runs, given.sweeps if len(args.run_dirs) == 1 else [])
        groups = group_runs(runs)
        grouped = not args.per_seed and any(len(g.runs) > 1 for g in groups)
        drawn = plot_groups(groups, metrics, args.band) if grouped else plot_runs(runs, metrics)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    save_figure(drawn.figure, out)
    titles = [ax.get_title() for ax in drawn.figure.axes]
    for point in given.left_out:
        print(f"fedsim: left out {point}: it has not run", file=sys.stderr)
    shown = f"{len(runs)} run(s)"
    if grouped:
        shown += f" in {len(groups)} seed group(s) (mean, band {BANDS[args.band]})"
    print(f"fedsim: {shown}, panels {', '.join(titles)}; plot in {out}")
    return 0


def _out_path(out: str | None, runs: Sequence[RunSeries], sweeps: Sequence[Path]) -> Path:
    if out is None:
        if sweeps:
            return sweeps[0] / "plot.png"
        return runs[0].path / "plot.png" if len(runs) == 1 else Path("plot.png")
    require(Path(out).suffix.lower() == ".png", "--out", out, "a path ending in .png")
    return Path(out)
