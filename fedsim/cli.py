"""The ``fedsim`` command line.

    fedsim run CONFIG.toml --out DIR [--set KEY=VALUE ...]
    fedsim run [CONFIG.toml] --resume DIR [--set KEY=VALUE ...]
    fedsim sweep CONFIG.toml --grid KEY=V1,V2 ... [--seeds 0..4] [--set KEY=VALUE ...] [--out DIR]
    fedsim flwr-run APP_DIR [SUPERLINK] [--federation-config "k=v ..."] [--num-supernodes N]
                    [--run-config "k=v ..."] --out DIR
    fedsim account {dp-fedavg,dp-sgd,calibrate,sweep,matrix} ... [--json]
    fedsim factorize --kind KIND --rounds N [--bands B] [--participations K --min-sep S]
                     --out FILE.npz [--json]
    fedsim audit RUN_DIR [--attack loss|zlib|mink] [--members N] [--out FILE]
    fedsim minmax CONFIG.toml [--out DIR]
    fedsim plot RUN_DIR|SWEEP_DIR... [--metric NAME ...] [--band sd|ci95] [--per-seed]
                [--out FILE.png]
    fedsim compare RUN_DIR|SWEEP_DIR... [--json] [--per-seed] [--all]

``run`` and ``flwr-run`` accept ``--ray-address`` (join an existing Ray cluster), ``--workers``,
``--backend {ray,local}``, ``--no-progress``, ``--progress-every N|Ss`` and ``--secrets FILE``
(the run's secret root, kept outside DIR; created if missing); both write ``DIR/rounds.jsonl``
as rounds finish and ``DIR/summary.json`` at the end.

Every command takes ``--quiet`` (errors and the result only) and ``--verbose`` (debug logs,
Flower's and absl's included), before or after its name; ``fedsim --version`` prints the
version (:mod:`fedsim.commands.console`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.commands import account, audit, compare, factorize, minmax, plot, sweep, updown
from fedsim.commands.console import Verbosity, console, hush_ray
from fedsim.config import ConfigError, device_name
from fedsim.frontend.progress import Cadence
from fedsim.results_json import dumps

if TYPE_CHECKING:
    from fedsim.engine import CohortModel, Engine
    from fedsim.frontend.interrupt import Interrupted
    from fedsim.frontend.run_lock import RunLock
    from fedsim.randomness import RootSource


def _cadence(text: str) -> Cadence:
    try:
        return Cadence.parse(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


#: flags naming a path the command writes (or continues): an empty or blank one is refused
PATH_FLAGS = ("--out", "--resume")


def _path_flag(flag: str):
    """The argparse type of ``flag``: a non-empty path with no NUL (``''`` once ran a whole
    experiment in the current directory and failed at its end)."""

    def check(text: str) -> str:
        if not text.strip() or "\0" in text:
            raise argparse.ArgumentTypeError(
                str(ConfigError(flag, text, "a path: not empty, not blank, no NUL character"))
            )
        return text

    check.__name__ = flag  # what argparse's "invalid <type> value" would name
    return check


def _path_flags(parser: argparse.ArgumentParser) -> None:
    """Give every :data:`PATH_FLAGS` option of ``parser`` and its subcommands that takes a
    string the check of :func:`_path_flag`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _path_flags(sub)
            continue
        for flag in PATH_FLAGS:
            if flag in action.option_strings and action.type is None and action.nargs is None:
                action.type = _path_flag(flag)


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
    parser.add_argument(
        "--device",
        default=None,
        help="where clients train: cpu, cuda, cuda:N or mps (default: [engine] device, cpu)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--progress-every",
        metavar="N|Ss",
        type=_cadence,
        default=Cadence(),
        help="when stderr is not a terminal, a progress line every N rounds (default 1) or "
        "at most one per S seconds (e.g. 30s)",
    )
    parser.add_argument(
        "--secrets",
        metavar="FILE",
        default=None,
        help="the run's secret root (64 hex digits; created, mode 0600, if missing), outside "
        "the results directory; each run mixes a fresh public nonce into it, so two runs of "
        "one root draw independent noise (default: a fresh root, kept under "
        "$FEDSIM_SECRETS_DIR for --resume)",
    )
    if resumable:
        parser.add_argument(
            "--replay",
            metavar="DIR",
            default=None,
            help="repeat the noise streams of the earlier run in DIR (its root and nonce): the "
            "new run's releases are a copy of that run's, and its run.json and summary.json "
            "say so",
        )


