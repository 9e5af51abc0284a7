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
LEAK_APPS = HERE / "apps" / "warm_leak"


def _query(engine: Any, reference: str, n: int, secrets: Any = None) -> list[Any]:
    from flwr.app import Message, RecordDict

    from fedsim.engine import ClientAppSource

    grid = engine.open_run(
        ClientAppSource(reference=reference, app_dir=str(LEAK_APPS)), n, secrets=secrets
    )
    nodes = sorted(grid.get_node_ids())
    replies = list(grid.send_and_receive([Message(RecordDict(), node, "query") for node in nodes]))
    grid.wait_idle()
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors:
        raise RuntimeError(errors[0])
    return replies


def leak_then_probe(engine_for_run: Any) -> dict[str, Any]:
    """Run 1: :mod:`leak_app` (with a secret root); run 2: :mod:`probe_app` on the same
    workers; what run 2 found and the worker pids of both runs."""
    first = engine_for_run()
    try:
        leaked = _query(first, "leak_app:app", 4, secrets=first.fresh_root())
        pids_1 = sorted(
            set(first.backend._get([a.ping.remote() for a in first.backend._actors], "ping"))
        )
    finally:
        first.close()
    second = engine_for_run()
    try:
        probed = _query(second, "probe_app:app", 4)
        found = sorted({f for r in probed for f in r.content["probe"]["found"] if f})
        pids_2 = sorted({int(r.content["probe"]["pid"]) for r in probed})
    finally:
        second.close()
    secrets = sorted({str(r.content["leak"]["secret"]) for r in leaked})
    return {"found": found, "pids_1": pids_1, "pids_2": pids_2, "secrets": len(secrets)}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def identical(out: Path) -> dict[str, Any]:
    """A small DP-FedAvg run twice on the warm pool, the pool stopped, then the same run cold:
    the digests of the three final models (model.npz) and whether the head is gone."""
    from run_dir_support import private, run

    from fedsim.engine.warm_pool import Head, down, up

    raw = private(seed=3, noise_multiplier=0.8)
    raw["engine"] = {"backend": "ray", "workers": 2, "num_cpus": 2}
    up(workers=2, num_cpus=2, idle_timeout_s=300)
    head = Head.load()
    try:
        warm = []
        for name in ("warm1", "warm2"):
            summary = run(raw, out / name)
            warm.append(
                {"digest": _digest(out / name / "model.npz"), "engine": summary.get("engine")}
            )
    finally:
        stopped = down()
    alive = head is not None and _group_alive(head.pid)
    os.environ["FEDSIM_WARM"] = "off"
    run(raw, out / "cold")
    return {
        "warm": [w["digest"] for w in warm],
        "cold": _digest(out / "cold" / "model.npz"),
        "stopped": stopped,
        "head_alive_after_down": alive,
        "head_recorded": head is not None,
    }


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def isolation(out: Path) -> dict[str, Any]:
    """:func:`leak_then_probe` on a warm pool's workers."""
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
