"""What leaves a secure-sum client outside the sum: nothing, unless ``metrics_in_clear``.

A client whose input enters a secure sum replies nothing data-dependent beside it. Federated
evaluation (each evaluating client's loss and accuracy) and per-client train metrics would reach
the server in the clear, so they are refused -- in the constructor (``fraction_evaluate`` > 0),
at ``configure_evaluate`` (a strategy that sends evaluate messages) and on the client -- unless
the run passes ``metrics_in_clear``. With it, a DP strategy (:class:`SecureReplies`: DDGauss,
DMM) records each such arrival as a ``NonPrivateDpEvent`` (epsilon becomes infinite; the
report's ``unaccounted``).

* :class:`ClearMetricsGate`: the refusal at ``configure_evaluate`` (FedAvg over a secure sum);
* :class:`SecureReplies`: the gate plus the ledger's answer to what arrives in the clear;
* :func:`check_evaluation`, :func:`register_evaluate`: the constructor's and the client's
  halves.
"""

from __future__ import annotations

import contextlib
import logging
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import dp_accounting as dpa
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedsim.engine.boundary import ClaimRefused, ReleaseBoundary
from strategies.plumbing.dp_shell import LedgerShell
from strategies.plumbing.wrapper import StrategyWrapper

log = logging.getLogger(__name__)



def evaluation_refusal(method: str) -> str:
    """The refusal of DP strategy ``method``'s federated evaluation: ``.format(what)``."""
    return (
        "{} with " + method + ": federated evaluation sends each evaluating client's un-noised "
        "loss and accuracy to the server; set fraction_evaluate = 0 ([evaluation] clients = 0), "
        "or pass metrics_in_clear=True ([privacy] metrics_in_clear = true), which makes epsilon "
        "infinite"
    )


def check_evaluation(fraction: object, metrics_in_clear: bool, refusal: str) -> None:
    """ValueError (``refusal.format("strategy.fraction_evaluate=...")``) when the wrapped
    strategy evaluates (``fraction`` > 0) without ``metrics_in_clear``."""
    if not metrics_in_clear and isinstance(fraction, int | float) and fraction > 0:
        raise ValueError(refusal.format(f"strategy.fraction_evaluate={fraction!r}"))


def client_refusal(method: str) -> str:
    """Why a DP strategy ``method``'s client refuses an evaluate message."""
    return (
        f"a {method} client answers no federated evaluation: it would send its un-noised loss "
        "and accuracy to the server (build the client app with metrics_in_clear=True to allow "
        "it; epsilon is then infinite)"
    )


def register_evaluate(
    app: ClientApp, inner: ClientApp, metrics_in_clear: bool, refusal: str
) -> None:
    """``app``'s evaluate handler: ``inner``'s with ``metrics_in_clear``, else a
    RuntimeError(``refusal``)."""

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        if not metrics_in_clear:
            raise RuntimeError(refusal)
        return inner(message, context)


class ClearMetricsGate(StrategyWrapper):
    """Refuses the wrapped strategy's evaluate messages unless ``metrics_in_clear``; the
    refusal is :meth:`evaluation_refused`'s."""

    metrics_in_clear: bool = False

    @abstractmethod
    def evaluation_refused(self, what: str) -> str:
        """Why ``what`` (e.g. "3 evaluate messages") is refused."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if messages and not self.metrics_in_clear:
            raise RuntimeError(self.evaluation_refused(f"{len(messages)} evaluate messages"))
        return messages


class SecureReplies(ClearMetricsGate, LedgerShell):
    """A DP strategy over a secure sum: evaluation is gated (:class:`ClearMetricsGate`) and
    any client content that reaches the server outside the sum makes epsilon infinite
    (:meth:`unaccounted_release`). Evaluation replies are claimed at the release boundary
    when the strategy holds one (``_boundary``)."""

    #: the method's name in refusals and warnings
    method: ClassVar[str]
    _boundary: ReleaseBoundary | None = None
    #: client content that reached the server outside the secure sum (epsilon = inf)
    unaccounted: list[str]

    def evaluation_refused(self, what: str) -> str:
        return evaluation_refusal(self.method).format(what)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        replies = list(replies)
        answered = sum(not reply.has_error() for reply in replies)
        if self._boundary is not None:  # consumed here: the ledger makes epsilon infinite
            for reply in replies:
                with contextlib.suppress(ClaimRefused):
                    self._boundary.claim([reply], self)
        if answered:
            self.unaccounted_release(server_round, f"evaluation metrics of {answered} clients")
        return self.strategy.aggregate_evaluate(server_round, replies)

    def unaccounted_release(self, server_round: int, what: str) -> None:
        """Client content reached the server outside the secure sum: epsilon is infinite."""
        self.ledger.record(server_round, dpa.NonPrivateDpEvent())
        self.unaccounted.append(f"round {server_round}: {what}")
        log.warning(
            "round %d: %s received %s: epsilon is now infinite", server_round, self.method, what
        )

    def unaccounted_details(self) -> dict[str, Any]:
        """The report's ``unaccounted`` entry (the count and the first), if any arrived."""
        if not self.unaccounted:
            return {}
        return {"unaccounted": {"releases": len(self.unaccounted), "first": self.unaccounted[0]}}
