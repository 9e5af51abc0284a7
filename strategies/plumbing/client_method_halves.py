"""The server half of a client method, around any strategy (issue 28, point 5).

:class:`ServerHalfStrategy` wraps a strategy for one
:class:`~fedsim.workloads.client_method.ServerHalf`: ``configure_train`` adds the half's
record of the round to every train instruction (under :attr:`ServerHalf.key`);
``aggregate_train`` takes each successful reply's record of that key out (a reply without
one is an error) before the wrapped strategy aggregates, then lets the half change the new
global arrays. Replies carrying such records cannot be summed on workers.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.client_method import ServerHalf
from strategies.plumbing.wrapper import StrategyWrapper


class ServerHalfStrategy(StrategyWrapper):
    """``strategy`` with ``half`` talking to the clients (see the module docstring)."""

    def __init__(self, strategy: Strategy, half: ServerHalf) -> None:
        super().__init__(strategy)
        self.half = half

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        record = to_record(self.half.instruction(server_round, to_numpy(arrays)))
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        for message in messages:
            message.content[self.half.key] = record
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        key, records = self.half.key, []
        for reply in replies:
            if reply.has_error():
                continue
            if key not in reply.content:
                raise RuntimeError(
                    f"a train reply carries no record {key!r}: its client did not run the "
                    "client method's training, or its reply was folded on a worker"
                )
            records.append(to_numpy(reply.content.pop(key)))
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None or not records:
            return arrays, metrics
        return to_record(self.half.aggregate(server_round, records, to_numpy(arrays))), metrics
