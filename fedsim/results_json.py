"""How results files write JSON (every epsilon with its infinite flag) and how
``rounds.jsonl`` is read back.

Every epsilon (a key containing ``epsilon``) is written with a boolean
``<key>_infinite`` next to it, and an infinite epsilon (no noise) as ``1e999``,
which JSON readers parse as infinity (``json.loads`` gives ``math.inf``); other
non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROUNDS_FILE = "rounds.jsonl"
SUMMARY_FILE = "summary.json"

#: how an infinite epsilon is written: a number that JSON readers parse as infinite
INFINITE_TEXT = "1e999"
#: the flag written next to every epsilon: ``<key>_infinite``
INFINITE_SUFFIX = "_infinite"
# JSON strings (left alone) or the bare token json.dumps writes for infinity
_INFINITY_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?Infinity')


def is_epsilon_key(key: str) -> bool:
    """Whether ``key`` names an epsilon (``epsilon``, ``max_client_epsilon``, ...)."""
    return "epsilon" in key.lower() and not key.endswith(INFINITE_SUFFIX)


def _epsilon_value(value: Any) -> tuple[Any, Any] | None:
    """``(value, infinite flag)`` for a number or list of numbers under an epsilon key
    (+inf kept, NaN and -inf null); None for anything else."""
    if isinstance(value, (list, tuple)):
        pairs = [_epsilon_value(v) for v in value]
        if not value or any(p is None for p in pairs):
            return None
        return [p[0] for p in pairs], [p[1] for p in pairs]  # type: ignore[index]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value == math.inf:
        return math.inf, True
    return (value if math.isfinite(value) else None), False


def json_ready(value: Any) -> Any:
    """Plain JSON types: non-finite floats become null, except epsilons.

    Under a key naming an epsilon (:func:`is_epsilon_key`) ``+inf`` is kept (:func:`dumps`
    writes it as ``1e999``) and the key gains a boolean sibling ``<key>_infinite``
    (a list of booleans for a list of epsilons), so "no privacy" is never written as null.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            key = str(key)
            epsilon = _epsilon_value(item) if is_epsilon_key(key) else None
            if epsilon is None:
                out.setdefault(key, json_ready(item))
            else:
                out[key], out[key + INFINITE_SUFFIX] = epsilon
        return out
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return json_ready(value.item())
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """JSON text of :func:`json_ready` ``(value)``, an infinite epsilon written as ``1e999``
    (``json.loads`` and every JSON reader that parses doubles read it back as infinity)."""
    return _INFINITY_TOKEN.sub(_number_text, json.dumps(json_ready(value), **kwargs))


def _number_text(match: re.Match[str]) -> str:
    token = match.group(0)
    return token if token.startswith('"') else token.replace("Infinity", INFINITE_TEXT)


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    """The round records of a ``rounds.jsonl`` (a torn last line is ignored)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the process died while writing this line
    return records
