"""Scenarios on a warm pool (:mod:`fedsim.engine.warm_pool`), each run in its own process
(``python tests/warm_support.py SCENARIO OUT``) so that the pool's Ray connection never meets
the test session's Ray; each stops its pool (``fedsim down``) before it exits and prints one
JSON line of what it saw."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def identical(out: Path) -> dict[str, Any]:
    """A small DP-FedAvg run (one round) twice on the warm pool, the pool stopped, then the same
    run cold: the digests of the three final models (model.npz) and whether the head is gone.
    The second and the cold run replay the first (its nonce: the same noise streams; without it
    each run draws its own noise, as every run of one root must)."""
    from ray._private.utils import read_ray_address
    from run_dir_support import SECRETS, private

    from fedsim.engine.warm_pool import Head, down, up
    from fedsim.frontend.experiment import run_experiment
    from fedsim.frontend.run_config import ExperimentConfig

    raw = private(seed=3, noise_multiplier=0.8)
    raw["rounds"] = 1  # the claim is bit-identity, not training: one round of noise will do
    raw["engine"] = {"backend": "ray", "workers": 2, "num_cpus": 2}

    def run(name: str, replay: Path | None) -> dict[str, Any]:
        config = ExperimentConfig.from_dict(raw)
        return run_experiment(config, out / name, progress=False, secrets=SECRETS, replay=replay)

    # Ray's default record of "the current cluster" (/tmp/ray), which a plain ray.init() joins
    before = read_ray_address()
    up(workers=2, num_cpus=2, idle_timeout_s=300)
    head = Head.load()
    in_default_record = read_ray_address() not in (None, before)
    try:
        engines = [run("warm1", None).get("engine"), run("warm2", out / "warm1").get("engine")]
    finally:
        stopped = down()
    alive = head is not None and _group_alive(head.pid)
    os.environ["FEDSIM_WARM"] = "off"
    cold_engine = run("cold", out / "warm1").get("engine")
    return {
        "warm": [_digest(out / name / "model.npz") for name in ("warm1", "warm2")],
        "cold": _digest(out / "cold" / "model.npz"),
        "engines": engines + [cold_engine],
        "stopped": stopped,
        "head_alive_after_down": alive,
        "head_recorded": head is not None,
        "head_in_default_ray_record": in_default_record,
    }


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def isolation(out: Path) -> dict[str, Any]:
    """:func:`reuse_support.leak_then_probe` on a warm pool's workers."""
    from reuse_support import leak_then_probe

    from fedsim.engine import Engine, EngineConfig
    from fedsim.engine.warm_pool import down, up

    up(workers=2, num_cpus=2, idle_timeout_s=300)
    try:
        return leak_then_probe(lambda: Engine(EngineConfig(workers=2, warm="auto")).start())
    finally:
        down()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(HERE))
    result = {"identical": identical, "isolation": isolation}[scenario](out)
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
