"""Command-line overrides of a run config: ``--set strategy.options.noise_multiplier=1.2``.

An override names a key of the TOML tree of :mod:`fedsim.frontend.run_config` by its dotted path and
gives its value as TOML text (``1.2``, ``true``, ``[32, 64]``, ``"digits"``, ``{kind = "ema"}``);
a bare word that is not TOML (``digits``, ``on``) is the string itself, and so is any value of
a key whose schema type is a string (``name=2024`` is the name ``"2024"``). The overrides are
written into the parsed file, and the result is validated by the same checks as the file
(:meth:`ExperimentConfig.from_dict`), so an override can set nothing a file could not.

Checked before the config is built, each naming the flag and the key:

* the path: every part must be a key of its table (the error lists that table's keys); below a
  free table (``strategy.options``) any key goes, as in the file;
* the value's type, against the schema's annotation (a string where an integer is expected is
  refused, naming the key, the value and the type);
* the same key twice.

The effective config (file plus overrides) is what a run validates, runs and stores in its
``config.json``; ``fedsim run --resume DIR --set ...`` is compared with it like a config file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fedsim.checkpoint import CONFIG_FILE
from fedsim.config import ConfigError, check_type, load_toml
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.runfiles import RunFileError

SET_FLAG = "--set"


@dataclass(frozen=True)
class Override:
    """One ``key=value`` of the command line, its value typed by the schema.

    Attributes:
        key: the dotted path as given (``strategy.options.noise_multiplier``).
        text: the value as given.
        value: the typed value written into the TOML tree.
        flag: the flag that gave it (named in errors).
    """

    key: str
    text: str
    value: Any
    flag: str = SET_FLAG

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.key.split("."))

    @property
    def normal_parts(self) -> tuple[str, ...]:
        """The parts with the schema's keys in their field spelling (``a-b`` is ``a_b``); a
        free table's keys (``strategy.options``) as written."""
        schema_parts = schema_walk(self.key, self.flag)[1]
        return tuple(_normal(p) if i < schema_parts else p for i, p in enumerate(self.parts))


