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
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.config import get_fused_config_from_dir, get_project_config, parse_config_args
from flwr.serverapp import ServerApp
from flwr.serverapp.server_app import LoadServerAppError
from flwr.supercore.object_ref import load_app

from fedsim import __version__
from fedsim.config import ConfigError
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
    def load(cls, app_dir: str | Path, overrides: str | None = None) -> FlowerApp:
        """Read ``app_dir/pyproject.toml``, import the components, fuse the config."""
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
        try:
            override_config = parse_config_args([overrides] if overrides else None)
            run_config = get_fused_config_from_dir(app_dir, override_config)
        except ValueError as err:
            raise ConfigError(
                "--run-config", overrides, f"keys of [tool.flwr.app.config] ({err})"
            ) from err
        except Exception as err:  # click's error for unparsable strings
            raise ConfigError(
                "--run-config", overrides, f"space-separated key=value pairs ({err})"
            ) from err
        server_app = _load(
            components["serverapp"], app_dir, ServerApp, LoadServerAppError, "serverapp"
        )
        _load(components["clientapp"], app_dir, ClientApp, LoadClientAppError, "clientapp")
        return cls(
            app_dir, components["serverapp"], components["clientapp"], run_config, server_app
        )

    def client_source(self) -> ClientAppSource:
        return ClientAppSource(reference=self.clientapp, app_dir=str(self.app_dir))


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
    one from the OS; the run cannot be repeated)."""
    writer = RunWriter(out_dir)
    started = time.perf_counter()
    try:
        if engine is None:
            engine = Engine(
                EngineConfig(
                    backend=backend or "ray",  # type: ignore[arg-type]
                    workers=workers or 0,
                    ray_address=ray_address or "",
                ),
                extra_modules=(str(app.app_dir),),
            )
            own_engine = True
        else:
            own_engine = False
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
            "seconds": {"total": finished - started},
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
