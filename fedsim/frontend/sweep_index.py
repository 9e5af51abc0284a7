"""A sweep's directory read back: ``DIR/index.json`` (written by ``fedsim sweep``) names its
points' run directories, so ``fedsim plot DIR`` and ``fedsim compare DIR`` read every point.

The index is data anyone may have handled, so it is checked before a path is taken from it:
a JSON object whose ``points`` is a list of objects, each with a ``name``, a ``status`` (one
of ``pending``, ``finished``, ``interrupted``, ``stopped``, ``failed``) and a ``run_dir`` that
is one directory name inside the sweep (no separator, not ``.`` or ``..``). A damaged index is
refused naming the file and the point. Points that have not run (pending, or failed before
their first round: no ``rounds.jsonl``) are left out and reported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedsim.config import ConfigError
from fedsim.results_json import ROUNDS_FILE
from fedsim.runfiles import RunFileError

INDEX_FILE = "index.json"
STATUSES = ("pending", "finished", "interrupted", "stopped", "failed")


@dataclass(frozen=True)
class RunDirs:
    """The run directories named on a command line, each sweep's points in its place, and
    the points left out (``"SWEEP/name (status)"``)."""

    paths: list[Path]
    left_out: list[str] = field(default_factory=list)
    sweeps: list[Path] = field(default_factory=list)


def is_sweep(path: Path) -> bool:
    """Whether ``path`` is a sweep's directory (an index, and no rounds of its own)."""
    return (path / INDEX_FILE).is_file() and not (path / ROUNDS_FILE).exists()


def sweep_points(sweep: Path) -> tuple[list[Path], list[str]]:
    """The run directories of the points of ``sweep`` that ran (in the index's order), and
    those left out; RunFileError naming index.json when it is damaged."""
    index = sweep / INDEX_FILE
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise RunFileError(index, f"is not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise RunFileError(index, "is not a sweep index (a JSON object with a list `points`)")
    ran, left_out, seen = [], [], set()
    for i, point in enumerate(data["points"]):
        if not isinstance(point, dict):
            raise RunFileError(index, f"points[{i}] is not a JSON object")
        for key in ("name", "run_dir", "status"):
            if not isinstance(point.get(key), str):
                raise RunFileError(index, f"points[{i}].{key} = {point.get(key)!r} (a string)")
        run_dir, status = point["run_dir"], point["status"]
        if run_dir in ("", ".", "..") or "/" in run_dir or "\\" in run_dir or "\0" in run_dir:
            raise RunFileError(
                index, f"points[{i}].run_dir = {run_dir!r} (one directory name inside the sweep)"
            )
        if status not in STATUSES:
            raise RunFileError(
                index, f"points[{i}].status = {status!r} (one of {', '.join(STATUSES)})"
            )
        if run_dir in seen:
            raise RunFileError(index, f"points[{i}].run_dir = {run_dir!r} is listed twice")
        seen.add(run_dir)
        path = sweep / run_dir
        if status == "pending" or not (path / ROUNDS_FILE).is_file():
            left_out.append(f"{sweep}/{run_dir} ({status})")
        else:
            ran.append(path)
    return ran, left_out


def expand_run_dirs(given: Sequence[str | Path]) -> RunDirs:
    """``given`` with each sweep directory replaced by its points that ran."""
    paths: list[Path] = []
    left_out: list[str] = []
    sweeps: list[Path] = []
    for item in given:
        path = Path(item)
        if path.is_dir() and is_sweep(path):
            ran, skipped = sweep_points(path)
            if not ran:
                raise ConfigError(
                    "RUN_DIR",
                    str(path),
                    f"a sweep with at least one point that ran (none has its {ROUNDS_FILE}: "
                    f"{', '.join(skipped) or 'the index lists no point'})",
                )
            paths += ran
            left_out += skipped
            sweeps.append(path)
        else:
            paths.append(path)
    return RunDirs(paths, left_out, sweeps)