def parse_toml_value(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` is one TOML value (scalar, array or inline table),
    else ``(False, text)``."""
    try:
        return True, tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return False, text


def _normal(name: str) -> str:
    return str(name).replace("-", "_")


def _dataclass_in(tp: Any) -> type | None:
    """The config dataclass a field's annotation holds (also inside Optional/Union)."""
    if typing.get_origin(tp) is Annotated:
        return _dataclass_in(typing.get_args(tp)[0])
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None


def _is_free_table(tp: Any) -> bool:
    """A table whose keys the schema does not list (``strategy.options``, ``Any``)."""
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_free_table(a) for a in typing.get_args(tp))
    return tp in (dict, Mapping) or typing.get_origin(tp) in (dict, Mapping)


def _takes_strings(tp: Any) -> bool:
    """Whether the annotation is a string, or a choice of strings (a bare word is its value)."""
    if typing.get_origin(tp) is Annotated:
        return _takes_strings(typing.get_args(tp)[0])
    if tp is str:
        return True
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return bool(args) and all(_takes_strings(a) for a in args)
    return False


def _field_type(table: type, parts: list[str], depth: int, key: str, flag: str) -> Any:
    """The annotation of ``parts[depth]`` in the config dataclass ``table``."""
    part = parts[depth]
    fields = {f.name for f in dataclasses.fields(table) if f.init}
    if not part or _normal(part) not in fields:
        where = ".".join(parts[:depth]) or "the top level"
        raise ConfigError(
            flag,
            key,
            f"a known key; {part!r} is no key of {where}, whose keys are "
            f"{', '.join(sorted(fields))}",
        )
    return typing.get_type_hints(table, include_extras=True)[_normal(part)]


def schema_walk(key: str, flag: str = SET_FLAG) -> tuple[Any, int]:
    """``(annotation, n)``: the annotation of the dotted ``key`` in :class:`ExperimentConfig`
    (``Any`` below a free table such as ``strategy.options``) and how many leading parts of
    ``key`` are schema keys (where ``-`` and ``_`` are one; the parts after them are the free
    table's keys, taken as written). A ConfigError naming ``flag`` and the key when a part is
    no key of its table, or a value is used as a table."""
    table: type = ExperimentConfig
    parts = key.split(".")
    for depth in range(len(parts) - 1):
        tp = _field_type(table, parts, depth, key, flag)
        inner = _dataclass_in(tp)
        if inner is not None:
            table = inner
        elif _is_free_table(tp):
            return Any, depth + 1
        else:
            raise ConfigError(
                flag,
                key,
                f"a path into a table; {'.'.join(parts[: depth + 1])} is a value, not a table",
            )
    return _field_type(table, parts, len(parts) - 1, key, flag), len(parts)


def typed_value(key: str, text: str, flag: str = SET_FLAG) -> Any:
    """``text`` as the value of ``key``: TOML, or the text itself for a bare word or a string
    key; its type checked against the schema (ranges are checked with the whole config)."""
    tp = schema_walk(key, flag)[0]
    parsed, value = parse_toml_value(text)
    if not parsed or (_takes_strings(tp) and not isinstance(value, str)):
        value = text
    if tp is not Any and _dataclass_in(tp) is None and not _is_free_table(tp):
        check_type(tp, value, f"{flag} {key}")  # the type; the value as written stays in the tree
    return value


def parse_override(token: str, flag: str = SET_FLAG) -> Override:
    """One ``key=value`` token of ``flag``."""
    key, sep, text = token.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(flag, token, "key=value, e.g. strategy.options.noise_multiplier=1.2")
    return Override(key, text.strip(), typed_value(key, text.strip(), flag), flag)


def parse_overrides(tokens: Iterable[str] | None, flag: str = SET_FLAG) -> list[Override]:
    """Every ``--set`` token; the same key twice is refused."""
    overrides = [parse_override(t, flag) for t in tokens or ()]
    check_distinct(overrides)
    return overrides


def check_distinct(overrides: Sequence[Override]) -> None:
    """Refuse two overrides of one key (dashes and underscores are the same key)."""
    seen: dict[tuple[str, ...], Override] = {}
    for override in overrides:
        normal = override.normal_parts
        if normal in seen:
            first = seen[normal]
            raise ConfigError(
                f"{override.flag} {override.key}",
                override.text,
                f"one value per key (already set by {first.flag} {first.key}={first.text})",
            )
        seen[normal] = override


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of the parsed TOML tree ``raw`` with each override written at its path (a key
    spelled with dashes in the file is replaced, not duplicated; missing tables are made)."""
    tree = copy.deepcopy(dict(raw))
    for override in overrides:
        table = tree
        schema_parts = schema_walk(override.key, override.flag)[1]
        *path, last = override.normal_parts
        for depth, part in enumerate(path):
            name = _existing_key(table, part) if depth < schema_parts else part
            if name not in table:
                table[name] = {}
            if not isinstance(table[name], dict):
                raise ConfigError(
                    f"{override.flag} {override.key}",
                    table[name],
                    f"a path into a table; {'.'.join(override.parts[: depth + 1])} is a value "
                    "in the config, not a table",
                )
            table = table[name]
        name = _existing_key(table, last) if len(path) < schema_parts else last
        table[name] = override.value
    return tree


def _existing_key(table: Mapping[str, Any], part: str) -> str:
    """The spelling of the schema key ``part`` already in ``table`` (``a-b`` for ``a_b``),
    else ``part``."""
    return next((k for k in table if _normal(k) == _normal(part)), part)


def build_config(raw: Mapping[str, Any], overrides: Sequence[Override]) -> ExperimentConfig:
    """The effective config: ``raw`` with ``overrides``, validated like a file; an error on an
    overridden key (or inside it) names the flag."""
    tree = apply_overrides(raw, overrides)
    try:
        return ExperimentConfig.from_dict(tree)
    except ConfigError as err:
        for override in overrides:
            normal = ".".join(override.normal_parts)
            key = err.key
            if key == normal or key.startswith(normal + ".") or key.startswith(normal + "["):
                raise ConfigError(f"{override.flag} {err.key}", err.value, err.allowed) from err
        raise


def load_config(path: str | Path, overrides: Sequence[Override] = ()) -> ExperimentConfig:
    """The config file at ``path`` with ``overrides`` applied, validated."""
    return build_config(load_toml(path), overrides)


def resume_config(
    run_dir: str | Path, path: str | Path | None, overrides: Sequence[Override]
) -> ExperimentConfig | None:
    """What ``fedsim run [CONFIG] --resume DIR [--set ...]`` says the run's config is, to be
    compared with the one the run stored: the file with the overrides, or (no file) the stored
    config with the overrides; None when neither is given (the stored config is taken)."""
    if path is not None:
        return load_config(path, overrides)
    if not overrides:
        return None
    stored = Path(run_dir) / CONFIG_FILE
    if not stored.is_file():
        raise ConfigError(
            "--resume", str(run_dir), f"a fedsim run directory (it has no {CONFIG_FILE})"
        )
    try:
        raw = json.loads(stored.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise RunFileError(stored, f"is not a config fedsim wrote ({err})") from None
    return build_config(raw, overrides)
