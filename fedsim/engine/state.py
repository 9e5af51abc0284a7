"""Per-client persistent state: each client's Flower ``context.state``.

The store is keyed by node id and lives with the grid; a client's state travels
with its batch to whichever worker runs it and comes back with the result, so it
follows the client across workers and rounds. Only clients that have state cost
anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from flwr.app import RecordDict


class ClientStateStore(ABC):
    """Maps node id to that client's ``context.state`` (a RecordDict)."""

    @abstractmethod
    def get_many(self, node_ids: Iterable[int]) -> dict[int, RecordDict]:
        """States of those ``node_ids`` that have one."""

    @abstractmethod
    def put_many(self, states: dict[int, RecordDict]) -> None:
        """Store (replace) the given states."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of clients with a stored state."""


class InMemoryStateStore(ClientStateStore):
    """States held in a dict in the driver process."""

    def __init__(self) -> None:
        self._states: dict[int, RecordDict] = {}

    def get_many(self, node_ids: Iterable[int]) -> dict[int, RecordDict]:
        states = self._states
        return {n: states[n] for n in node_ids if n in states}

    def put_many(self, states: dict[int, RecordDict]) -> None:
        for node_id, state in states.items():
            if state:
                self._states[node_id] = state
            else:
                self._states.pop(node_id, None)

    def __len__(self) -> int:
        return len(self._states)
