"""The ``fedsim factorize`` command: build (or reuse) a factorization and summarise it.

    fedsim factorize --kind KIND --rounds N [--bands B] [--participations K --min-sep S]
                     [--buffers NBUF] [--option NAME=VALUE ...] --out FILE.npz [--force] [--json]

(``KIND``: a registered kind, :mod:`fedsim.privacy.matrix.kinds`; ``--option``: that kind's
own integer parameters.)

The file is a cache (:func:`fedsim.privacy.matrix.build.cached`): run again with the same
arguments, it is read instead of optimised again, once its content's sha256 and its noise
stream are verified (a file that fails is rebuilt, and the summary says why). Before an
optimiser of at least ~1e10 operations starts, stderr says what it will cost (iterations,
operations, memory), then shows its progress every few seconds (not with ``--quiet``);
``dense`` above :data:`~fedsim.privacy.matrix.build.DENSE_LIMIT` rounds is refused unless
``--force``. The summary (``--json`` or one line) has the mean and max loss, sensitivity
(and whether exact), largest column norm, RMSE, the seconds the build took, whether it came
from the cache and the content's sha256. Bad input raises
:class:`~fedsim.config.ConfigError` whose key is the flag.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from fedsim.commands.flags import flags
from fedsim.config import ConfigError


class KindFlag(argparse.Action):
    """``--kind``, whose help lists the registered kinds (:mod:`fedsim.privacy.matrix.kinds`)
    when it is shown: they load then (with scipy), not for ``fedsim --help``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)

    @property
    def help(self) -> str:
        from fedsim.privacy.matrix.kinds import NAMES  # noqa: PLC0415

        return "one of " + ", ".join(NAMES)

    @help.setter
    def help(self, value: Any) -> None:
        """argparse sets a help; this flag's comes from the registry."""


FLAGS = {
    "kind": "--kind",
    "rounds": "--rounds",
    "n": "--rounds",
    "bands": "--bands",
    "participations": "--participations",
    "max_participations": "--participations",
    "epochs": "--participations",
    "min_sep": "--min-sep",
    "buffers": "--buffers",
    "kind_options": "--option",
    "out": "--out",
    "force": "--force",
}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``factorize`` command to ``subparsers``."""
    parser = subparsers.add_parser(
        "factorize",
        help="optimise a matrix-mechanism factorization (cached in an .npz)",
        description="Build a factorization A = B C of prefix sums, or reuse the cached file.",
    )
    parser.add_argument("--kind", required=True, action=KindFlag)
    parser.add_argument("--rounds", type=int, required=True, help="number of rounds n")
    parser.add_argument(
        "--bands", type=int, default=None, help="bands of C (banded, toeplitz; default --min-sep)"
    )
    parser.add_argument(
        "--participations", type=int, default=None, help="k, the most rounds one client is in"
    )
    parser.add_argument(
        "--min-sep", type=int, default=None, help="b, the fewest rounds between two of them"
    )
    parser.add_argument("--buffers", type=int, default=3, help="BLT buffers (default 3)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an integer parameter of the kind's own (repeatable)",
    )
    parser.add_argument("--out", required=True, help="the .npz file (reused if it matches)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="optimise even above the size limit of the kind (dense: 1024 rounds)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


#: a build whose estimate is at least this many operations says what it will cost
ANNOUNCE_FLOPS = 1e10
#: at most one progress line per this many seconds
PROGRESS_EVERY_S = 2.0


class Reporter:
    """Progress lines on ``stream``: the iteration, the loss, the time so far and the most
    the remaining iterations can take at the pace so far; at most one per ``every`` seconds."""

    def __init__(self, label: str, iterations: int, stream: TextIO, every: float = 2.0) -> None:
        self.label, self.iterations, self.stream, self.every = label, iterations, stream, every
        self.start = self.last = time.perf_counter()

    def __call__(self, iteration: int, loss: float) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / iteration * max(self.iterations - iteration, 0)
        print(
            f"fedsim: factorize {self.label}: iteration {iteration}/{self.iterations}, loss "
            f"{loss:.6g}, {elapsed:.0f} s (at most ~{left:.0f} s more)",
            file=self.stream,
            flush=True,
        )


def kind_options(given: list[str]) -> tuple[tuple[str, int], ...]:
    """``--option NAME=VALUE`` flags as the spec's ``(name, value)`` pairs; ConfigError
    naming ``--option`` for one that is not a name and an integer."""
    pairs = []
    for text in given:
        name, sep, value = text.partition("=")
        try:
            pairs.append((name.strip(), int(value)))
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ConfigError("--option", text, "NAME=VALUE with an integer VALUE")
    return tuple(pairs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Execute a parsed ``fedsim factorize``; returns the JSON-ready summary."""
    from fedsim.privacy.matrix.build import Spec, cached, check_cost  # noqa: PLC0415

    with flags(FLAGS):
        spec = Spec(
            kind=args.kind,
            rounds=args.rounds,
            bands=args.bands,
            participations=args.participations,
            min_sep=args.min_sep,
            buffers=args.buffers,
            options=kind_options(getattr(args, "option", [])),
        )
        estimate = check_cost(spec, force=getattr(args, "force", False))
        progress = announce = None
        if estimate is not None and not getattr(args, "quiet", False):
            label = f"{spec.kind} n = {spec.rounds}"
            progress = Reporter(label, estimate.iterations, sys.stderr, PROGRESS_EVERY_S)

            def announce() -> None:
                if estimate.total_flops < ANNOUNCE_FLOPS:
                    return  # seconds at most: no line
                print(f"fedsim: factorize {label}: {estimate.describe()}", file=sys.stderr)
                progress.start = progress.last = time.perf_counter()

        f, info = cached(spec, args.out, progress, before_build=announce)
        summary = f.summary(spec.participation)
    rmse = summary.pop("rmse_last"), summary.pop("rmse_max")
    return {
        "command": "factorize",
        **summary,
        "loss": summary["loss_mean"],
        "rmse_last": rmse[0],
        "rmse_max": rmse[1],
        "bands": spec.band_count,
        "participations": spec.participation.participations(spec.rounds),
        "min_sep": spec.min_sep,
        **info,
    }


def format_text(result: dict[str, Any]) -> str:
    """One line: what was built, its loss and sensitivity, and where it is."""
    source = "cached" if result["cached"] else "built"
    exact = "exact" if result["sensitivity_exact"] else "upper bound"
    return (
        f"factorize {result['kind']} n = {result['n']}: loss {result['loss']:.6g} "
        f"(max {result['loss_max']:.6g}), sensitivity {result['sensitivity']:.6g} ({exact}, "
        f"k = {result['participations']}), max column norm {result['max_column_norm']:.6g}; "
        f"{source} in {result['seconds']:.2f} s -> {result['path']} "
        f"(sha256 {result['sha256'][:16]}...)"
        + (f"; the file there was not reused: {result['replaced']}" if "replaced" in result else "")
    )
