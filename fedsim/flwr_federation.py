"""Flower's federation config for ``fedsim flwr-run``: ``[tool.flwr.federations]``.

A Flower app's ``pyproject.toml`` names its simulation federations the way ``flwr run``
reads them (Flower 1.42, ``flwr.cli.config_utils.validate_federation_in_project_config``)::

    [tool.flwr.federations]
    default = "local"

    [tool.flwr.federations.local]
    options.num-supernodes = 10
    options.backend.client-resources.num-cpus = 1
    options.backend.client-resources.num-gpus = 0.25

``--federation NAME`` picks one (without it: the ``default``; without a default, or when
the default is a deployment, none, and the command-line flags must say everything). Flags
override the federation's values.
On fedsim's engine, ``num-supernodes`` is the number of virtual clients; a worker actor
runs one client at a time, so a client's resources are its worker's Ray resources:
``client-resources.num-cpus`` -> ``cpus_per_worker`` (> 0) and ``num-gpus`` ->
``gpus_per_worker`` (>= 0; a fraction shares a GPU between workers);
``init-args.num-cpus`` -> the CPUs of a Ray fedsim starts itself. ``verbose``,
``backend.name = "ray"``, ``init-args.logging-level`` and ``init-args.log-to-driver`` are
Flower's logging switches: accepted and without effect (fedsim's ``--verbose`` shows
Flower's log). Any other key, a value of the wrong type, or a deployment federation (one
with an ``address``) is refused with an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsim.config import ConfigError, is_finite_number, require

TABLE = "[tool.flwr.federations]"
#: Flower's logging switches: accepted, without effect on fedsim
_NO_EFFECT = (
    "verbose",
    "backend.name",
    "backend.init-args.logging-level",
    "backend.init-args.log-to-driver",
)
#: what fedsim's engine takes from a federation
_MAPPED = (
    "num-supernodes",
    "backend.client-resources.num-cpus",
    "backend.client-resources.num-gpus",
    "backend.init-args.num-cpus",
)


@dataclass(frozen=True)
class Federation:
    """The simulation settings of one federation (None: not given).

    Attributes:
        name: the federation's name (None: the app names none).
        num_supernodes: virtual clients, >= 1.
        client_cpus: Ray CPUs of each worker (one client at a time), > 0.
        client_gpus: Ray GPUs of each worker, >= 0 (fractions share a GPU).
        ray_cpus: CPUs of a Ray that fedsim starts itself, >= 1.
    """

    name: str | None = None
    num_supernodes: int | None = None
    client_cpus: float | None = None
    client_gpus: float | None = None
    ray_cpus: int | None = None


def read_federation(project: dict[str, Any], name: str | None) -> Federation:
    """The federation ``name`` of the app's ``project`` (its parsed pyproject.toml), or its
    default when ``name`` is None; an empty :class:`Federation` when neither exists."""
    federations = project.get("tool", {}).get("flwr", {}).get("federations", {})
    require(isinstance(federations, dict), TABLE, federations, "a table of federations")
    known = sorted(k for k, v in federations.items() if k != "default" and isinstance(v, dict))
    default = federations.get("default")
    if name is None:
        if default is None:
            return Federation()
        require(
            isinstance(default, str) and default in known,
            f"{TABLE} default",
            default,
            f"the name of a federation of the app: {', '.join(known) or 'none is declared'}",
        )
        if "address" in federations[default]:  # a deployment: `flwr run`'s default, not ours
            return Federation()
        name = default
    elif name not in known:
        raise ConfigError(
            "--federation",
            name,
            f"a federation of the app's pyproject.toml: {', '.join(known) or 'none is declared'}",
        )
    return _federation(name, federations[name])


def _federation(name: str, table: dict[str, Any]) -> Federation:
    where = f"[tool.flwr.federations.{name}]"
    if "address" in table:
        raise ConfigError(
            f"{where} address",
            table["address"],
            "a simulation federation (options.num-supernodes): this one is a SuperLink "
            "deployment; run it with `flwr run`",
        )
    unknown = sorted(set(table) - {"options"})
    if unknown:
        raise ConfigError(
            f"{where} {unknown[0]}", table[unknown[0]], "nothing: a simulation federation "
            "has only options.*"
        )
    options = _flat(table.get("options", {}), f"{where} options")
    for key, value in options.items():
        require(
            key in _MAPPED or key in _NO_EFFECT,
            f"{where} options.{key}",
            value,
            f"one of options.{', options.'.join(_MAPPED + _NO_EFFECT)}",
        )
    backend = options.get("backend.name", "ray")
    require(backend == "ray", f"{where} options.backend.name", backend, '"ray"')
    return Federation(
        name=name,
        num_supernodes=_integer(options, "num-supernodes", where),
        client_cpus=_number(options, "backend.client-resources.num-cpus", where, positive=True),
        client_gpus=_number(options, "backend.client-resources.num-gpus", where, positive=False),
        ray_cpus=_integer(options, "backend.init-args.num-cpus", where),
    )


def _flat(table: Any, where: str, prefix: str = "") -> dict[str, Any]:
    require(isinstance(table, dict), where, table, "a table")
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flat(value, where, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _integer(options: dict[str, Any], key: str, where: str) -> int | None:
    value = options.get(key)
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    require(ok, f"{where} options.{key}", value, "an integer >= 1")
    return value


def _number(options: dict[str, Any], key: str, where: str, *, positive: bool) -> float | None:
    value = options.get(key)
    if value is None:
        return None
    ok = is_finite_number(value) and (value > 0 if positive else value >= 0)
    require(ok, f"{where} options.{key}", value, "a number > 0" if positive else "a number >= 0")
    return float(value)


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
    )
    if merged.num_supernodes is None:
        where = (
            f"[tool.flwr.federations.{federation.name}] options.num-supernodes"
            if federation.name
            else "a federation of the app (--federation NAME or [tool.flwr.federations] default)"
        )
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