def _version() -> str:
    try:
        return importlib.metadata.version("fedsim")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from fedsim import __version__  # noqa: PLC0415

        return __version__


def _output_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--quiet`` and ``--verbose`` on ``parser`` and, recursively, on its subcommands; below
    the top their default is left unset, so that a flag given before the command name stays."""
    default = {} if top else {"default": argparse.SUPPRESS}
    flags = {
        "--quiet": "only errors and the final result",
        "--verbose": "debug logs too (Flower's per-round log, absl, dp_accounting's warnings)",
    }
    for flag, text in flags.items():
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, action="store_true", help=text, **default)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _output_flags(sub, top=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fedsim {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a fedsim experiment config")
    run.add_argument("config", nargs="?", help="experiment TOML file (optional with --resume)")
    sweep.add_set_flag(run)
    _engine_args(run, resumable=True)
    _flwr_run_parser(commands)
    account.register(commands)
    sweep.add_parser(commands)
    factorize.register(commands)
    audit.register(commands)
    minmax.register(commands)
    plot.add_parser(commands)
    compare.add_parser(commands)
    updown.register(commands)
    _output_flags(parser, top=True)
    _path_flags(parser)
    return parser


def _flwr_run_parser(commands: Any) -> None:
    """``fedsim flwr-run``: a Flower app project on fedsim's engine, as ``flwr run`` takes it."""
    flwr_run = commands.add_parser("flwr-run", help="run a Flower app project on fedsim's engine")
    flwr_run.add_argument("app_dir", help="directory with the app's pyproject.toml")
    flwr_run.add_argument(
        "superlink",
        nargs="?",
        default=None,
        help="a local simulation SuperLink connection of $FLWR_HOME/config.toml or of the "
        "app's [tool.flwr.federations], as `flwr run APP SUPERLINK` (default: the default one)",
    )
    flwr_run.add_argument(
        "--federation",
        default=None,
        help="the same as SUPERLINK (a name of the app's [tool.flwr.federations], or a "
        "connection of $FLWR_HOME/config.toml)",
    )
    flwr_run.add_argument(
        "--federation-config",
        default=None,
        help='Flower\'s simulation config over its defaults, as `flwr run` takes it, e.g. '
        '"num-supernodes=10 client-resources-num-cpus=1" (replaces the connection\'s options)',
    )
    flwr_run.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help="virtual clients (default: Flower's simulation config)",
    )
    flwr_run.add_argument(
        "--client-cpus", type=float, default=None, help="Ray CPUs per client worker"
    )
    flwr_run.add_argument(
        "--client-gpus", type=float, default=None, help="Ray GPUs per client worker (fractional)"
    )
    flwr_run.add_argument(
        "--sampling",
        choices=("uniform", "poisson"),
        default=None,
        help="the engine draws each round's cohort (default: the grid offers every node)",
    )
    flwr_run.add_argument(
        "--clients-per-round", type=int, default=None, help="cohort size (expected, poisson)"
    )
    flwr_run.add_argument(
        "--seed", type=int, default=0, help="public seed (of the cohorts, with --public-cohorts)"
    )
    flwr_run.add_argument(
        "--public-cohorts",
        action="store_true",
        help="draw --sampling cohorts from --seed (every client can recompute them; epsilon is "
        "then accounted without amplification) instead of the server's secret",
    )
    flwr_run.add_argument(
        "--run-config",
        default=None,
        help='overrides of [tool.flwr.app.config], e.g. "num-server-rounds=5 lr=0.1"',
    )
    _engine_args(flwr_run)


