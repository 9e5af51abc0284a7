"""Contract suites: every implementation of an interface, found in the tree, held to one
suite (:mod:`contracts.discovery`)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Messages built outside a runtime need the process's task identity (Flower)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
