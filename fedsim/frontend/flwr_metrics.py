"""What a Flower strategy or ServerApp computes each round, handed to fedsim's round records.

Flower keeps a plain strategy's results in memory only: the Message API's
``Strategy.start`` (every strategy of ``flwr.serverapp.strategy``) files each round's
aggregated train and evaluate metrics and the ServerApp-side evaluation in the
:class:`~flwr.serverapp.strategy.Result` it returns; the legacy API
(``flwr.server.strategy.*`` under ``DefaultWorkflow``, ``SecAggPlusWorkflow`` or a
``server_fn``'s ``start_grid``) files them in the :class:`~flwr.server.History` of its
``LegacyContext`` or ``Server``. Inside :func:`recorded_metrics` every value filed there
also goes to a sink, as ``(server_round, section, values)``, with the sections of fedsim's
round lines (:mod:`fedsim.frontend.results`):

==========================================  ===========================================
Flower files it in                          section (``values``)
==========================================  ===========================================
``Result.train_metrics_clientapp``          ``aggregated`` (the MetricRecord's items)
``Result.evaluate_metrics_clientapp``       ``aggregated_evaluate``
``Result.evaluate_metrics_serverapp``       ``central``
``History.add_metrics_distributed_fit``     ``aggregated`` (the metrics dict)
``History.add_loss_distributed``            ``aggregated_evaluate`` (``{"loss": loss}``)
``History.add_metrics_distributed``         ``aggregated_evaluate``
``History.add_loss_centralized``            ``central`` (``{"loss": loss}``)
``History.add_metrics_centralized``         ``central``
==========================================  ===========================================

Values filed for one round in one section add up to one mapping (a later value of a name
replaces an earlier one), except that a legacy metric ``loss`` beside the round's loss of
another value is handed as ``metric:loss``: Flower keeps the two apart. Values are JSON's:
numbers, strings, lists of numbers (a ``bytes`` value as its hex digits).

The hooks are installed into Flower's classes once, on first use, and hand values on only
in the context (thread and task) that entered :func:`recorded_metrics`; anywhere else,
Flower's classes behave as they always do (a Flower run of the same process is untouched).
fedsim's own strategies report their rounds themselves (:mod:`strategies.plumbing.recorded_start`
builds Flower's ``Result`` class itself, which is not hooked).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import flwr.serverapp.strategy.strategy as _strategy_module
from flwr.server.history import History
from flwr.serverapp.strategy import Result

#: ``sink(server_round, section, values)``
MetricsSink = Callable[[int, str, dict[str, Any]], None]

_SINK: ContextVar[MetricsSink | None] = ContextVar("fedsim_flower_metrics", default=None)
_INSTALL = threading.Lock()
_installed = False

#: Result's dicts and the round-line section each one's values go to
RESULT_SECTIONS = {
    "train_metrics_clientapp": "aggregated",
    "evaluate_metrics_clientapp": "aggregated_evaluate",
    "evaluate_metrics_serverapp": "central",
}
#: History's methods: (section, the argument holding the values, whether it is a loss)
HISTORY_METHODS = {
    "add_metrics_distributed_fit": ("aggregated", False),
    "add_loss_distributed": ("aggregated_evaluate", True),
    "add_metrics_distributed": ("aggregated_evaluate", False),
    "add_loss_centralized": ("central", True),
    "add_metrics_centralized": ("central", False),
}
#: History's metrics methods and the list of losses filed in the same section
HISTORY_LOSSES = {
    "add_metrics_distributed": "losses_distributed",
    "add_metrics_centralized": "losses_centralized",
}


def plain(value: Any) -> Any:
    """``value`` as a JSON value (bytes as hex digits; numpy scalars and arrays as numbers)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return value.tolist()
    return value


def _values(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    return {} if metrics is None else {str(k): plain(v) for k, v in metrics.items()}


class _Filed(dict):
    """One of a Result's dicts: what is filed in it also goes to the sink (pickled and
    copied as a plain dict)."""

    def __init__(self, items: Mapping[int, Any], sink: MetricsSink, section: str) -> None:
        super().__init__(items)
        self._sink, self._section = sink, section

    def __setitem__(self, server_round: int, record: Any) -> None:
        super().__setitem__(server_round, record)
        if record is not None:
            self._sink(int(server_round), self._section, _values(record))

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


class _RecordedResult(Result):
    """Flower's Result, whose per-round dicts report to the sink of the context that made it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sink = _SINK.get()
        if sink is not None:
            for name, section in RESULT_SECTIONS.items():
                setattr(self, name, _Filed(getattr(self, name), sink, section))


def _history_values(history: History, name: str, server_round: int, metrics: Any) -> dict:
    """A legacy metrics dict as handed on: a metric ``loss`` beside the round's own loss of
    another value (Flower keeps them apart) as ``metric:loss``."""
    values = _values(metrics)
    losses = getattr(history, HISTORY_LOSSES.get(name, ""), None) or []
    own = [loss for r, loss in losses if r == server_round]
    if "loss" in values and own and values["loss"] != plain(own[-1]):
        values["metric:loss"] = values.pop("loss")
    return values


def _hooked(
    name: str, method: Callable[..., None], section: str, loss: bool
) -> Callable[..., None]:
    @functools.wraps(method)
    def add(self: History, server_round: int, *args: Any, **kwargs: Any) -> None:
        method(self, server_round, *args, **kwargs)
        sink = _SINK.get()
        if sink is None:
            return
        value = args[0] if args else kwargs["loss" if loss else "metrics"]
        values = (
            {"loss": plain(value)} if loss else _history_values(self, name, server_round, value)
        )
        sink(int(server_round), section, values)

    add.__fedsim_hooked__ = True  # type: ignore[attr-defined]
    return add


def _install() -> None:
    global _installed
    with _INSTALL:
        if _installed:
            return
        # Strategy.start builds its Result by this module's name
        _strategy_module.Result = _RecordedResult  # type: ignore[misc]
        for name, (section, loss) in HISTORY_METHODS.items():
            method = getattr(History, name)
            if not getattr(method, "__fedsim_hooked__", False):
                setattr(History, name, _hooked(name, method, section, loss))
        _installed = True


@contextmanager
def recorded_metrics(sink: MetricsSink) -> Iterator[None]:
    """While inside, what Flower's strategies and workflows file in a Result or History
    (this thread and task only) also goes to ``sink`` (see the module docstring)."""
    _install()
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)
