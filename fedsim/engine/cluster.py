"""Starting Ray locally, or connecting to an existing Ray cluster by address.

An address is checked before ``ray.init`` is called: ``ray.init`` on an address
where nothing listens retries for a long time, and the user should hear at once
which address was wrong. When fedsim connects to a cluster, its own packages
travel to the cluster's workers through Ray's runtime environment
(``py_modules``), so a cluster needs only the dependencies installed.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError

#: Objects up to this size travel inline with task arguments and returns instead of
#: through the shared-memory store: a batch's model-sized reply then costs one
#: RPC (about 1.3 ms for 240 kB here) instead of a store put and get (2.4 ms).
#: Applied when fedsim starts Ray itself; a cluster keeps its own settings.
INLINE_OBJECT_BYTES = 8 * 1024 * 1024

_ADDRESS_HELP = (
    "the address of a running Ray cluster: host:port of its head node "
    "(as printed by `ray start --head`), 'ray://host:port' for Ray Client, or 'auto'"
)


#: the project's top-level packages, shipped to a cluster's workers
PACKAGES = ("fedsim", "protocols", "strategies")


def _packages() -> list[str]:
    """The folders of :data:`PACKAGES`, found without importing them."""
    folders = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"package {name!r} cannot be found on sys.path {sys.path}")
        folders.append(str(Path(spec.origin).parent))
    return folders


def check_reachable(address: str, key: str = "engine.ray_address", timeout: float = 5.0) -> None:
    """Raise :class:`ConfigError` unless something accepts TCP connections at ``address``."""
    if address == "auto":
        return
    target = address.removeprefix("ray://")
    host, sep, port_text = target.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(key, address, _ADDRESS_HELP)
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout):
            pass
    except OSError as err:
        raise ConfigError(
            key, address, f"{_ADDRESS_HELP}; nothing answers there ({err.strerror or err})"
        ) from err


def ensure_ray(
    address: str = "",
    num_cpus: int | None = None,
    extra_modules: tuple[str, ...] = (),
    key: str = "engine.ray_address",
    object_store_mb: int = 512,
) -> str | None:
    """Make sure Ray is initialised: "local" if this call started a local
    instance, "cluster" if it joined one, None if Ray was already running.

    Args:
        address: '' starts a local Ray instance unless ``RAY_ADDRESS`` is set;
            otherwise the cluster to join.
        num_cpus: CPUs of a local instance (None: all of the machine's).
        object_store_mb: shared-memory object store of a local instance. Ray's
            default (30% of RAM) slows every worker's compute by about 5% here,
            so fedsim asks for what it needs: the round's messages and any
            dataset shipped to workers (memory-mapped datasets need none).
        extra_modules: directories to ship to cluster workers with fedsim's
            packages (e.g. a Flower app's directory).
    """
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return None
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS", "")
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
    if address:
        check_reachable(address, key)
        kwargs["address"] = address
        kwargs["runtime_env"] = {"py_modules": _packages() + list(extra_modules)}
    else:
        # "local" always starts a new instance: without it ray.init joins
        # whatever cluster a `ray start` on this machine last left behind.
        kwargs["address"] = "local"
        kwargs["_system_config"] = {
            "max_direct_call_object_size": INLINE_OBJECT_BYTES,
            "task_rpc_inlined_bytes_limit": 2 * INLINE_OBJECT_BYTES,
        }
        kwargs["object_store_memory"] = object_store_mb * 1024 * 1024
        if num_cpus:
            kwargs["num_cpus"] = num_cpus
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError) as err:
        if address:
            raise ConfigError(key, address, f"{_ADDRESS_HELP} ({err})") from err
        raise
    return "cluster" if address else "local"
