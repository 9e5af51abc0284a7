"""What the grid tells the run about each phase (one push of messages), and where a strategy
that runs its own round loop reports its rounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class PhaseReport:
    """What happened in one phase (one push of messages)."""

    phase: int
    server_round: int | None
    message_type: str
    messages: int
    succeeded: int
    failed: int
    timed_out: int
    dropped: int
    bytes_down: int
    bytes_up: int
    wall_s: float
    compute_s: float
    client_metrics: dict[str, float]
    #: the node ids the phase's messages went to (empty: not given)
    nodes: frozenset[int] = frozenset()
    #: the ``send_and_receive`` timeout the phase ran under (None: none)
    timeout_s: float | None = None


class PhaseObserver(Protocol):
    """Receives a report after each phase."""

    def phase_finished(self, report: PhaseReport) -> None: ...


class RoundLog(Protocol):
    """Where a strategy that runs its own round loop inside a ServerApp (``Strategy.start``)
    reports each round it finished, so the run's records hold what the strategy returned.

    ``open_rounds`` comes first: from then on the strategy closes every round itself
    (``end_round``, with its sections: aggregated metrics, privacy, ...), ``private`` says
    that the clients' own metrics stay out of the records unless ``metrics_in_clear``.
    ``end_run`` gives what the run's summary adds (the final privacy report, why it stopped).
    The values are the strategy's own (MetricRecords, dicts); the log makes them JSON.
    """

    def open_rounds(self, *, private: bool, metrics_in_clear: bool) -> None: ...

    def end_round(self, server_round: int, **sections: Any) -> None: ...

    def end_run(self, **summary: Any) -> None: ...
