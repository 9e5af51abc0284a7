"""What the round loop and the front end ask of a strategy, declared (issue 28, point 5).

A Flower strategy is driven by its Message-API hooks; fedsim's round loop and front end may
also ask it for a privacy report, whether a budget stops the run, to bind the grid or the
run's parties, and to close what it opened. Each of these is a runtime-checkable
:class:`~typing.Protocol` below, and a strategy takes part by implementing it (no attribute
is looked up by name). A wrapper (:class:`strategies.plumbing.wrapper.StrategyWrapper`) declares the
strategy it wraps with :class:`Wrapping`; :func:`layers` follows those links, and
:func:`find` gives the first layer of a wrapper chain that implements a protocol — the
object whose hook the front end calls (the outer layers change the Message-API hooks, not
these).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Wrapping(Protocol):
    """A strategy that wraps another one: ``strategy`` is the wrapped strategy."""

    @property
    def strategy(self) -> Any: ...


@runtime_checkable
class PrivacyReporting(Protocol):
    """A private strategy: it keeps a privacy ledger and reports it after each round."""

    def privacy_report(self) -> dict[str, Any]: ...


@runtime_checkable
class ClearMetrics(Protocol):
    """A strategy that says whether it releases its clients' own metrics un-noised."""

    metrics_in_clear: bool


@runtime_checkable
class Stoppable(Protocol):
    """A strategy whose privacy budget may end the run before its last round."""

    stop_reason: str | None

    def should_stop(self, server_round: int) -> bool: ...


@runtime_checkable
class Closable(Protocol):
    """A strategy that opened something (e.g. DMM's committee actors) closed after the run."""

    def close(self) -> None: ...


@runtime_checkable
class GridBound(Protocol):
    """A strategy that reads the grid before the first round (e.g. DP-FedAvg's sampling)."""

    def bind_grid(self, grid: Any) -> Any: ...


@runtime_checkable
class ServerSecretBound(Protocol):
    """A strategy that draws its noise from the server's secret."""

    def bind_server_secret(self, secret: Any) -> None: ...


@runtime_checkable
class CommitteeBound(Protocol):
    """A strategy run with a committee (DDGauss's): it says which, then gets it bound."""

    def committee_spec(self) -> Any: ...

    def bind_committee(self, committee: Any) -> None: ...


@runtime_checkable
class CommitteeHostBound(Protocol):
    """A strategy run with a committee host (DMM's): it gives the host's options, then gets
    it bound."""

    def committee_host_options(self) -> dict[str, Any]: ...

    def bind_committee_host(self, host: Any) -> None: ...


def layers(strategy: Any) -> Iterator[Any]:
    """``strategy``, then the strategy each :class:`Wrapping` layer wraps, outermost first."""
    seen: set[int] = set()
    current = strategy
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.strategy if isinstance(current, Wrapping) else None


def find(strategy: Any, protocol: type[T]) -> T | None:
    """The first layer of ``strategy``'s wrapper chain that implements ``protocol``, or None."""
    return next((layer for layer in layers(strategy) if isinstance(layer, protocol)), None)
