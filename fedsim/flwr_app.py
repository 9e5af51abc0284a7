"""Running a Flower app project (as ``flwr run`` reads it) on fedsim's engine.

A Flower app is a directory with a ``pyproject.toml`` holding
``[tool.flwr.app.components]`` (``serverapp = "pkg.module:app"``,
``clientapp = ...``) and ``[tool.flwr.app.config]`` (the run config).
:meth:`FlowerApp.load` reads and checks it with Flower's own functions, imports
both components, and fuses ``--run-config`` overrides into the config the way
``flwr run`` does. Each virtual node's ``node_config`` holds ``partition-id``
and ``num-partitions``, as in Flower's simulation, and its own secret
(:func:`fedsim.randomness.client_secret` reads it), derived from the run's secret
root; the ServerApp's context holds the server's
(:func:`fedsim.randomness.server_secret`). Neither is in the run config.

``--run-config`` is checked more strictly than ``flwr run`` does: every token must be a
``key=value`` pair (Flower drops a token without ``=`` silently), every key one of
``[tool.flwr.app.config]``, every value a TOML value of the default's type (an integer
for an integer, a finite number for a number, true/false, a quoted string), and
``num-server-rounds`` an integer >= 1.
"""

from __future__ import annotations

import platform
import re
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.config import flatten_dict, get_project_config, parse_config_args
from flwr.serverapp import ServerApp
from flwr.serverapp.server_app import LoadServerAppError
from flwr.supercore.object_ref import load_app

from fedsim import __version__
from fedsim.config import ConfigError, is_finite_number
from fedsim.engine import ClientAppSource, Engine, EngineConfig
from fedsim.progress import RunProgress
from fedsim.randomness import RunSecret
from fedsim.results import RoundRecorder, RunWriter

_COMPONENTS = "[tool.flwr.app.components]"


@dataclass(frozen=True)
class FlowerApp:
    """A loaded Flower app project."""

    app_dir: Path
    serverapp: str
    clientapp: str
    run_config: dict[str, Any]
    server_app: ServerApp

    @classmethod
    def load(
        cls,
        app_dir: str | Path,
        overrides: str | None = None,
        checked: Callable[[], object] | None = None,
    ) -> FlowerApp:
        """Read ``app_dir/pyproject.toml``, fuse the config, import the components.

        ``checked`` is called once the project and the config have passed their checks and
        before the components are imported (``fedsim flwr-run`` starts the engine there, so
        that its workers come up while the app's modules import)."""
        app_dir = Path(app_dir).resolve()
        if not (app_dir / "pyproject.toml").is_file():
            raise ConfigError(
                "APP_DIR", str(app_dir), "a Flower app directory containing pyproject.toml"
            )
        try:
            project = get_project_config(app_dir)
        except ValueError as err:
            raise ConfigError(
                "APP_DIR", str(app_dir), f"a valid Flower app project: {err}"
            ) from err
        components = project["tool"]["flwr"]["app"]["components"]
        for name in ("serverapp", "clientapp"):
            if not isinstance(components.get(name), str) or ":" not in components[name]:
                raise ConfigError(
                    f"{_COMPONENTS} {name}", components.get(name), "a 'module:attribute' reference"
                )
        defaults = flatten_dict(project["tool"]["flwr"]["app"].get("config", {}))
        run_config = fuse_run_config(defaults, overrides)
        if checked is not None:
            checked()
        server_app = _load(
            components["serverapp"], app_dir, ServerApp, LoadServerAppError, "serverapp"
        )
        _load(components["clientapp"], app_dir, ClientApp, LoadClientAppError, "clientapp")
        return cls(
            app_dir, components["serverapp"], components["clientapp"], run_config, server_app
        )

    def client_source(self) -> ClientAppSource:
        return ClientAppSource(reference=self.clientapp, app_dir=str(self.app_dir))


#: one ``key=value`` token of --run-config, as ``flwr run`` splits them
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")
ROUNDS_KEY = "num-server-rounds"


def fuse_run_config(defaults: dict[str, Any], overrides: str | None) -> dict[str, Any]:
    """``defaults`` (the app's flattened ``[tool.flwr.app.config]``) with ``overrides``
    (``--run-config``: ``"k=v k2=v2"`` or one ``.toml`` file) applied and checked."""
    fused = dict(defaults)
    if overrides and overrides.strip().endswith(".toml") and "=" not in overrides:
        try:
            given = parse_config_args([overrides.strip()])
        except (OSError, ValueError) as err:
            raise ConfigError("--run-config", overrides, f"a readable TOML file ({err})") from err
    else:
        given = _parse_pairs(overrides or "")
    for key, value in given.items():
        fused[key] = _checked_override(key, value, defaults)
    rounds = fused.get(ROUNDS_KEY)
    if ROUNDS_KEY in fused and not (
        isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1
    ):
        where = "--run-config" if ROUNDS_KEY in given else "[tool.flwr.app.config]"
        raise ConfigError(f"{where} {ROUNDS_KEY}", rounds, "an integer >= 1")
    return fused


