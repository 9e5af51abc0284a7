"""The Grid a ServerApp and its strategies get: Flower's interface, no engine internals.

:class:`AppGrid` wraps the engine's :class:`~fedsim.engine.grid.SimulationGrid` and forwards
exactly the methods of :class:`flwr.serverapp.Grid` (``set_run``, ``run``, ``create_message``,
``get_node_ids``, ``push_messages``, ``pull_messages``, ``send_and_receive``) plus the one fedsim
extension a strategy may use, :class:`FedsimGridExtension` (declare a phase's round, read the
public cohort model, report rounds to the run's log, claim replies at the release boundary).
The backend, the workers, the state store
and the fault schedule are not attributes of it.

Hiding attributes is interface hygiene, not isolation: Python code in the driver can reach any
object of the driver. What keeps clients' secrets from the server is that the driver holds none
(:mod:`fedsim.engine.backend`: the workers open the root file themselves), which
``tests/attacks/test_secrets.py`` checks by searching every object of the driver's process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["AppGrid", "FedsimGridExtension"]


@runtime_checkable
class FedsimGridExtension(Protocol):
    """What fedsim's grid offers beyond Flower's (strategies look each up with ``getattr``, so
    they run on Flower's own grids too).

    ``begin_phase(server_round, kind)`` declares the next phase (kind 0: train, 1: evaluate) so
    the engine draws that round's cohort; ``participation`` is the public cohort model the grid
    offers nodes from (None: every node); ``round_log`` receives the rounds of a strategy that
    runs its own loop (None: nowhere); ``boundary`` is the run's release boundary
    (:class:`fedsim.engine.boundary.ReleaseBoundary`), where accounted mechanisms claim the
    replies they consumed.
    """

    def begin_phase(self, server_round: int, kind: int) -> None: ...

    @property
    def participation(self) -> Any: ...

    @property
    def round_log(self) -> Any: ...

    @property
    def boundary(self) -> Any: ...


class AppGrid(Grid):
    """Flower's :class:`~flwr.serverapp.Grid` over an engine grid, with nothing else exposed."""

    __slots__ = ("__engine",)

    def __init__(self, engine_grid: Grid) -> None:
        self.__engine = engine_grid

    # -- flwr.serverapp.Grid ------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self.__engine.set_run(run)

    @property
    def run(self) -> Run:
        return self.__engine.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.__engine.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.__engine.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.__engine.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.__engine.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.__engine.send_and_receive(messages, timeout=timeout)

    # -- FedsimGridExtension ------------------------------------------------------------
    def begin_phase(self, server_round: int, kind: int) -> None:
        declare = getattr(self.__engine, "begin_phase", None)
        if declare is not None:
            declare(server_round, kind)

    @property
    def participation(self) -> Any:
        return getattr(self.__engine, "participation", None)

    @property
    def round_log(self) -> Any:
        return getattr(self.__engine, "round_log", None)

    @property
    def boundary(self) -> Any:
        return getattr(self.__engine, "boundary", None)

    def __repr__(self) -> str:
        return f"AppGrid(run_id={self.run.run_id})"
