"""Configuration: frozen dataclasses read from TOML, checked before anything runs.

Every section of a config file maps to a frozen dataclass. :func:`from_mapping`
builds one from a plain mapping and rejects unknown keys, wrong types and values
outside their range with a :class:`ConfigError` that names the key, the value and
what is allowed. Range checks live in each dataclass's ``__post_init__`` and
raise through :func:`require`.

Floats must be finite: TOML's ``nan``, ``inf`` and ``-inf`` are refused for every
``float`` field except one annotated :data:`InfFloat`, which accepts ``+inf``
(e.g. a list of privacy budgets where ``inf`` means "no noise").
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

T = TypeVar("T")


class _AllowsInfinity:
    """Marker in ``Annotated[float, ...]``: the field accepts ``+inf``."""

    def __repr__(self) -> str:
        return "allows +inf"


#: a float config field that also accepts ``+inf`` (never NaN or ``-inf``)
InfFloat = Annotated[float, _AllowsInfinity()]


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which, and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} = {value!r} is not allowed: {allowed}")


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, value, allowed)


def positive_int(value: Any, key: str) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else a :class:`ConfigError` on ``key``."""
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        key,
        value,
        "an integer >= 1",
    )
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, turning a missing file or a syntax error into a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "a path to an existing TOML file")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("config", str(path), f"valid TOML ({err})") from err


def is_finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond the float range
        return False


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if origin in (tuple, list):
        return f"list of {_items_words(tp)}"
    return getattr(tp, "__name__", str(tp))


#: what the items of a list of this type are called, in words
_ITEM_WORDS = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}


def _items_words(tp: Any) -> str:
    """The items of the list type ``tp`` in words: ``tuple[int, ...]`` gives "integers"."""
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    if not args or args[0] is Any:
        return "values"
    item = args[0]
    if typing.get_origin(item) is Annotated:
        item = typing.get_args(item)[0]
    if item in _ITEM_WORDS:
        return _ITEM_WORDS[item]
    if dataclasses.is_dataclass(item):
        return f"tables of {item.__name__} keys"
    return f"{_type_name(item)} values"


def _list_allowed(tp: Any, value: Any, key: str) -> str:
    """What a list key allows, in words, and (when ``value`` would be a good item) how to
    write it as a one-item list: ``model.channels = 4`` is told it is written ``[4]``."""
    allowed = f"a list of {_items_words(tp)}, in brackets"
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    if args and not isinstance(value, Mapping):
        try:
            _convert(args[0], value, key)
        except (ConfigError, TypeError):
            return allowed
        shown = json.dumps(value) if isinstance(value, (int, float, str, bool)) else repr(value)
        allowed += f" (one item is written [{shown}])"
    return allowed


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    """``value`` as the first member of the union ``tp`` it converts to; else the error of
    a table of the right kind with a bad key inside, or one naming every member allowed."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, key)
        except ConfigError as err:
            errors.append(err)
    deeper = [err for err in errors if err.key != key]
    if deeper:  # a table of the right kind with a bad key inside: name that key
        raise deeper[0]
    allowed = " or ".join(dict.fromkeys(err.allowed for err in errors))
    raise ConfigError(key, value, f"{allowed} ({_type_name(tp)})")


def _convert(tp: Any, value: Any, key: str, number: str = "a number (finite)") -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where lossless."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Annotated:
        inner, *marks = typing.get_args(tp)
        if inner is float and any(isinstance(m, _AllowsInfinity) for m in marks):
            if isinstance(value, float) and value == math.inf:
                return value
            return _convert(float, value, key, "a number (finite, or inf)")
        return _convert(inner, value, key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        require(value in allowed, key, value, f"one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, key)
    if dataclasses.is_dataclass(tp):
        require(isinstance(value, Mapping), key, value, f"a table of {tp.__name__} keys")
        return from_mapping(tp, value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, _list_allowed(tp, value, key))
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        return tuple(_convert(item_type, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        require(isinstance(value, Mapping), key, value, "a table")
        return dict(value)
    if tp is bool:
        require(isinstance(value, bool), key, value, "true or false")
        return value
    if tp is int:
        require(
            isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63,
            key,
            value,
            "an integer (64-bit)",
        )
        return value
    if tp is float:
        require(is_finite_number(value), key, value, number)
        return float(value)
    if tp is str:
        require(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def check_type(tp: Any, value: Any, key: str) -> Any:
    """``value`` checked against the annotation ``tp`` as a config value of ``key`` (the
    checks of :func:`from_mapping`; a ConfigError naming ``key``, the value and the type)."""
    return _convert(tp, value, key)


def differing_keys(ours: Any, theirs: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which two :func:`to_mapping` trees differ (a table that is a value
    on one side only is one key)."""
    if not isinstance(ours, Mapping) or not isinstance(theirs, Mapping):
        return [] if ours == theirs else [prefix]
    keys = sorted(set(ours) | set(theirs))
    out: list[str] = []
    for key in keys:
        out += differing_keys(ours.get(key), theirs.get(key), f"{prefix}.{key}" if prefix else key)
    return out


