"""An explicit JSON form for the ``dp_accounting`` events a fedsim ledger records.

``dp_accounting.DpEvent.to_named_tuple`` stores module and class names and imports them back
from the data; a checkpoint should not be able to name arbitrary classes. This module maps a
closed set of event classes to plain JSON objects and back, checking every field on the way in:

=============================================  ================================================
event                                          JSON object
=============================================  ================================================
``GaussianDpEvent(z)``                         ``{"type": "gaussian", "noise_multiplier": z}``
``PoissonSampledDpEvent(q, e)``                ``{"type": "poisson_sampled",
                                               "sampling_probability": q, "event": e}``
``SampledWithoutReplacementDpEvent(n, m, e)``  ``{"type": "sampled_without_replacement",
                                               "source_dataset_size": n, "sample_size": m,
                                               "event": e}``
``SelfComposedDpEvent(e, c)``                  ``{"type": "self_composed", "event": e,
                                               "count": c}``
``ComposedDpEvent([e, ...])``                  ``{"type": "composed", "events": [e, ...]}``
``NonPrivateDpEvent()``                        ``{"type": "non_private"}``
``NoOpDpEvent()``                              ``{"type": "no_op"}``
``ZCDpEvent(rho, 0)``                          ``{"type": "zcdp", "rho": rho, "xi": 0}``
=============================================  ================================================

Floats go through JSON as Python writes them (shortest round-tripping repr), so a round trip
gives the identical event and hence the identical epsilon. Ranges: noise multiplier ``z >= 0``
and finite (``z = 0`` means no noise), ``rho >= 0`` and finite, ``q`` in ``[0, 1]``,
``1 <= n``, ``0 <= m <= n``, ``count >= 0``.

Everything this module and :mod:`fedsim.privacy.accounting` know about an event class sits in
one row of :data:`KINDS` (:class:`EventKind`): its fields, which of them nest events, the
check of the others and how it reduces to one Gaussian noise multiplier. Supporting another
event class is one more row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa

from fedsim.config import ConfigError, require

#: the fields that nest events: one event ("event") or a list of events ("events")
EVENT, EVENTS = "event", "events"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_nothing(values: Mapping[str, Any], key: str) -> None:
    """Kinds without scalar fields."""


def _check_noise(values: Mapping[str, Any], key: str) -> None:
    value = values["noise_multiplier"]
    require(
        _is_number(value) and math.isfinite(value) and value >= 0,
        f"{key}.noise_multiplier",
        value,
        "a finite number >= 0 (noise std / L2 sensitivity; 0 means no noise)",
    )


def _check_zcdp(values: Mapping[str, Any], key: str) -> None:
    """rho-zCDP (Bun & Steinke 2016, Def. 1.1) under add/remove neighbours of one participant
    with L2 contribution ``C``; the accountants translate it (:mod:`fedsim.privacy.accountant`)
    and the RDP-curve equivalence they use needs ``xi = 0``."""
    value = values["rho"]
    require(
        _is_number(value) and math.isfinite(value) and value >= 0,
        f"{key}.rho",
        value,
        "a finite number >= 0 (rho of rho-zCDP under add/remove neighbours)",
    )
    require(values["xi"] == 0, f"{key}.xi", values["xi"], "0 (fedsim records rho-zCDP)")


def _check_probability(values: Mapping[str, Any], key: str) -> None:
    value = values["sampling_probability"]
    require(
        _is_number(value) and 0 <= value <= 1,
        f"{key}.sampling_probability",
        value,
        "a probability in [0, 1]",
    )


def _check_sizes(values: Mapping[str, Any], key: str) -> None:
    population, sample = values["source_dataset_size"], values["sample_size"]
    require(
        _is_int(population) and population >= 1,
        f"{key}.source_dataset_size",
        population,
        "an integer >= 1",
    )
    require(
        _is_int(sample) and 0 <= sample <= population,
        f"{key}.sample_size",
        sample,
        f"an integer in [0, {population}]",
    )


def _check_count(values: Mapping[str, Any], key: str) -> None:
    value = values["count"]
    require(_is_int(value) and value >= 0, f"{key}.count", value, "an integer >= 0")


def _gaussian_noise(event: Any, noise_of: Callable[[Any], float | None]) -> float | None:
    return float(event.noise_multiplier)


def _no_release(event: Any, noise_of: Callable[[Any], float | None]) -> float | None:
    return math.inf


def _repeated_noise(event: Any, noise_of: Callable[[Any], float | None]) -> float | None:
    z = noise_of(event.event)
    if z is None:
        return None
    return math.inf if event.count == 0 else z / math.sqrt(event.count)


def _composed_noise(event: Any, noise_of: Callable[[Any], float | None]) -> float | None:
    precision = 0.0  # sum of z^-2
    for sub in event.events:
        z = noise_of(sub)
        if z is None:
            return None
        if z == 0:
            return 0.0
        precision += z**-2
    return math.inf if precision == 0 else precision**-0.5


@dataclass(frozen=True)
class EventKind:
    """One supported event class and everything fedsim does with it.

    ``fields`` are the constructor's arguments in order (also the JSON object's order); a
    field named :data:`EVENT` holds an event, one named :data:`EVENTS` a list of them;
    ``check`` raises :class:`ConfigError` on a bad scalar field; ``noise``
    reduces the event to one Gaussian noise multiplier (given the reduction of a nested event;
    None: not a Gaussian composition); ``sampled``: a sampling wrapper, whose nested event is
    what sampling amplifies.
    """

    name: str
    cls: type[dpa.DpEvent]
    fields: tuple[str, ...] = ()
    check: Callable[[Mapping[str, Any], str], None] = _check_nothing
    noise: Callable[[Any, Callable[[Any], float | None]], float | None] | None = None
    sampled: bool = False

    def rebuild(self, event: dpa.DpEvent, inner: Callable[[dpa.DpEvent], dpa.DpEvent]):
        """``event`` with ``inner`` applied to each nested event (itself if it has none)."""
        if EVENT not in self.fields and EVENTS not in self.fields:
            return event
        return self.cls(*_mapped(self, {f: getattr(event, f) for f in self.fields}, inner))


def _mapped(kind: EventKind, values: Mapping[str, Any], inner: Callable[[Any], Any]) -> list:
    """The constructor arguments of ``kind`` from ``values``, ``inner`` applied to events."""
    out = []
    for field in kind.fields:
        value = values[field]
        if field == EVENT:
            value = inner(value)
        elif field == EVENTS:
            value = [inner(e) for e in value]
        out.append(value)
    return out


#: The event classes this module reads and writes (and a ledger accepts), by JSON type.
KINDS: dict[str, EventKind] = {
    kind.name: kind
    for kind in (
        EventKind(
            "gaussian",
            dpa.GaussianDpEvent,
            ("noise_multiplier",),
            check=_check_noise,
            noise=_gaussian_noise,
        ),
        EventKind(
            "poisson_sampled",
            dpa.PoissonSampledDpEvent,
            ("sampling_probability", "event"),
            check=_check_probability,
            sampled=True,
        ),
        EventKind(
            "sampled_without_replacement",
            dpa.SampledWithoutReplacementDpEvent,
            ("source_dataset_size", "sample_size", "event"),
            check=_check_sizes,
            sampled=True,
        ),
        EventKind(
            "self_composed",
            dpa.SelfComposedDpEvent,
            ("event", "count"),
            check=_check_count,
            noise=_repeated_noise,
        ),
        EventKind("composed", dpa.ComposedDpEvent, ("events",), noise=_composed_noise),
        EventKind("non_private", dpa.NonPrivateDpEvent),
        EventKind("no_op", dpa.NoOpDpEvent, noise=_no_release),
        EventKind("zcdp", dpa.ZCDpEvent, ("rho", "xi"), check=_check_zcdp),
    )
}
#: The event classes by JSON type.
EVENT_TYPES: dict[str, type[dpa.DpEvent]] = {name: kind.cls for name, kind in KINDS.items()}
_BY_CLASS = {kind.cls: kind for kind in KINDS.values()}
_ALLOWED = "one of the event types " + ", ".join(KINDS)


def kind_of(event: Any) -> EventKind | None:
    """The row of :data:`KINDS` for ``event``'s class (None: not a supported event)."""
    return _BY_CLASS.get(type(event))


