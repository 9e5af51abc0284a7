"""Errors named by the command-line flag that set the value: the library's checks name their
own keys (``delta``, ``min_sep``, ...); a command re-raises them under its flags."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fedsim.config import ConfigError


@contextlib.contextmanager
def flags(names: dict[str, str]) -> Iterator[None]:
    """Re-raise the library's ConfigErrors whose key is in ``names`` (key -> flag) under the
    flag that set the value; others pass unchanged."""
    try:
        yield
    except ConfigError as err:
        if err.key in names:
            raise ConfigError(names[err.key], err.value, err.allowed) from err
        raise