def _parse_pairs(text: str) -> dict[str, Any]:
    """``"k=v k2=v2"`` as a dict of TOML values; every token must be a pair."""
    parsed: dict[str, Any] = {}
    position = 0
    for match in _PAIR.finditer(text):
        stray = text[position : match.start()].strip()
        if stray:
            raise ConfigError(
                "--run-config", stray, "key=value pairs separated by spaces (this token has no '=')"
            )
        position = match.end()
        key, raw = match.group(1), match.group(2)
        try:
            parsed[key] = tomllib.loads(f"value = {raw}")["value"]
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(
                f"--run-config {key}",
                raw,
                "a TOML value: an integer, a number, true/false or a quoted string "
                f"({err})",
            ) from err
    stray = text[position:].strip()
    if stray:
        raise ConfigError(
            "--run-config", stray, "key=value pairs separated by spaces (this token has no '=')"
        )
    return parsed


def _checked_override(key: str, value: Any, defaults: dict[str, Any]) -> Any:
    """``value`` for ``key`` if the key exists and the value has its default's type."""
    flag = f"--run-config {key}"
    if key not in defaults:
        raise ConfigError(
            flag, value, f"a key of [tool.flwr.app.config]: {', '.join(sorted(defaults))}"
        )
    default = defaults[key]
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
        kind = "an integer (64-bit)"
    elif isinstance(default, float):
        ok = is_finite_number(value) or (isinstance(value, float) and value == default)
        kind = "a number (finite)"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string (quoted)"
    else:
        ok, kind = type(value) is type(default), f"a {type(default).__name__}"
    if not ok:
        raise ConfigError(flag, value, f"{kind}, like the app's default {default!r}")
    return float(value) if isinstance(default, float) else value


def _load(reference: str, app_dir: Path, kind: type, error: type[Exception], name: str) -> Any:
    try:
        obj = load_app(reference, error, app_dir)
    except (error, ImportError) as err:
        raise ConfigError(
            f"{_COMPONENTS} {name}", reference, f"an importable '{name}' ({err})"
        ) from err
    if not isinstance(obj, kind):
        raise ConfigError(
            f"{_COMPONENTS} {name}", reference, f"a {kind.__name__} (found a {type(obj).__name__})"
        )
    return obj


def flower_engine(
    app_dir: str | Path,
    *,
    ray_address: str | None = None,
    workers: int | None = None,
    backend: str | None = None,
) -> Engine:
    """The engine (not started) that runs the app in ``app_dir``: Ray workers by default; on
    a cluster, the app's directory travels to the nodes with fedsim's packages."""
    return Engine(
        EngineConfig(
            backend=backend or "ray",  # type: ignore[arg-type]
            workers=workers or 0,
            ray_address=ray_address or "",
        ),
        extra_modules=(str(Path(app_dir).resolve()),),
    )


def run_flower_app(
    app: FlowerApp,
    num_supernodes: int,
    out_dir: str | Path,
    *,
    ray_address: str | None = None,
    workers: int | None = None,
    backend: str | None = None,
    progress: bool = True,
    engine: Engine | None = None,
    secrets: RunSecret | None = None,
) -> dict[str, Any]:
    """Run ``app`` with ``num_supernodes`` virtual nodes; rounds are inferred from
    the messages' ``server-round``. ``secrets``: the run's secret root (None: a fresh
    one from the OS; the run cannot be repeated). ``engine``: the engine to run on (started
    or not; left open), else one of :func:`flower_engine`, closed at the end."""
    writer = RunWriter(out_dir)
    started = time.perf_counter()
    try:
        own_engine = engine is None
        if engine is None:
            engine = flower_engine(
                app.app_dir, ray_address=ray_address, workers=workers, backend=backend
            )
        engine.start()
        rounds = app.run_config.get("num-server-rounds")
        with RunProgress(rounds if isinstance(rounds, int) else None, enabled=progress) as bar:
            recorder = RoundRecorder([writer.write_round, bar], infer_rounds=True)
            engine.run_server_app(
                app.server_app,
                app.client_source(),
                num_supernodes,
                run_config=app.run_config,
                observer=recorder,
                secrets=RunSecret.fresh() if secrets is None else secrets,
            )
            recorder.close()
        finished = time.perf_counter()
        trained = sum(r.get("train", {}).get("clients", 0) for r in recorder.records)
        summary = {
            "app_dir": str(app.app_dir),
            "components": {"serverapp": app.serverapp, "clientapp": app.clientapp},
            "run_config": app.run_config,
            "num_supernodes": num_supernodes,
            "rounds": len(recorder.records),
            "clients_trained": trained,
            "seconds": {"total": finished - started, "engine_startup": dict(engine.startup_s)},
            "final": recorder.records[-1] if recorder.records else None,
            "engine": engine.describe(),
            "versions": {"fedsim": __version__, "python": platform.python_version()},
        }
        writer.write_summary(summary)
        if own_engine:
            engine.close()
        return summary
    finally:
        writer.close()
