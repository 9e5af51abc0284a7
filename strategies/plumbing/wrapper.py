"""A strategy that delegates everything to another: the base of strategy wrappers.

Wrappers (DP, worker-side sums, seeded sampling) change one or two of the
Message-API hooks and pass the others through. A wrapper declares what it wraps
(:class:`fedsim.engine.hooks.Wrapping`: its ``strategy``) and forwards nothing else by name:
what callers read of the wrapped strategy's messages is declared here (:class:`MessageKeys`:
``arrayrecord_key``, ``weighted_by_key``, ``fraction_evaluate``, which a wrapper passes on as
properties), and the front end's hooks (privacy report, stop, close, ...) are the protocols of
:mod:`fedsim.engine.hooks`, found on the layer that implements them. Their ``start`` (what a
Flower ServerApp calls) is
:func:`~strategies.plumbing.recorded_start.recorded_start`: Flower's calls, with every round in the
run's records under fedsim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.app.metadata import Metadata
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.plumbing.recorded_start import recorded_start


@runtime_checkable
class MessageKeys(Protocol):
    """What a strategy of Flower's FedAvg family declares about its messages: the key of the
    global arrays, the metric its mean is weighted by, and the fraction it evaluates."""

    arrayrecord_key: str
    weighted_by_key: str
    fraction_evaluate: float


def arrayrecord_key(strategy: Strategy) -> str:
    """``strategy``'s key of the global arrays (Flower's default ``"arrays"`` when it
    declares none)."""
    return strategy.arrayrecord_key if isinstance(strategy, MessageKeys) else "arrays"


def weighted_by_key(strategy: Strategy) -> str:
    """The reply metric ``strategy`` weights its mean by (Flower's ``"num-examples"`` when
    it declares none)."""
    return strategy.weighted_by_key if isinstance(strategy, MessageKeys) else "num-examples"


def fraction_evaluate(strategy: Strategy) -> float:
    """The fraction of nodes ``strategy`` evaluates on (0: it declares no federated
    evaluation)."""
    return strategy.fraction_evaluate if isinstance(strategy, MessageKeys) else 0.0


class StrategyWrapper(Strategy):
    """Delegates every hook to ``strategy`` (declared: :class:`fedsim.engine.hooks.Wrapping`),
    and passes on its :class:`MessageKeys`."""

    strategy: Strategy  #: the wrapped strategy

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @property
    def arrayrecord_key(self) -> str:
        """The wrapped strategy's key of the global arrays."""
        return arrayrecord_key(self.strategy)

    @property
    def weighted_by_key(self) -> str:
        """The reply metric the wrapped strategy weights its mean by."""
        return weighted_by_key(self.strategy)

    @property
    def fraction_evaluate(self) -> float:
        """The fraction of nodes the wrapped strategy evaluates on."""
        return fraction_evaluate(self.strategy)

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
