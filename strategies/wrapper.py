"""A strategy that delegates everything to another: the base of strategy wrappers.

Wrappers (DP, worker-side sums, seeded sampling) change one or two of the
Message-API hooks and pass the others through; attributes they do not define
(``weighted_by_key``, ``arrayrecord_key``, ...) are read from the wrapped strategy.
Their ``start`` (what a Flower ServerApp calls) is
:func:`~strategies.recorded_start.recorded_start`: Flower's calls, with every round in the
run's records under fedsim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.app.metadata import Metadata
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.recorded_start import recorded_start


class StrategyWrapper(Strategy):
    """Delegates every hook to ``strategy``."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper itself.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start``, with every round reported to fedsim's records."""
        return recorded_start(
            self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
            evaluate_fn,
        )


def server_reply(content: RecordDict, server_round: int) -> Message:
    """A train reply made by the server itself (e.g. for a round in which no client
    replied, so that the wrapped strategy still applies the noised update)."""
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=0,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=0.0,
        ttl=0.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content=content, metadata=metadata)


def train_message(content: RecordDict, node: int, server_round: int) -> Message:
    """The server's train instruction ``content`` for ``node`` in ``server_round``."""
    return Message(
        content=content,
        dst_node_id=node,
        message_type=MessageType.TRAIN,
        group_id=str(server_round),
    )
