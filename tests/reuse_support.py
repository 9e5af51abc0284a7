"""Run 1 hides its clients' secrets in its workers, run 2 on the same worker processes looks
for them (tests/apps/warm_leak): shared by the attack tests on a reused Engine and on a warm
pool's workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LEAK_APPS = Path(__file__).resolve().parent / "apps" / "warm_leak"


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
