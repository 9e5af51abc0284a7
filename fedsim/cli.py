"""The ``fedsim`` command line.

    fedsim run CONFIG.toml --out DIR
    fedsim run [CONFIG.toml] --resume DIR
    fedsim flwr-run APP_DIR --num-supernodes N [--run-config "k=v ..."] --out DIR
    fedsim account {dp-fedavg,dp-sgd,calibrate,sweep,matrix} ... [--json]
    fedsim factorize --kind KIND --rounds N [--bands B] [--participations K --min-sep S]
                     --out FILE.npz [--json]
    fedsim audit RUN_DIR [--attack loss|zlib|mink] [--members N] [--out FILE]
    fedsim minmax CONFIG.toml [--out DIR]

``run`` and ``flwr-run`` accept ``--ray-address`` (join an existing Ray cluster), ``--workers``,
``--backend {ray,local}``, ``--no-progress`` and ``--secrets FILE`` (the run's secret root, kept
outside DIR; created if missing); both write ``DIR/rounds.jsonl`` as rounds finish and
``DIR/summary.json`` at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.commands import account, audit, factorize, minmax
from fedsim.config import ConfigError
from fedsim.results_json import dumps

if TYPE_CHECKING:
    from fedsim.randomness import RunSecret


def _engine_args(parser: argparse.ArgumentParser, resumable: bool = False) -> None:
    if resumable:
        where = parser.add_mutually_exclusive_group(required=True)
        where.add_argument("--out", help="results directory (new or empty)")
        where.add_argument("--resume", metavar="DIR", help="continue the interrupted run in DIR")
    else:
        parser.add_argument("--out", required=True, help="results directory (new or empty)")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="join the Ray cluster at this address (default: $RAY_ADDRESS, else a local Ray)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="worker actors (default: one per CPU)"
    )
    parser.add_argument(
        "--backend", choices=("ray", "local"), default=None, help="ray (default) or local"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--secrets",
        metavar="FILE",
        default=None,
        help="the run's secret root (64 hex digits; created, mode 0600, if missing), outside "
        "the results directory: the same root repeats a run exactly (default: a fresh root, "
        "kept under $FEDSIM_SECRETS_DIR for --resume)",
    )
    parser.add_argument("--verbose", action="store_true", help="show Flower's per-round log")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a fedsim experiment config")
    run.add_argument("config", nargs="?", help="experiment TOML file (optional with --resume)")
    _engine_args(run, resumable=True)
    flwr_run = commands.add_parser("flwr-run", help="run a Flower app project on fedsim's engine")
    flwr_run.add_argument("app_dir", help="directory with the app's pyproject.toml")
    flwr_run.add_argument("--num-supernodes", type=int, required=True, help="virtual clients")
    flwr_run.add_argument(
        "--run-config",
        default=None,
        help='overrides of [tool.flwr.app.config], e.g. "num-server-rounds=5 lr=0.1"',
    )
    _engine_args(flwr_run)
    account.register(commands)
    factorize.register(commands)
    audit.register(commands)
    minmax.register(commands)
    return parser


def _check_workers(workers: int | None) -> None:
    if workers is not None and workers < 1:
        raise ConfigError("--workers", workers, "an integer >= 1")


def _check_address(address: str, backend: str, key: str) -> None:
    """Fail before any work when the Ray cluster to join does not answer."""
    from fedsim.engine.cluster import check_reachable  # noqa: PLC0415

    if backend == "ray" and address:
        check_reachable(address, key)


def _secrets(args: argparse.Namespace, resuming: bool = False) -> RunSecret | None:
    """The root named by ``--secrets`` (None without it); a resumed run's must exist."""
    if args.secrets is None:
        return None
    from fedsim.randomness import RunSecret  # noqa: PLC0415

    run_dir = args.resume if resuming else args.out
    return RunSecret.load_or_create(args.secrets, run_dir, create=not resuming)


def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.experiment import load_run_config, run_experiment  # noqa: PLC0415
    from fedsim.run_config import ExperimentConfig, with_engine  # noqa: PLC0415

    _check_workers(args.workers)
    if args.resume:
        given = ExperimentConfig.load(args.config) if args.config else None
        base = load_run_config(args.resume, given)
    elif args.config:
        base = ExperimentConfig.load(args.config)
    else:
        raise ConfigError("CONFIG", None, "an experiment TOML file (or --resume DIR)")
    config = with_engine(
        base,
        ray_address=args.ray_address,
        workers=args.workers,
        backend=args.backend,
    )
    _check_address(
        config.engine.ray_address or os.environ.get("RAY_ADDRESS", ""),
        config.engine.backend,
        "--ray-address" if args.ray_address else "engine.ray_address",
    )
    return run_experiment(
        config,
        args.resume or args.out,
        resume=args.resume is not None,
        progress=not args.no_progress,
        secrets=_secrets(args, resuming=args.resume is not None),
    )


def cmd_flwr_run(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.flwr_app import FlowerApp, flower_engine, run_flower_app  # noqa: PLC0415
    from fedsim.results import RunWriter  # noqa: PLC0415

    _check_workers(args.workers)
    if args.num_supernodes < 1:
        raise ConfigError("--num-supernodes", args.num_supernodes, "an integer >= 1")
    _check_address(
        args.ray_address or os.environ.get("RAY_ADDRESS", ""),
        args.backend or "ray",
        "--ray-address",
    )
    engine = flower_engine(
        args.app_dir, ray_address=args.ray_address, workers=args.workers, backend=args.backend
    )
    secrets: list[RunSecret | None] = []

    def checked() -> None:  # the arguments are good: the workers start while the app imports
        RunWriter.check_new(args.out)
        secrets.append(_secrets(args))
        engine.start()

    try:
        app = FlowerApp.load(args.app_dir, args.run_config, checked=checked)
        return run_flower_app(
            app,
            args.num_supernodes,
            args.out,
            progress=not args.no_progress,
            engine=engine,
            secrets=secrets[0],
        )
    finally:
        engine.close()


def cmd_account(args: argparse.Namespace) -> int:
    """``fedsim account ...``: print the result as text, or as JSON with ``--json``."""
    try:
        result = account.run(args)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    print(dumps(result, indent=2) if args.json else account.format_text(result))
    return 0


def cmd_factorize(args: argparse.Namespace) -> int:
    """``fedsim factorize ...``: build or reuse the file, print its summary."""
    try:
        result = factorize.run(args)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    print(dumps(result, indent=2) if args.json else factorize.format_text(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "account":
        return cmd_account(args)
    if args.command == "factorize":
        return cmd_factorize(args)
    if args.command == "audit":
        return audit.run(args)
    if args.command == "minmax":
        return minmax.run(args)
    if not args.verbose:
        from flwr.supercore.logger import FLOWER_LOGGER  # noqa: PLC0415  (sets its level on import)

        FLOWER_LOGGER.setLevel(logging.WARNING)
    from fedsim.engine.rounds import RunStopped  # noqa: PLC0415  (Flower, only for runs)

    started = time.perf_counter()
    try:
        summary = cmd_run(args) if args.command == "run" else cmd_flwr_run(args)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # the rounds before it are on disk
        print(f"fedsim: error: {err}; earlier rounds: {args.out or args.resume}", file=sys.stderr)
        return 1
    out = Path(args.out or args.resume)
    print(
        f"fedsim: {summary.get('rounds', 0)} rounds in {time.perf_counter() - started:.1f} s; "
        f"results in {out / 'rounds.jsonl'} and {out / 'summary.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