def from_mapping(cls: type[T], mapping: Mapping[str, Any], where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``mapping``, checking every key.

    Keys may use ``-`` or ``_`` interchangeably. ``where`` prefixes key names in
    errors (``"data"`` gives ``data.alpha``).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    kwargs: dict[str, Any] = {}
    for raw_key, value in mapping.items():
        name = str(raw_key).replace("-", "_")
        if name not in fields:
            raise ConfigError(
                f"{prefix}{raw_key}",
                value,
                f"a known key; known keys are {', '.join(sorted(fields))}",
            )
        kwargs[name] = _convert(hints[name], value, f"{prefix}{name}")
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}", None, "a value (this key is required)")
    return cls(**kwargs)


def to_mapping(obj: Any) -> Any:
    """The inverse of :func:`from_mapping`: a JSON/TOML-ready structure."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_mapping(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- user code


def python_path(value: Any, key: str) -> tuple[str, ...]:
    """``value`` (a list of directories) as absolute paths, each an existing directory.

    Relative entries are relative to the current working directory; the absolute form is
    what a run stores, so its workers and a resumed run find the same directories.
    """
    require(
        isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value),
        key,
        value,
        "a list of directories (strings) to put on sys.path",
    )
    resolved = []
    for entry in value:
        path = Path(entry).expanduser().resolve()
        require(path.is_dir(), key, entry, "an existing directory")
        resolved.append(str(path))
    return tuple(resolved)


def import_reference(reference: Any, key: str, search: tuple[str, ...] = ()) -> Any:
    """The callable named by ``reference`` = ``"package.module:function"`` (the attribute may
    be dotted: ``"module:Class.method"``), imported with the directories ``search`` first on
    ``sys.path``; every failure is a :class:`ConfigError` naming ``key`` and the reference.

    Used for the user's model factory and data loader: the same string is resolved in the
    driver and again in each worker process, so the module must be importable there
    (installed, on ``PYTHONPATH``, or in a ``python_path`` directory)."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    shape = "'package.module:function' (a module path, a colon, a callable's name)"
    require(isinstance(reference, str), key, reference, f"a string {shape}")
    module_name, colon, attribute = reference.partition(":")
    require(bool(colon and module_name and attribute), key, reference, shape)
    for entry in reversed(search):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as err:
        where = f"; searched python_path {list(search)}" if search else ""
        raise ConfigError(
            key,
            reference,
            f"an importable module: importing {module_name!r} failed ({err}){where}; put its "
            "directory in the table's python_path, or install it",
        ) from err
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(
                key, reference, f"a name defined in module {module_name!r} (it has no {part!r})"
            )
        found = getattr(found, part)
    require(callable(found), key, reference, f"a callable (it names a {type(found).__name__})")
    return found


def frozen(value: Any) -> Any:
    """A hashable copy of a TOML value (tables and lists become sorted / plain tuples), for
    hashing config objects that hold a table of free-form options."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


#: the torch devices a run may name (``cuda:N``: N a GPU index)
DEVICE_HELP = "one of 'cpu', 'cuda', 'cuda:N' (N = 0, 1, ...: one GPU of the machine), 'mps'"


def device_name(value: Any, key: str) -> str:
    """``value`` if it names a device clients may train on (:data:`DEVICE_HELP`)."""
    ok = isinstance(value, str) and (
        value in ("cpu", "cuda", "mps")
        or (value.startswith("cuda:") and value[5:].isdigit() and value[5:] == str(int(value[5:])))
    )
    require(ok, key, value, DEVICE_HELP)
    return value
