"""Start-up on a warm pool against a cold start, in one run.

Each measurement is a fresh process that runs one small experiment (the quickstart: digits,
a small CNN, one round of 10 of 60 clients, 2 Ray workers) through ``run_experiment`` and
reports the seconds from its call until round 1's line is in rounds.jsonl
(``attach_to_first_round_s``: importing and starting or attaching to Ray, the workers, the run's
set-up, the initial model's central evaluation and round 1), the whole call (``call_s``, with
the engine's teardown after the round) and the whole process (``process_s``, with the
interpreter's imports). Three kinds, in this order:

- ``cold``: ``FEDSIM_WARM=off``, a fresh local Ray per run (what every run paid before);
- ``first``: ``FEDSIM_WARM=on`` with no head up: the run starts the head and the pool;
- ``warm``: ``FEDSIM_WARM=auto`` with the head up: the run attaches to warm workers.

The pool is stopped (``fedsim down``) at the end, whatever happens. Writes warm_start.json
beside this file (``--out`` to change) with the medians and the ratios cold / warm.

    .venv/bin/python experiments/bench/warm_start.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _config() -> dict:
    from fedsim.config import load_toml

    raw = load_toml(ROOT / "experiments" / "quickstart" / "config.toml")
    raw["rounds"] = 1
    raw["data"]["num_clients"] = 60
    raw["client"]["epochs"] = 1
    raw["strategy"]["clients_per_round"] = 10
    raw["evaluation"].update(clients=5, every=1)
    raw["engine"] = {"backend": "ray", "workers": 2, "num_cpus": 2}
    return raw


def _first_round_on_disk(rounds: Path, began: float, seen: dict, done: threading.Event) -> None:
    """Poll ``rounds`` until it holds round 1's line; keep the seconds since ``began``."""
    while not done.is_set():
        if rounds.exists() and any(
            json.loads(line).get("round") == 1
            for line in rounds.read_text().splitlines()
            if line.strip()
        ):
            seen["s"] = time.perf_counter() - began
            return
        time.sleep(0.005)


def measure(out: str) -> None:
    """One run in this process; prints a JSON line: ``attach_to_first_round_s`` from the call
    of ``run_experiment`` until round 1's line is in rounds.jsonl (read by a watcher thread,
    as a user would see it), ``call_s`` the whole call (with the engine's teardown)."""
    from fedsim.frontend.experiment import run_experiment
    from fedsim.frontend.run_config import ExperimentConfig

    config = ExperimentConfig.from_dict(_config())
    seen: dict[str, float] = {}
    done = threading.Event()
    began = time.perf_counter()
    watcher = threading.Thread(
        target=_first_round_on_disk, args=(Path(out) / "rounds.jsonl", began, seen, done)
    )
    watcher.start()
    try:
        summary = run_experiment(config, out, progress=False, secrets=None)
    finally:
        seconds = time.perf_counter() - began
        done.set()
        watcher.join()
    if "s" not in seen:
        raise RuntimeError(f"round 1 never reached {out}/rounds.jsonl")
    print(
        "RESULT "
        + json.dumps(
            {
                "attach_to_first_round_s": seen["s"],
                "call_s": seconds,
                "engine_startup": summary["seconds"]["engine_startup"],
                "warm_pool": bool(summary["engine"].get("warm_pool")),
            }
        ),
        flush=True,
    )


def _child(mode: str, out: Path, env: dict) -> dict:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--measure", str(out)],
        env=dict(env, FEDSIM_WARM=mode),
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - began
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {mode} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["process_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "warm_start.json"))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: at least 1")
    from fedsim.engine.warm_pool import WARM_DIR_ENV, down

    work = Path(tempfile.mkdtemp(prefix="fedsim-warm-start-"))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env[WARM_DIR_ENV] = os.environ[WARM_DIR_ENV] = str(work / "warm")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    runs: dict[str, list[dict]] = {"cold": [], "first": [], "warm": []}
    load = [os.getloadavg()[0]]
    try:
        down()
        for rep in range(args.reps):
            runs["cold"].append(_child("off", work / f"cold{rep}", env))
        runs["first"].append(_child("on", work / "first", env))
        for rep in range(args.reps):
            runs["warm"].append(_child("auto", work / f"warm{rep}", env))
    finally:
        down()
        load.append(os.getloadavg()[0])

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    result = {
        "what": "one quickstart round (60 clients, 10 per round, 2 Ray workers), a process each",
        "reps": args.reps,
        "load_average": load,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    for kind in runs:
        result[f"{kind}_attach_to_first_round_s"] = round(
            median(kind, "attach_to_first_round_s"), 3
        )
        result[f"{kind}_call_s"] = round(median(kind, "call_s"), 3)
        result[f"{kind}_process_s"] = round(median(kind, "process_s"), 3)
    result["speedup_attach_to_first_round"] = round(
        result["cold_attach_to_first_round_s"] / result["warm_attach_to_first_round_s"], 2
    )
    result["speedup_process"] = round(result["cold_process_s"] / result["warm_process_s"], 2)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
