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
=============================================  ================================================

Floats go through JSON as Python writes them (shortest round-tripping repr), so a round trip
gives the identical event and hence the identical epsilon. Ranges: noise multiplier ``z >= 0``
and finite (``z = 0`` means no noise), ``q`` in ``[0, 1]``, ``1 <= n``, ``0 <= m <= n``,
``count >= 0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import dp_accounting as dpa

from fedsim.config import ConfigError, require

#: The event classes this module reads and writes (and a ledger accepts).
EVENT_TYPES: dict[str, type[dpa.DpEvent]] = {
    "gaussian": dpa.GaussianDpEvent,
    "poisson_sampled": dpa.PoissonSampledDpEvent,
    "sampled_without_replacement": dpa.SampledWithoutReplacementDpEvent,
    "self_composed": dpa.SelfComposedDpEvent,
    "composed": dpa.ComposedDpEvent,
    "non_private": dpa.NonPrivateDpEvent,
    "no_op": dpa.NoOpDpEvent,
}
_NAMES = {cls: name for name, cls in EVENT_TYPES.items()}
_ALLOWED = "one of the event types " + ", ".join(EVENT_TYPES)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_noise(value: Any, key: str) -> None:
    require(
        _is_number(value) and math.isfinite(value) and value >= 0,
        key,
        value,
        "a finite number >= 0 (noise std / L2 sensitivity; 0 means no noise)",
    )


def _check_probability(value: Any, key: str) -> None:
    require(_is_number(value) and 0 <= value <= 1, key, value, "a probability in [0, 1]")


def _check_sizes(population: Any, sample: Any, key: str) -> None:
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


def _check_count(value: Any, key: str) -> None:
    require(_is_int(value) and value >= 0, key, value, "an integer >= 0")


def check_event(event: Any, key: str = "event") -> None:
    """Raise :class:`ConfigError` unless ``event`` is a supported event with valid fields."""
    name = _NAMES.get(type(event))
    if name is None:
        raise ConfigError(key, event, _ALLOWED)
    if name == "gaussian":
        _check_noise(event.noise_multiplier, f"{key}.noise_multiplier")
    elif name == "poisson_sampled":
        _check_probability(event.sampling_probability, f"{key}.sampling_probability")
        check_event(event.event, f"{key}.event")
    elif name == "sampled_without_replacement":
        _check_sizes(event.source_dataset_size, event.sample_size, key)
        check_event(event.event, f"{key}.event")
    elif name == "self_composed":
        _check_count(event.count, f"{key}.count")
        check_event(event.event, f"{key}.event")
    elif name == "composed":
        require(
            isinstance(event.events, (list, tuple)),
            f"{key}.events",
            event.events,
            "a list of events",
        )
        for i, sub in enumerate(event.events):
            check_event(sub, f"{key}.events[{i}]")


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """The JSON-ready form of ``event`` (see the module docstring for the format)."""
    check_event(event)
    return _to_dict(event)


def _to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    name = _NAMES[type(event)]
    if name == "gaussian":
        return {"type": name, "noise_multiplier": event.noise_multiplier}
    if name == "poisson_sampled":
        return {
            "type": name,
            "sampling_probability": event.sampling_probability,
            "event": _to_dict(event.event),
        }
    if name == "sampled_without_replacement":
        return {
            "type": name,
            "source_dataset_size": event.source_dataset_size,
            "sample_size": event.sample_size,
            "event": _to_dict(event.event),
        }
    if name == "self_composed":
        return {"type": name, "event": _to_dict(event.event), "count": event.count}
    if name == "composed":
        return {"type": name, "events": [_to_dict(e) for e in event.events]}
    return {"type": name}  # non_private, no_op


_FIELDS = {
    "gaussian": {"noise_multiplier"},
    "poisson_sampled": {"sampling_probability", "event"},
    "sampled_without_replacement": {"source_dataset_size", "sample_size", "event"},
    "self_composed": {"event", "count"},
    "composed": {"events"},
    "non_private": set(),
    "no_op": set(),
}


def event_from_dict(data: Any, key: str = "event") -> dpa.DpEvent:
    """Rebuild the event written by :func:`event_to_dict`, checking every field."""
    require(isinstance(data, Mapping), key, data, "a JSON object with a 'type' field")
    name = data.get("type")
    require(name in EVENT_TYPES, f"{key}.type", name, _ALLOWED)
    fields = set(data) - {"type"}
    expected = _FIELDS[name]
    for field in sorted(fields - expected):
        raise ConfigError(
            f"{key}.{field}",
            data[field],
            f"a known field of {name!r}: {sorted(expected) or 'none'}",
        )
    for field in sorted(expected - fields):
        raise ConfigError(f"{key}.{field}", None, "a value (this field is required)")
    if name == "gaussian":
        _check_noise(data["noise_multiplier"], f"{key}.noise_multiplier")
        return dpa.GaussianDpEvent(data["noise_multiplier"])
    if name == "poisson_sampled":
        _check_probability(data["sampling_probability"], f"{key}.sampling_probability")
        return dpa.PoissonSampledDpEvent(
            data["sampling_probability"], event_from_dict(data["event"], f"{key}.event")
        )
    if name == "sampled_without_replacement":
        _check_sizes(data["source_dataset_size"], data["sample_size"], key)
        return dpa.SampledWithoutReplacementDpEvent(
            data["source_dataset_size"],
            data["sample_size"],
            event_from_dict(data["event"], f"{key}.event"),
        )
    if name == "self_composed":
        _check_count(data["count"], f"{key}.count")
        return dpa.SelfComposedDpEvent(
            event_from_dict(data["event"], f"{key}.event"), data["count"]
        )
    if name == "composed":
        events = data["events"]
        require(isinstance(events, list), f"{key}.events", events, "a list of events")
        return dpa.ComposedDpEvent(
            [event_from_dict(e, f"{key}.events[{i}]") for i, e in enumerate(events)]
        )
    if name == "non_private":
        return dpa.NonPrivateDpEvent()
    return dpa.NoOpDpEvent()
