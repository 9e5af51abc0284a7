"""``fedsim up`` and ``fedsim down``: start and stop the warm Ray head and its worker pool
(:mod:`fedsim.engine.warm_pool`); runs attach to it while it is up."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fedsim.config import ConfigError


def register(subparsers: Any) -> None:
    """Add ``up`` and ``down`` to ``fedsim``'s subparsers."""
    up = subparsers.add_parser(
        "up", help="start a warm Ray head with worker actors that runs attach to"
    )
    up.add_argument("--workers", type=int, default=0, help="warm workers (default: one per CPU)")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs of the head (default: all)")
    up.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="seconds without a run before the pool and its head stop (default 900)",
    )
    up.add_argument("--ray-address", default=None, help="keep the pool on this Ray cluster instead")
    up.set_defaults(func=run_up)
    down = subparsers.add_parser(
        "down", help="stop the warm pool (and the head `fedsim up` started)"
    )
    down.add_argument("--ray-address", default=None, help="the cluster whose pool to stop")
    down.set_defaults(func=run_down)


def run_up(args: argparse.Namespace) -> int:
    from fedsim.engine.warm_pool import IDLE_TIMEOUT_S, up  # noqa: PLC0415

    try:
        described = up(
            workers=args.workers,
            num_cpus=args.num_cpus,
            idle_timeout_s=IDLE_TIMEOUT_S if args.idle_timeout is None else args.idle_timeout,
            ray_address=args.ray_address or "",
        )
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(described))
    return 0


def run_down(args: argparse.Namespace) -> int:
    from fedsim.engine.warm_pool import down  # noqa: PLC0415

    try:
        stopped = down(args.ray_address or "")
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    print("fedsim: the warm pool stopped" if stopped else "fedsim: no warm pool was up")
    return 0
