"""``fedsim sweep CONFIG.toml --grid KEY=V1,V2 ... [--seeds 0..4] [--out DIR]``: a grid of runs.

The points are the cartesian product of the ``--grid`` values (in the order given) and the
``--seeds``; each is the config with its values as overrides
(:mod:`fedsim.frontend.config_overrides`, typed and checked like ``--set``), validated before
anything runs. Each point is one ordinary run directory, ``DIR/<point>`` (named from its values,
e.g. ``noise_multiplier=1.2,seed=3``), and ``DIR/index.json`` lists every point: its values, run
directory, status (``pending``, ``finished``, ``interrupted``, ``stopped``, ``failed``), rounds,
final metrics and ε (from the run's summary.json), rewritten after each point.

The points run one after the other on ONE engine: Ray is started (or joined) once and its
worker actors are reused by every run (:class:`~fedsim.engine.Engine` loads each run's
ClientApp, datasets and secret root on the workers when the run opens). Each point keeps its
own secret root: a fresh one kept under ``$FEDSIM_SECRETS_DIR`` (as ``fedsim run`` does), or
``--secrets-dir D``: ``D/<point>.hex``, created if missing. So the engine is shared, the
parties' secrets are not. ``[engine]`` keys are the sweep's, not a point's: a ``--grid`` over
them is refused.

Re-running the same command continues the sweep: a finished point (its summary.json written)
is skipped once its stored config is checked to be the point's config, an interrupted one is
resumed from its last checkpoint (``fedsim run --resume``), the others run. A run stopped by
its rounds (every client failed, a non-finite model) is marked ``stopped`` and the sweep goes
on; a config error stops the sweep (exit code 2).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config import ConfigError
from fedsim.frontend.sweep_index import INDEX_FILE

if TYPE_CHECKING:
    from fedsim.engine import Engine
    from fedsim.frontend.config_overrides import Override
    from fedsim.frontend.run_config import ExperimentConfig

SUMMARY_FILE = "summary.json"
#: the index's statuses
PENDING, FINISHED, INTERRUPTED, STOPPED, FAILED = (
    "pending",
    "finished",
    "interrupted",
    "stopped",
    "failed",
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._+\-=,\[\]]")


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a dotted key of the run config and its TOML value."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set strategy.options.noise_multiplier=1.2 "
        "--set seed=3 (TOML values, typed and checked like the file; repeatable)",
    )


def add_parser(subcommands: Any) -> None:
    """Register ``fedsim sweep`` (sets ``func``)."""
    parser = subcommands.add_parser(
        "sweep", help="run a config over a grid of values and seeds, one run directory each"
    )
    parser.add_argument("config", help="experiment TOML file")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a config key and its values (comma-separated TOML values; repeatable: the "
        "points are the cartesian product)",
    )
    parser.add_argument(
        "--seeds", default=None, help="run seeds: a range 0..4 (inclusive) or a list 0,2,5"
    )
    add_set_flag(parser)
    parser.add_argument(
        "--out", default=None, help="the sweep's directory (default: ./sweep-<config name>)"
    )
    parser.add_argument(
        "--secrets-dir",
        default=None,
        metavar="DIR",
        help="one secret root per point, DIR/<point>.hex (created if missing; outside --out); "
        "default: fresh roots kept under $FEDSIM_SECRETS_DIR",
    )
    parser.add_argument("--ray-address", default=None, help="join the Ray cluster at this address")
    parser.add_argument("--workers", type=int, default=None, help="worker actors")
    parser.add_argument("--backend", choices=("ray", "local"), default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


# -- parsing the flags ---------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces and quotes (``[1,2],[3]`` is two)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def parse_grid(token: str) -> list[Override]:
    """One ``--grid KEY=V1,V2`` as one override per value."""
    from fedsim.frontend.config_overrides import parse_override  # noqa: PLC0415

    key, sep, text = token.partition("=")
    values = split_values(text) if sep else []
    if not key.strip() or not values or any(not v for v in values):
        raise ConfigError("--grid", token, "KEY=V1,V2,... with at least one value, none empty")
    if key.strip().split(".")[0] == "engine":
        raise ConfigError(
            f"--grid {key.strip()}",
            text,
            "a key outside [engine]: the points of a sweep share one engine (set it with --set "
            "or --workers/--backend/--ray-address)",
        )
    overrides = [parse_override(f"{key}={v}", "--grid") for v in values]
    if len({json.dumps(o.value, sort_keys=True) for o in overrides}) != len(overrides):
        raise ConfigError("--grid", token, "distinct values (a value is listed twice)")
    return overrides


def parse_seeds(text: str) -> list[int]:
    """``0..4`` (0, 1, 2, 3, 4) or ``0,2,5``: distinct integers >= 0."""
    try:
        if ".." in text:
            low, high = (int(p) for p in text.split("..", 1))
            seeds = list(range(low, high + 1))
        else:
            seeds = [int(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError("--seeds", text, "a range such as 0..4 or a list such as 0,2,5") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(
            "--seeds",
            text,
            "at least one seed, each an integer >= 0, none twice (0..4: low <= high)",
        )
    return seeds


# -- the points ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One run of the sweep: its overrides (the grid's values and its seed), its name (the
    run directory's) and its validated config."""

    name: str
    overrides: tuple[Override, ...]
    config: ExperimentConfig

    @property
    def values(self) -> dict[str, Any]:
        return {o.key: o.value for o in self.overrides}


