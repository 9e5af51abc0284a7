"""Benchmark: what importing fedsim and starting Ray cost, whole processes (docs/start-up.md).

Each measurement is a fresh interpreter, timed from outside: wall seconds, and CPU seconds
(user + system of the child and of every process it reaped, ``RUSAGE_CHILDREN``), median over
``--reps`` repetitions after one warm-up:

* ``import_cli``: ``python -c "import fedsim.cli"``; ``help``: ``python -m fedsim --help``;
* ``import_experiment``: ``import fedsim.frontend.experiment`` (a ``fedsim run``'s driver imports);
* ``import_ray``, ``import_torch``, ``import_torch_dynamo`` (``import torch, torch._dynamo``:
  what a process pays the first time it builds a torch optimiser);
* ``ray_start_stop``: ``ray.init`` as the engine starts it (``ensure_ray``), two bare actors,
  ``ray.shutdown``.

The load average before and after is stored with the result: wall time stretches with the
machine's load, CPU time far less. Writes ``startup.json`` next to this file.

    python experiments/bench/startup.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).with_name("startup.json")
RAY_START_STOP = """
import ray
from fedsim.engine.cluster import ensure_ray
ensure_ray(num_cpus=2)
@ray.remote
class Bare:
    def ping(self):
        return 1
actors = [Bare.remote() for _ in range(2)]
ray.get([a.ping.remote() for a in actors])
ray.shutdown()
"""
COMMANDS = {
    "import_cli": ["-c", "import fedsim.cli"],
    "help": ["-m", "fedsim", "--help"],
    "import_experiment": ["-c", "import fedsim.frontend.experiment"],
    "import_ray": ["-c", "import ray"],
    "import_torch": ["-c", "import torch"],
    "import_torch_dynamo": ["-c", "import torch, torch._dynamo"],
    "ray_start_stop": ["-c", RAY_START_STOP],
}


def timed(args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child interpreter running ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True)  # noqa: S603
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per command (>= 1)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    result: dict = {
        "cpus": os.cpu_count(),
        "repetitions": args.reps,
        "load_average_before": list(os.getloadavg()),
    }
    for name, command in COMMANDS.items():
        timed(command)  # warm-up: file caches
        runs = [timed(command) for _ in range(args.reps)]
        result[name] = {
            "wall_s": statistics.median(w for w, _ in runs),
            "cpu_s": statistics.median(c for _, c in runs),
            "all": {"wall_s": [w for w, _ in runs], "cpu_s": [c for _, c in runs]},
        }
        print(name, result[name]["wall_s"], result[name]["cpu_s"], file=sys.stderr, flush=True)
    result["load_average_after"] = list(os.getloadavg())
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
