"""The grid's book-keeping of one phase (one push of messages): its batches, their replies,
the worker folds in batch order, and the round a message belongs to."""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, RecordDict

from fedsim.record_codec import records_of
from fedsim.worker_reduce import Accumulator, MetricSums, Reducer, ReductionError


def server_round_of(content: RecordDict, group_id: str) -> int | None:
    """The FL round a message belongs to: a ConfigRecord's ``server-round`` (as
    Flower's strategies set it), else a numeric ``group_id``."""
    for _, record in records_of(content, ConfigRecord):
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return int(group_id) if group_id.isdigit() else None


class OrderedFold:
    """Folds the partial replies of a content group's batches in batch order.

    Batches finish in any order; folding them in batch order (each batch's chunk partials
    in chunk order) folds the chunk partials in chunk order, which makes the result
    independent of scheduling and of how chunks were spread over batches, so a run is
    reproducible to the bit on any backend. The strategy
    receives one reply for the whole group. If a reducer cannot fold (it raised
    :class:`ReductionError`), the replies are passed on unfolded.
    """

    def __init__(self, reducer: Reducer, instruction: RecordDict) -> None:
        self.accumulator: Accumulator | None = reducer.accumulator(instruction)
        self.order: list[int] = []
        self._next = 0
        self._ready: dict[int, list[Message]] = {}
        self._seen: list[Message] = []

    def add(self, batch_id: int, replies: list[Message]) -> None:
        """The successful replies of one batch (a partial reply, normally)."""
        self._ready[batch_id] = replies
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._fold(self._ready.pop(self.order[self._next]))
            self._next += 1

    def _fold(self, replies: list[Message]) -> None:
        self._seen.extend(replies)
        if self.accumulator is None:
            return
        try:
            for reply in replies:
                self.accumulator.add(reply)
        except ReductionError:
            self.accumulator = None

    def result(self) -> list[Message]:
        """The folded reply (batches that never finished are left out)."""
        for batch_id in self.order[self._next :]:
            if batch_id in self._ready:
                self._fold(self._ready.pop(batch_id))
        self._next = len(self.order)
        if not self._seen:
            return []
        if self.accumulator is None:
            return self._seen
        return [self.accumulator.result()]


@dataclass
class Phase:
    """Book-keeping for one push of messages."""

    index: int
    round: int  # the round its writes to the state store are filed under
    message_type: str
    server_round: int | None
    message_ids: list[str]
    nodes: frozenset[int]
    started: float
    bytes_down: int
    batch_ids: list[int] = field(default_factory=list)
    results: dict[int, list[Message]] = field(default_factory=dict)
    batch_messages: dict[int, set[str]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    folds: dict[int, OrderedFold] = field(default_factory=dict)
    succeeded: int = 0
    failed: int = 0
    late: int = 0
    dropped: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    metrics: MetricSums = field(default_factory=MetricSums)
    closed: bool = False
    timeout_s: float | None = None
    #: batches still running when a ``send_and_receive`` timeout closed the phase: their
    #: replies, late for that call, stay for ``pull_messages`` (as in Flower's LinkState)
    overdue: set[int] = field(default_factory=set)
    #: perf_counter time after which unpulled replies expire (the messages' longest TTL)
    expires: float = float("inf")