def _label(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return _UNSAFE.sub("_", text)


def point_name(overrides: tuple[Override, ...]) -> str:
    """``noise_multiplier=1.2,seed=3``: each key by its last part (its whole path when two
    keys of the sweep share the last part), then its value."""
    last = [o.parts[-1] for o in overrides]
    names = [(o.parts[-1] if last.count(o.parts[-1]) == 1 else o.key) for o in overrides]
    return ",".join(f"{n}={_label(o.value)}" for n, o in zip(names, overrides, strict=True))


def plan(config_path: str, sets: list[str], grids: list[str], seeds: str | None) -> list[Point]:
    """Every point of the sweep, each config validated before anything runs."""
    from fedsim.config import load_toml  # noqa: PLC0415
    from fedsim.frontend.config_overrides import (  # noqa: PLC0415
        build_config,
        check_distinct,
        parse_override,
        parse_overrides,
    )

    base = parse_overrides(sets)
    axes = [parse_grid(g) for g in grids]
    if seeds is not None:
        axes.append([parse_override(f"seed={s}", "--seeds") for s in parse_seeds(seeds)])
    if not axes:
        raise ConfigError("--grid", None, "at least one --grid KEY=V1,V2 or --seeds")
    check_distinct([*base, *(axis[0] for axis in axes)])
    raw = load_toml(config_path)
    points = []
    for combination in itertools.product(*axes):
        overrides = (*base, *combination)
        name = point_name(tuple(combination))
        points.append(Point(name, tuple(combination), build_config(raw, overrides)))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        clash = next(n for n in names if names.count(n) > 1)
        raise ConfigError("--grid", clash, "values that give each point its own directory name")
    return points


# -- running -------------------------------------------------------------------------------------


def status_of(run_dir: Path) -> str:
    """What a point's directory holds: a finished run, an interrupted one (rounds or a
    checkpoint written), or nothing yet (also a run refused before its first round, whose
    directory a new run takes over)."""
    from fedsim.checkpoint import checkpoint_files  # noqa: PLC0415

    if (run_dir / SUMMARY_FILE).is_file():
        return FINISHED
    rounds = run_dir / "rounds.jsonl"
    if (rounds.is_file() and rounds.stat().st_size > 0) or checkpoint_files(run_dir):
        return INTERRUPTED
    return PENDING


def index_entry(point: Point, out: Path, status: str, error: str | None = None) -> dict[str, Any]:
    """The index's line for ``point``: its values and, once finished, what its summary.json
    says (rounds, final metrics, ε)."""
    entry: dict[str, Any] = {
        "name": point.name,
        "values": point.values,
        "run_dir": point.name,
        "status": status,
    }
    summary_path = out / point.name / SUMMARY_FILE
    if status == FINISHED and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        privacy = summary.get("privacy") or {}
        entry.update(
            rounds=summary.get("rounds"),
            final=summary.get("final"),
            epsilon=privacy.get("epsilon"),
            delta=privacy.get("delta"),
            max_client_epsilon=summary.get("max_client_epsilon"),
            stopped_reason=summary.get("stopped_reason"),
        )
    if error is not None:
        entry["error"] = error
    return entry


def write_index(out: Path, sweep: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    from fedsim.results_json import dumps  # noqa: PLC0415
    from fedsim.runfiles import write_atomic  # noqa: PLC0415

    text = dumps({**sweep, "points": entries}, indent=2, sort_keys=True) + "\n"
    write_atomic(out / INDEX_FILE, text.encode())


def run_point(
    point: Point, out: Path, engine: Engine, secrets_dir: Path | None, progress: bool
) -> str:
    """Run or resume one point on ``engine`` (a finished one is checked, not run again);
    returns what was done: ``ran``, ``resumed`` or ``skipped``."""
    from fedsim.frontend.experiment import load_run_config, run_experiment  # noqa: PLC0415

    run_dir = out / point.name
    status = status_of(run_dir)
    # each point's root file (None: a fresh kept root); every point draws its own run nonce
    secrets = None if secrets_dir is None else secrets_dir / f"{point.name}.hex"
    if status != PENDING:  # the stored config must be this point's (an edited file is refused)
        load_run_config(run_dir, point.config, secrets)
    if status == FINISHED:
        return "skipped"
    resume = status == INTERRUPTED
    run_experiment(
        point.config, run_dir, resume=resume, progress=progress, engine=engine, secrets=secrets
    )
    return "resumed" if resume else "ran"


def sweep(
    points: list[Point],
    out: Path,
    engine: Engine,
    *,
    description: dict[str, Any],
    secrets_dir: Path | None = None,
    progress: bool = False,
    echo: Any = None,
) -> list[dict[str, Any]]:
    """Run every point in turn on ``engine`` (started at the first point that runs; the caller
    closes it), writing the index after each; returns the index's entries."""
    from fedsim.engine.rounds import RunStopped  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    entries = [index_entry(p, out, status_of(out / p.name)) for p in points]
    write_index(out, description, entries)
    for i, point in enumerate(points):
        try:
            done = run_point(point, out, engine, secrets_dir, progress)
            entries[i] = index_entry(point, out, FINISHED)
        except RunStopped as err:
            done, entries[i] = f"stopped: {err}", index_entry(point, out, STOPPED, str(err))
        except ConfigError as err:
            entries[i] = index_entry(point, out, FAILED, str(err))
            write_index(out, description, entries)
            raise
        except BaseException:  # interrupted: the directory resumes on the next invocation
            entries[i] = index_entry(point, out, status_of(out / point.name))
            write_index(out, description, entries)
            raise
        write_index(out, description, entries)
        if echo is not None:
            echo(f"[{i + 1}/{len(points)}] {point.name}: {done}{_result_text(entries[i])}")
    return entries


def _result_text(entry: dict[str, Any]) -> str:
    parts = []
    central = (entry.get("final") or {}).get("central") or {}
    if "accuracy" in central:
        parts.append(f"accuracy {central['accuracy']:.4f}")
    if entry.get("epsilon") is not None:
        parts.append(f"epsilon {entry['epsilon']:.4g}")
    return f" ({', '.join(parts)})" if parts else ""


def _secrets_dir(given: str | None, out: Path) -> Path | None:
    """``--secrets-dir``: outside the sweep's directory (whoever holds the run directories
    must not hold the parties' secrets)."""
    if given is None:
        return None
    path, home = Path(given).expanduser().resolve(), out.expanduser().resolve()
    if path == home or home in path.parents:
        raise ConfigError("--secrets-dir", given, f"a directory outside the sweep's {out}")
    return path


def run(args: argparse.Namespace) -> int:
    """``fedsim sweep``: exit 0 when every point finished, 1 when a run stopped, 2 on a bad
    flag or config."""
    from fedsim.engine import Engine  # noqa: PLC0415
    from fedsim.frontend.run_config import with_engine  # noqa: PLC0415

    try:
        if args.workers is not None and args.workers < 1:
            raise ConfigError("--workers", args.workers, "an integer >= 1")
        points = plan(args.config, args.set, args.grid, args.seeds)
        out = Path(args.out or f"sweep-{points[0].config.name}")
        engine_config = with_engine(
            points[0].config,
            ray_address=args.ray_address,
            workers=args.workers,
            backend=args.backend,
        ).engine
        description = {
            "config": str(args.config),
            "set": list(args.set),
            "grid": list(args.grid),
            "seeds": args.seeds,
        }
        secrets_dir = _secrets_dir(args.secrets_dir, out)
        engine = Engine(engine_config)
        try:
            entries = sweep(
                points,
                out,
                engine,
                description=description,
                secrets_dir=secrets_dir,
                progress=not (args.no_progress or args.quiet),
                echo=print,
            )
        finally:
            engine.close()
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    stopped = [e["name"] for e in entries if e["status"] != FINISHED]
    print(
        f"fedsim sweep: {len(entries) - len(stopped)} of {len(entries)} points finished; "
        f"index in {out / INDEX_FILE}"
    )
    return 1 if stopped else 0
