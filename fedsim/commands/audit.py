"""``fedsim audit RUN_DIR [--attack loss|zlib|mink|dataset-inference] [--members N] [--seed S]
[--out FILE]``.

Registers the subcommand (no heavy imports here) and runs it: authenticates the run's
``config.json`` under its root (:func:`fedsim.frontend.run_root.authenticated_config`; an edited one
is refused, naming the file, before any module it names is imported), loads the finished run,
computes the membership-inference audit (:mod:`fedsim.audits.run_audit`), writes
``audit.json`` (or ``--out``) and prints a summary.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fedsim.config import ConfigError


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``audit`` subcommand to ``fedsim``'s subparsers."""
    audit = subparsers.add_parser(
        "audit", help="membership-inference audit of a finished `fedsim run` directory"
    )
    audit.add_argument("run_dir", help="directory written by `fedsim run` (config.json, model.npz)")
    audit.add_argument(
        "--attack",
        default="loss",
        help="membership score: loss (default), zlib (loss / zlib length of the row), mink "
        "(language models only), or dataset-inference (p-value that the member rows were "
        "trained on, with a held-out control)",
    )
    audit.add_argument(
        "--members",
        type=int,
        default=None,
        help="member rows (and as many held-out rows) to score (default: all the smaller side)",
    )
    audit.add_argument(
        "--seed", type=int, default=None, help="draws the rows (default: the run's seed)"
    )
    audit.add_argument("--out", default=None, help="where to write the JSON (RUN_DIR/audit.json)")
    audit.add_argument(
        "--secrets",
        metavar="FILE",
        default=None,
        help="the root file the run was started with (default: the root fedsim kept for it); "
        "config.json is authenticated under it before anything in it is imported",
    )
    return audit


def run(args: argparse.Namespace) -> int:
    """Run ``fedsim audit``; errors print ``fedsim: error: ...`` and return 2."""
    from fedsim.audits.run_audit import (  # noqa: PLC0415
        audit_run,
        format_audit,
        write_audit,
    )
    from fedsim.frontend.experiment import load_finished_run  # noqa: PLC0415

    try:
        run = load_finished_run(args.run_dir, args.secrets)
        result = audit_run(run, attack=args.attack, members=args.members, seed=args.seed)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    path = write_audit(result, args.out)
    print(format_audit(result))
    print(f"fedsim: audit written to {path}")
    return 0