def _check_workers(workers: int | None) -> None:
    if workers is not None and workers < 1:
        raise ConfigError("--workers", workers, "an integer >= 1")


def _check_address(address: str, backend: str, key: str) -> None:
    """Fail before any work when the Ray cluster to join does not answer."""
    from fedsim.engine.cluster import check_reachable  # noqa: PLC0415

    if backend == "ray" and address:
        check_reachable(address, key)


def _secrets(args: argparse.Namespace) -> RootSource:
    """Where a Flower app's parties find their root: ``--secrets`` (created if missing by a
    child process, never read here: :mod:`fedsim.frontend.root_keys`) with a fresh run nonce;
    without it, a fresh root a worker writes (None)."""
    from fedsim.frontend.root_keys import root_fingerprint  # noqa: PLC0415
    from fedsim.randomness import RootSource, new_nonce, outside_run_dir  # noqa: PLC0415

    if args.secrets is None:
        return None
    path = outside_run_dir(args.secrets, args.out)
    root_fingerprint(path, create=True, run_dir=args.out)
    return RootSource(str(path), new_nonce())


def _progress(args: argparse.Namespace) -> bool | Cadence:
    """Off with ``--no-progress`` or ``--quiet``; else at the ``--progress-every`` cadence."""
    return False if args.no_progress or args.quiet else args.progress_every


def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.frontend.config_overrides import (  # noqa: PLC0415
        load_config,
        parse_overrides,
        resume_config,
    )
    from fedsim.frontend.experiment import load_run_config, run_experiment  # noqa: PLC0415
    from fedsim.frontend.run_config import with_engine  # noqa: PLC0415

    _check_workers(args.workers)
    overrides = parse_overrides(args.set)
    if args.resume:
        from fedsim.frontend.run_root import authenticated_config  # noqa: PLC0415

        authenticated_config(args.resume, args.secrets)  # nothing of it is parsed before
        given = resume_config(args.resume, args.config, overrides)
        base = load_run_config(args.resume, given, args.secrets)
    elif args.config:
        base = load_config(args.config, overrides)
    else:
        raise ConfigError("CONFIG", None, "an experiment TOML file (or --resume DIR)")
    if args.device is not None:
        device_name(args.device, "--device")
    config = with_engine(
        base,
        ray_address=args.ray_address,
        workers=args.workers,
        backend=args.backend,
        device=args.device,
    )
    _check_address(
        config.engine.ray_address or os.environ.get("RAY_ADDRESS", ""),
        config.engine.backend,
        "--ray-address" if args.ray_address else "engine.ray_address",
    )
    if args.quiet and config.engine.backend == "ray":
        hush_ray()  # no "(raylet) A worker died ..." text for each injected crash
    return run_experiment(
        config,
        args.resume or args.out,
        resume=args.resume is not None,
        progress=_progress(args),
        secrets=args.secrets,
        replay=args.replay,
    )


def _check_flwr_run(args: argparse.Namespace) -> None:
    """``fedsim flwr-run``'s flags that need no app, checked before anything starts."""
    _check_workers(args.workers)
    if args.num_supernodes is not None and args.num_supernodes < 1:
        raise ConfigError("--num-supernodes", args.num_supernodes, "an integer >= 1")
    _check_address(
        args.ray_address or os.environ.get("RAY_ADDRESS", ""),
        args.backend or "ray",
        "--ray-address",
    )
    if args.device is not None:
        device_name(args.device, "--device")
    if args.quiet and (args.backend or "ray") == "ray":
        hush_ray()


def _federation_name(args: argparse.Namespace) -> str | None:
    """The federation SUPERLINK or ``--federation`` names (None: the default one)."""
    if args.superlink and args.federation and args.superlink != args.federation:
        raise ConfigError(
            "--federation", args.federation, f"nothing, or the same as SUPERLINK ({args.superlink})"
        )
    return args.superlink or args.federation


