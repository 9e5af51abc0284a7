"""Flower's simulation settings for ``fedsim flwr-run``, resolved as ``flwr run`` does.

Flower 1.42 (``flwr.cli.run.run``, ``flwr.cli.config_migration.migrate``,
``flwr.cli.flower_config.read_superlink_connection`` and the SuperLink's ``StartRun``)
resolves a local simulation in this order, and so does :func:`read_federation`:

1. **Connections.** ``$FLWR_HOME/config.toml`` (``~/.flwr`` without ``FLWR_HOME``) holds the
   SuperLink connections ``[superlink.NAME]`` and ``[superlink] default``; a missing file reads
   as the one Flower writes (``local`` at ``":local:"``, the default, and ``supergrid``).
   fedsim reads it and never writes it. An app's older ``[tool.flwr.federations]`` tables are
   read as connections too, the way ``flwr run`` migrates them into that file: each replaces
   the connection of its name (``options`` without an ``address`` is a local simulation), and
   the table's ``default`` (which must name one of them) becomes the default connection::

       [tool.flwr.federations]
       default = "local"
       [tool.flwr.federations.local]
       options.num-supernodes = 10
       options.backend.client-resources.num-cpus = 1

2. **The connection.** ``SUPERLINK`` (or ``--federation NAME``), else the default one. It must
   be a local simulation: ``address = ":local:"`` or ``":local-in-memory:"``, or ``options``
   without an address; a SuperLink deployment (any other address) is refused.
3. **The simulation config.** Flower's ``DEFAULT_SIMULATION_CONFIG``
   (``flwr.supercore.constant``; 2 supernodes, 2 CPUs and no GPU per ClientApp in 1.42) with
   the connection's ``options.*`` over it, field by field, or, when ``--federation-config
   "num-supernodes=10 client-resources-num-cpus=1"`` (or a ``.toml`` file of those keys) is
   given, those instead of the options, as ``flwr run`` then ignores them.
4. fedsim's ``--num-supernodes``, ``--client-cpus`` and ``--client-gpus`` override the result.

On fedsim's engine, ``num-supernodes`` is the number of virtual clients; a worker actor runs one
client at a time, so a client's resources are its worker's Ray resources:
``client-resources.num-cpus`` -> ``cpus_per_worker`` (> 0), ``num-gpus`` -> ``gpus_per_worker``
(>= 0; a fraction shares a GPU) and ``init-args.num-cpus`` -> the CPUs of a Ray fedsim starts.
``verbose``, ``init-args.logging-level``, ``init-args.log-to-driver`` (Flower's logging
switches) and ``init-args.num-gpus`` (fedsim's Ray sees every GPU; the workers take
``client-resources.num-gpus`` each) are checked and without effect; ``backend`` must be
``"ray"``. Any other key, or a value of the wrong type, is refused with an error naming it.
Not read: a simulation config set on a running local SuperLink with ``flwr federation
simulation-config`` (that lives in the SuperLink process).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.cli.constant import (
    DEFAULT_FLOWER_CONFIG_TOML,
    FLOWER_CONFIG_FILE,
    LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
    LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY,
)
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG
from flwr.supercore.utils import get_flwr_home

from fedsim.config import ConfigError, is_finite_number, require

TABLE = "[tool.flwr.federations]"
#: the addresses of the local SuperLink ``flwr run`` starts in simulation mode
LOCAL_ADDRESSES = (
    LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
    LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY,
)
#: a connection's keys besides ``options`` (flwr.cli.constant.SuperLinkConnectionTomlKey)
_CONNECTION_KEYS = ("address", "root-certificates", "insecure", "federation", "options")


def _integer(least: int) -> tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    return ok, f"an integer >= {least}"


def _number(positive: bool) -> tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return is_finite_number(v) and (v > 0 if positive else v >= 0)

    return ok, "a number > 0" if positive else "a number >= 0"


_BOOL = (lambda v: isinstance(v, bool), "true or false")
_TEXT = (lambda v: isinstance(v, str), "a string")

#: Flower's ``SimulationConfig`` fields: (key under a connection's ``options.``, check, allowed)
FIELDS: dict[str, tuple[str, tuple[Callable[[Any], bool], str]]] = {
    "num_supernodes": ("num-supernodes", _integer(1)),
    "client_resources_num_cpus": ("backend.client-resources.num-cpus", _number(True)),
    "client_resources_num_gpus": ("backend.client-resources.num-gpus", _number(False)),
    "backend": ("backend.name", (lambda v: v == "ray", '"ray" (Ray actors run the clients)')),
    "verbose": ("verbose", _BOOL),
    "init_args_num_cpus": ("backend.init-args.num-cpus", _integer(1)),
    "init_args_num_gpus": ("backend.init-args.num-gpus", _integer(0)),
    "init_args_logging_level": ("backend.init-args.logging-level", _TEXT),
    "init_args_log_to_driver": ("backend.init-args.log-to-driver", _BOOL),
}


def flower_defaults() -> dict[str, Any]:
    """The installed Flower's ``DEFAULT_SIMULATION_CONFIG`` (its set fields) by field name."""
    config = DEFAULT_SIMULATION_CONFIG
    return {f: getattr(config, f) for f in FIELDS if config.HasField(f)}


