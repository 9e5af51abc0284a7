"""A ServerApp that pulls a reply late for its ``send_and_receive`` (kept for
``pull_messages`` until its TTL, as in Flower) gets client content like any other reply:
the release boundary counts it, so it can never reach the server unaccounted."""

from __future__ import annotations

import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1] / "apps" / "timeout"
sys.path.insert(0, str(APP_DIR))
sys.path.insert(0, str(APP_DIR.parents[1]))

import slow_app  # noqa: E402
from engine.test_grid_timeout import SLOW, timed_messages  # noqa: E402


def test_a_late_reply_pulled_afterwards_passes_the_release_boundary(ray_engine):
    grid = ray_engine.open_run(SLOW, slow_app.NODES)
    timed = timed_messages(slow_app.NODES, 2.0)
    replies = grid.send_and_receive(timed, timeout=1.0)
    assert len(replies) == slow_app.NODES - 1
    assert grid.boundary.unaccounted() == {"train": slow_app.NODES - 1}
    grid.wait_idle()
    pulled = grid.pull_messages([timed[slow_app.SLOW].metadata.message_id])
    assert [r.content["metrics"]["pid"] for r in pulled] == [slow_app.SLOW]
    # the server now holds the slow client's content too: counted, never silently finite
    assert grid.boundary.unaccounted() == {"train": slow_app.NODES}