def _starter(args: argparse.Namespace, started: list, locks: list) -> Callable[[Any], None]:
    """What ``FlowerApp.load`` calls once the app's federation is chosen: the run's lock
    (into ``locks``), then its engine started (into ``started``, with the federation, the
    cohort model and the secrets)."""
    from fedsim.frontend.flwr_app import cohort_model, flower_engine  # noqa: PLC0415
    from fedsim.frontend.flwr_federation import Federation, with_flags  # noqa: PLC0415
    from fedsim.frontend.results import RunWriter  # noqa: PLC0415
    from fedsim.frontend.run_lock import RunLock  # noqa: PLC0415

    def checked(chosen: Federation) -> None:
        # the arguments are good: the workers start while the app's modules import
        federation = with_flags(
            chosen,
            num_supernodes=args.num_supernodes,
            client_cpus=args.client_cpus,
            client_gpus=args.client_gpus,
        )
        n = federation.num_supernodes
        cohorts = cohort_model(args.sampling, args.clients_per_round, n, args.seed)
        locks.append(RunLock.acquire(args.out, "--out", "fedsim flwr-run"))  # one writer
        RunWriter.check_new(args.out)
        secrets = _secrets(args)
        engine = flower_engine(
            args.app_dir,
            ray_address=args.ray_address,
            workers=args.workers,
            backend=args.backend,
            device=args.device,
            client_cpus=federation.client_cpus,
            client_gpus=federation.client_gpus,
            ray_cpus=federation.ray_cpus,
        )
        started.append((engine, federation, cohorts, secrets))
        engine.start()

    return checked


def cmd_flwr_run(args: argparse.Namespace) -> dict[str, Any]:
    from fedsim.frontend.flwr_app import (  # noqa: PLC0415
        FlowerApp,
        run_flower_app,
    )
    from fedsim.frontend.flwr_federation import Federation  # noqa: PLC0415

    _check_flwr_run(args)
    started: list[tuple[Engine, Federation, CohortModel | None, RootSource | None]] = []
    locks: list[RunLock] = []
    checked = _starter(args, started, locks)
    name = _federation_name(args)
    try:
        app = FlowerApp.load(
            args.app_dir,
            args.run_config,
            name,
            checked=checked,
            federation_config=args.federation_config,
        )
        engine, federation, cohorts, secrets = started[0]
        return run_flower_app(
            app,
            federation.num_supernodes,
            args.out,
            progress=_progress(args),
            engine=engine,
            secrets=secrets,
            participation=cohorts,
            public_cohorts=args.public_cohorts,
        )
    finally:
        for engine, *_ in started:
            engine.close()
        for lock in locks:
            lock.release()


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


def stopped_early(summary: dict[str, Any]) -> str | None:
    """One line for a run its strategy ended before its last round (the privacy budget's
    ``max_epsilon``, a factorization's length), with the epsilon it ended at; None for a
    run that ran every round."""
    reason = summary.get("stopped_reason")
    if not reason:
        return None
    planned = (summary.get("config") or {}).get("rounds")
    of = f" of {planned}" if planned is not None else ""
    privacy = summary.get("privacy") or {}
    epsilon = privacy.get("epsilon")
    at = ""
    if isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool):
        delta = privacy.get("delta")
        at = f" at epsilon = {epsilon:.6g}" + (
            f" (delta = {delta:g})" if isinstance(delta, (int, float)) else ""
        )
    what = "the privacy budget" if reason.startswith("max_epsilon") else "its strategy"
    return (
        f"fedsim: STOPPED EARLY by {what} after round {summary.get('rounds', 0)}{of}{at}: "
        f"{reason}"
    )


def _program() -> list[str]:
    """How this process was started, to repeat it: ``python -m fedsim`` (this interpreter)
    when run as a module, else the ``fedsim`` command."""
    if Path(sys.argv[0]).name == "__main__.py":
        return [sys.executable, "-m", "fedsim"]
    return ["fedsim"]