@dataclass(frozen=True)
class Federation:
    """The simulation settings of one SuperLink connection (None: not given).

    Attributes:
        name: the connection's name (None: none chosen).
        num_supernodes: virtual clients, >= 1.
        client_cpus: Ray CPUs of each worker (one client at a time), > 0.
        client_gpus: Ray GPUs of each worker, >= 0 (fractions share a GPU).
        ray_cpus: CPUs of a Ray that fedsim starts itself, >= 1.
        source: where the values come from (for messages), e.g. ``"Flower's defaults"``.
    """

    name: str | None = None
    num_supernodes: int | None = None
    client_cpus: float | None = None
    client_gpus: float | None = None
    ray_cpus: int | None = None
    source: str = ""


def config_path(flwr_home: str | Path | None = None) -> Path:
    """``$FLWR_HOME/config.toml`` as Flower finds it (``flwr_home`` None: Flower's home)."""
    return Path(flwr_home if flwr_home is not None else get_flwr_home()) / FLOWER_CONFIG_FILE


def read_connections(path: Path) -> tuple[dict[str, Any], str | None]:
    """The ``[superlink]`` connections of Flower's config file at ``path`` and its default;
    a missing file reads as the one Flower creates."""
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else DEFAULT_FLOWER_CONFIG_TOML
        toml = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(
            "$FLWR_HOME/config.toml", str(path), f"Flower's config file in valid TOML ({err})"
        ) from err
    superlink = toml.get("superlink", {})
    require(isinstance(superlink, dict), f"{path} [superlink]", superlink, "a table of connections")
    default = superlink.get("default")
    connections = {
        k: (v, f"{path} [superlink.{k}]") for k, v in superlink.items() if k != "default"
    }
    return connections, default


def read_federation(
    project: dict[str, Any],
    name: str | None = None,
    federation_config: str | None = None,
    *,
    flwr_home: str | Path | None = None,
) -> Federation:
    """The simulation settings ``flwr run`` would use for the app ``project`` (its parsed
    pyproject.toml) on the connection ``name`` (None: the default one), with
    ``--federation-config`` overrides; see the module docstring for the order."""
    path = config_path(flwr_home)
    connections, default = read_connections(path)
    legacy = project.get("tool", {}).get("flwr", {}).get("federations")
    if legacy is not None:
        require(isinstance(legacy, dict), TABLE, legacy, "a table of federations")
        tables = sorted(k for k, v in legacy.items() if isinstance(v, dict))
        # `flwr run` refuses the table (its migration fails) unless `default` names one of it
        require(
            legacy.get("default") in tables,
            f"{TABLE} default",
            legacy.get("default"),
            f"the name of a federation of the app: {', '.join(tables) or 'none is declared'}",
        )
        for key in tables:
            connections[key] = (legacy[key], f"[tool.flwr.federations.{key}]")
        default = legacy["default"]
    known = ", ".join(sorted(connections)) or "none is declared"
    if name is None:
        require(
            isinstance(default, str) and default in connections,
            f"{path} [superlink] default",
            default,
            f"the name of a SuperLink connection: {known} (or give SUPERLINK)",
        )
        name = default
    elif name not in connections:
        raise ConfigError(
            "SUPERLINK (--federation)",
            name,
            f"a SuperLink connection of {path} or of the app's {TABLE}: {known}",
        )
    table, where = connections[name]
    options = _connection_options(table, where)
    if federation_config is not None:
        settings, source = parse_federation_config(federation_config), "--federation-config"
    else:
        settings = {f: options[key] for f, (key, _) in FIELDS.items() if key in options}
        source = f"{where} options" if settings else "Flower's defaults"
    resolved = {**flower_defaults(), **settings}
    # Flower's default of no GPU per ClientApp is fedsim's unset: none on the CPU, a share of
    # the GPUs with --device cuda; a value that is set is the workers' reservation
    default_gpus = flower_defaults().get("client_resources_num_gpus")
    return Federation(
        name=name,
        num_supernodes=resolved.get("num_supernodes"),
        client_cpus=_float(resolved.get("client_resources_num_cpus")),
        client_gpus=_float(settings.get("client_resources_num_gpus", default_gpus or None)),
        ray_cpus=resolved.get("init_args_num_cpus"),
        source=source,
    )