def _check_list(kind: EventKind, values: Mapping[str, Any], key: str, lists: tuple) -> None:
    if EVENTS in kind.fields:
        events = values[EVENTS]
        require(isinstance(events, lists), f"{key}.{EVENTS}", events, "a list of events")


def check_event(event: Any, key: str = "event") -> None:
    """Raise :class:`ConfigError` unless ``event`` is a supported event with valid fields."""
    kind = kind_of(event)
    if kind is None:
        raise ConfigError(key, event, _ALLOWED)
    values = {f: getattr(event, f) for f in kind.fields}
    kind.check(values, key)
    _check_list(kind, values, key, (list, tuple))
    if EVENT in values:
        check_event(values[EVENT], f"{key}.{EVENT}")
    for i, sub in enumerate(values.get(EVENTS, ())):
        check_event(sub, f"{key}.{EVENTS}[{i}]")


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """The JSON-ready form of ``event`` (see the module docstring for the format)."""
    check_event(event)
    return _to_dict(event)


def _to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    kind = _BY_CLASS[type(event)]
    values = {f: getattr(event, f) for f in kind.fields}
    return {"type": kind.name, **dict(zip(kind.fields, _mapped(kind, values, _to_dict)))}


def event_from_dict(data: Any, key: str = "event") -> dpa.DpEvent:
    """Rebuild the event written by :func:`event_to_dict`, checking every field."""
    require(isinstance(data, Mapping), key, data, "a JSON object with a 'type' field")
    name = data.get("type")
    require(name in KINDS, f"{key}.type", name, _ALLOWED)
    kind = KINDS[name]
    fields = set(data) - {"type"}
    expected = set(kind.fields)
    for field in sorted(fields - expected):
        raise ConfigError(
            f"{key}.{field}",
            data[field],
            f"a known field of {name!r}: {sorted(expected) or 'none'}",
        )
    for field in sorted(expected - fields):
        raise ConfigError(f"{key}.{field}", None, "a value (this field is required)")
    kind.check(data, key)
    _check_list(kind, data, key, (list,))
    args = []
    for field in kind.fields:
        value = data[field]
        if field == EVENT:
            value = event_from_dict(value, f"{key}.{EVENT}")
        elif field == EVENTS:
            value = [event_from_dict(e, f"{key}.{EVENTS}[{i}]") for i, e in enumerate(value)]
        args.append(value)
    return kind.cls(*args)