def resume_command(args: argparse.Namespace) -> str:
    """The shell command that continues the ``fedsim run`` of ``args`` (its directory and,
    when one was given, its ``--secrets`` file: the saved config holds the rest)."""
    parts = [*_program(), "run", "--resume", args.resume or args.out]
    if args.secrets is not None:
        parts += ["--secrets", args.secrets]
    return shlex.join(parts)


def _interrupted(args: argparse.Namespace, err: Interrupted) -> str:
    """The one line a stopped ``fedsim run`` prints: what is kept, and how to continue."""
    from fedsim.checkpoint import CONFIG_FILE, checkpoint_files, round_of  # noqa: PLC0415

    out = Path(args.resume or args.out)
    if not (out / CONFIG_FILE).is_file():
        return (
            f"fedsim: stopped by {err.signal_name} before the run started; nothing to resume "
            "(run the same command again)"
        )
    if not err.at_once:
        kept = f"rounds up to {err.server_round} and their checkpoint are kept in {out}"
    else:
        files = checkpoint_files(out)
        kept = (
            f"the round in progress was abandoned; {out} keeps its rounds up to the checkpoint "
            f"of round {round_of(files[0])}"
            if files
            else f"the round in progress was abandoned before any checkpoint; {out} resumes "
            "from round 1"
        )
        kept = f"{kept} (a second {err.signal_name} stopped it at once)"
    return f"fedsim: stopped by {err.signal_name}; {kept}; to continue: {resume_command(args)}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quiet and args.verbose:
        parser.error("--quiet and --verbose exclude each other")
    verbosity = (
        Verbosity.QUIET if args.quiet else Verbosity.VERBOSE if args.verbose else Verbosity.NORMAL
    )
    with console(verbosity):
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "func", None) is not None:  # commands that set their handler
        return args.func(args)
    if args.command == "account":
        return cmd_account(args)
    if args.command == "factorize":
        return cmd_factorize(args)
    if args.command == "audit":
        return audit.run(args)
    if args.command == "minmax":
        return minmax.run(args)
    from fedsim.frontend.interrupt import stop_requests  # noqa: PLC0415

    started = time.perf_counter()
    # fedsim run: Ctrl-C / SIGTERM stop after the round in progress, a second one at once
    stops = stop_requests(announce=not args.quiet) if args.command == "run" else None
    with stops or contextlib.nullcontext():  # held until the last line is printed
        return _run_command(args, started)


def _run_command(args: argparse.Namespace, started: float) -> int:
    from fedsim.engine.message_types import UnsupportedMessage  # noqa: PLC0415  (Flower, only for runs)
    from fedsim.engine.rounds import RunStopped  # noqa: PLC0415  (Flower, only for runs)
    from fedsim.frontend.interrupt import EXIT_INTERRUPTED, Interrupted  # noqa: PLC0415

    try:
        summary = cmd_run(args) if args.command == "run" else cmd_flwr_run(args)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    except UnsupportedMessage as err:  # the ServerApp sent what no ClientApp runs
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # the rounds before it are on disk
        print(f"fedsim: error: {err}; earlier rounds: {args.out or args.resume}", file=sys.stderr)
        return 1
    except Interrupted as err:  # fedsim run: resumable
        print(_interrupted(args, err), file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # fedsim flwr-run: a Flower app's run has no --resume
        print(
            f"fedsim: interrupted; the rounds written so far are in {args.out} "
            "(a Flower app's run cannot be resumed: run it again into a new --out)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    out = Path(args.out or args.resume)
    stopped = stopped_early(summary)
    if stopped:
        print(stopped)
    print(
        f"fedsim: {summary.get('rounds', 0)} rounds in {time.perf_counter() - started:.1f} s; "
        f"results in {out / 'rounds.jsonl'} and {out / 'summary.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