def _connection_options(table: Any, where: str) -> dict[str, Any]:
    """A local simulation connection's flattened ``options``, checked."""
    require(isinstance(table, dict), where, table, "a table (a SuperLink connection)")
    unknown = sorted(set(table) - set(_CONNECTION_KEYS))
    if unknown:
        raise ConfigError(
            f"{where} {unknown[0]}",
            table[unknown[0]],
            f"nothing: a SuperLink connection has only {', '.join(_CONNECTION_KEYS)}",
        )
    address = table.get("address")
    if address is None:
        require("options" in table, f"{where} address", address, "an address and/or options.*")
    elif address not in LOCAL_ADDRESSES:
        raise ConfigError(
            f"{where} address",
            address,
            f"a local simulation ({' or '.join(map(repr, LOCAL_ADDRESSES))}): this connection is "
            "a SuperLink deployment; run it with `flwr run`, or choose a local connection",
        )
    options = _flat(table.get("options", {}), f"{where} options")
    keys = {key: f for f, (key, _) in FIELDS.items()}
    for key, value in options.items():
        require(
            key in keys,
            f"{where} options.{key}",
            value,
            f"one of options.{', options.'.join(keys)}",
        )
        ok, allowed = FIELDS[keys[key]][1]
        require(ok(value), f"{where} options.{key}", value, allowed)
    return options


def parse_federation_config(text: str) -> dict[str, Any]:
    """``--federation-config``: ``"key=value ..."`` (or one ``.toml`` file of them) with
    Flower's keys (``num-supernodes``, ``client-resources-num-cpus``, ...), checked."""
    flag = "--federation-config"
    stripped = text.strip()
    if stripped.endswith(".toml") and "=" not in stripped:
        try:
            given = _flat(tomllib.loads(Path(stripped).expanduser().read_text()), flag)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(flag, text, f"a readable TOML file ({err})") from err
    else:
        given = _pairs(text, flag)
    settings: dict[str, Any] = {}
    for key, value in given.items():
        field = key.replace("-", "_")  # as `flwr run` maps a key to its proto field
        require(
            field in FIELDS,
            f"{flag} {key}",
            value,
            "a key of Flower's simulation config: "
            + ", ".join(f.replace("_", "-") for f in FIELDS),
        )
        ok, allowed = FIELDS[field][1]
        require(ok(value), f"{flag} {key}", value, allowed)
        settings[field] = value
    return settings


#: one ``key=value`` token, as ``flwr run`` splits them (flwr.common.config.parse_config_args)
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def _pairs(text: str, flag: str) -> dict[str, Any]:
    """``"k=v k2=v2"`` as TOML values; unlike Flower, a token without ``=`` is refused."""
    parsed: dict[str, Any] = {}
    position = 0
    for match in [*_PAIR.finditer(text), None]:
        stray = text[position : match.start() if match else len(text)].strip()
        require(not stray, flag, stray, "key=value pairs separated by spaces (this has no '=')")
        if match is None:
            break
        position = match.end()
        key, raw = match.group(1), match.group(2)
        try:
            parsed[key] = tomllib.loads(f"value = {raw}")["value"]
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(
                f"{flag} {key}", raw, f"a TOML value: a number, true/false or a string ({err})"
            ) from err
    return parsed


def _flat(table: Any, where: str, prefix: str = "") -> dict[str, Any]:
    require(isinstance(table, dict), where, table, "a table")
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flat(value, where, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def with_flags(
    federation: Federation,
    *,
    num_supernodes: int | None,
    client_cpus: float | None,
    client_gpus: float | None,
) -> Federation:
    """``federation`` with the command line's values in place of its own (None: keep);
    the number of supernodes must come from one or the other."""
    def pick(flag: Any, own: Any) -> Any:
        return own if flag is None else flag

    merged = Federation(
        name=federation.name,
        num_supernodes=pick(num_supernodes, federation.num_supernodes),
        client_cpus=pick(client_cpus, federation.client_cpus),
        client_gpus=pick(client_gpus, federation.client_gpus),
        ray_cpus=federation.ray_cpus,
        source=federation.source,
    )
    if merged.num_supernodes is None:
        where = federation.source or "a SuperLink connection's options.num-supernodes"
        raise ConfigError("--num-supernodes", None, f"an integer >= 1 (or set in {where})")
    require(
        merged.num_supernodes >= 1, "--num-supernodes", merged.num_supernodes, "an integer >= 1"
    )
    cpus, gpus = merged.client_cpus, merged.client_gpus
    require(
        cpus is None or (is_finite_number(cpus) and cpus > 0),
        "--client-cpus",
        cpus,
        "a number > 0 (Ray CPUs of each worker)",
    )
    require(
        gpus is None or (is_finite_number(gpus) and gpus >= 0),
        "--client-gpus",
        gpus,
        "a number >= 0 (Ray GPUs of each worker; a fraction shares a GPU)",
    )
    return merged
