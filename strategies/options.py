"""Reading numbers from a config's ``strategy.options`` (errors name ``strategy.options.<key>``,
its value and what is allowed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedsim.config import ConfigError, require


def pop_value(options: dict[str, Any], key: str, default: float | None) -> float | None:
    """Pop ``strategy.options.key`` as a finite number (``default`` when absent)."""
    value = options.pop(key, default)
    if value is None:
        return None
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"strategy.options.{key}",
        value,
        "a finite number",
    )
    return float(value)


def pop_number(
    options: dict[str, Any],
    key: str,
    default: float | None,
    ok: Callable[[float], bool],
    allowed: str,
) -> float:
    """Pop a required (or defaulted) number and check it with ``ok``."""
    value = pop_value(options, key, default)
    if value is None:
        raise ConfigError(f"strategy.options.{key}", None, f"{allowed} (required)")
    require(ok(value), f"strategy.options.{key}", value, allowed)
    return value
