"""Running a Flower app project (as ``flwr run`` reads it) on fedsim's engine.

A Flower app is a directory with a ``pyproject.toml`` holding
``[tool.flwr.app.components]`` (``serverapp = "pkg.module:app"``,
``clientapp = ...``) and ``[tool.flwr.app.config]`` (the run config).
:meth:`FlowerApp.load` reads and checks it with Flower's own functions, imports
both components, and fuses ``--run-config`` overrides into the config the way
``flwr run`` does. Each virtual node's ``node_config`` holds ``partition-id``
and ``num-partitions``, as in Flower's simulation, and its own secret
(:func:`fedsim.randomness.client_secret` reads it), derived by the worker from the run's
secret root, which the worker opens itself (``--secrets FILE`` with a fresh run nonce, or a
fresh root a worker writes); the ServerApp's context holds only the server's
(:func:`fedsim.randomness.server_secret`), and its grid is Flower's interface
(:class:`fedsim.engine.app_grid.AppGrid`). Neither secret is in the run config. The results
directory's ``run.json`` is the root's public record, as ``fedsim run`` writes it
(:func:`fedsim.frontend.run_root.app_record`: given or fresh, the base root's fingerprint, the
nonce).

``--run-config`` is checked more strictly than ``flwr run`` does: every token must be a
``key=value`` pair (Flower drops a token without ``=`` silently), every key one of
``[tool.flwr.app.config]``, every value a TOML value of the default's type (an integer
for an integer, a finite number for a number, true/false, a quoted string), and
``num-server-rounds`` an integer >= 1.

Flower's simulation config as ``flwr run`` resolves it (:mod:`fedsim.frontend.flwr_federation`:
``$FLWR_HOME/config.toml`` connections, the app's older ``[tool.flwr.federations]``,
``--federation-config``, Flower's defaults) gives the number of supernodes and each client's
Ray resources; flags override it.
With ``sampling`` the engine draws each phase's cohort (:mod:`fedsim.engine.participation`:
``uniform``, a fixed-size cohort without replacement, or ``poisson``) and the grid offers only
it, so a strategy that takes every node it is offered (``fraction_train=1``) is accounted
with that cohort model's amplification. The cohorts are drawn from the server's secret
(``--public-cohorts``: from ``--seed``, which every client may know; then no amplification
is claimed).

Every reply reaches the ServerApp through the grid's release boundary
(:mod:`fedsim.engine.boundary`): summary.json and the last line of rounds.jsonl give the
run's epsilon composed over every accounted mechanism the app ran, and
``unaccounted_releases``, client contributions that reached the ServerApp outside all of
them (then epsilon is infinite).

What a Flower strategy or the ServerApp's legacy workflow computes each round reaches
rounds.jsonl as well (:mod:`fedsim.frontend.flwr_metrics`): the aggregated train metrics
(``aggregated``), the aggregated evaluate metrics and loss (``aggregated_evaluate``), and the
central evaluation (``central``; the initial model's is round 0), as ``fedsim run`` writes them.

A fedsim strategy started inside the ServerApp (``strategy.start``, see
:mod:`strategies.plumbing.recorded_start`) reports each round to the run's
:class:`~fedsim.frontend.results.RoundRecorder`: rounds.jsonl gets the sections ``fedsim run``
writes (``aggregated``, ``aggregated_evaluate``, ``central``, ``privacy``) and summary.json its
``privacy`` and ``stopped_reason``.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
import time
import tomllib
from collections.abc import Callable, Iterator
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
from fedsim.config import ConfigError, is_finite_number, require
from fedsim.engine import ClientAppSource, Engine, EngineConfig, PoissonCohort, UniformCohort
from fedsim.engine.participation import CohortModel, secret_cohorts
from fedsim.frontend.flwr_federation import Federation, read_federation
from fedsim.frontend.flwr_metrics import recorded_metrics
from fedsim.frontend.progress import Cadence, RunProgress
from fedsim.frontend.results import RoundRecorder, RunWriter
from fedsim.frontend.run_root import app_record
from fedsim.randomness import PartySecret, RootSource, RunSecret

_COMPONENTS = "[tool.flwr.app.components]"


@dataclass(frozen=True)
class FlowerApp:
    """A loaded Flower app project."""

    app_dir: Path
    serverapp: str
    clientapp: str
    run_config: dict[str, Any]
    server_app: ServerApp
    #: the federation ``--federation`` (or the app's default) names; empty without one
    federation: Federation = Federation()

    @classmethod
    def load(
        cls,
        app_dir: str | Path,
        overrides: str | None = None,
        federation: str | None = None,
        checked: Callable[[Federation], object] | None = None,
        federation_config: str | None = None,
    ) -> FlowerApp:
        """Read ``app_dir/pyproject.toml``, fuse the config, resolve the SuperLink connection
        ``federation`` (None: the default one) with ``federation_config`` overrides
        (:func:`fedsim.frontend.flwr_federation.read_federation`), import the components.

        ``checked(federation)`` is called once the project, the config and the federation have
        passed their checks and before the components are imported (``fedsim flwr-run`` starts
        the engine there, so that its workers come up while the app's modules import)."""
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
        chosen = read_federation(project, federation, federation_config)
        if checked is not None:
            checked(chosen)
        server_app = _load(
            components["serverapp"], app_dir, ServerApp, LoadServerAppError, "serverapp"
        )
        _load(components["clientapp"], app_dir, ClientApp, LoadClientAppError, "clientapp")
        return cls(
            app_dir,
            components["serverapp"],
            components["clientapp"],
            run_config,
            server_app,
            chosen,
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
    except ModuleNotFoundError as err:
        if err.name and not (app_dir / err.name.split(".")[0]).exists():
            # the reference is right: the module imports a package this environment lacks
            raise ConfigError(
                f"{_COMPONENTS} {name}",
                reference,
                f"a module whose imports are installed: it needs the package {err.name!r}, "
                "which this environment lacks (install the app's dependencies; `flwr run` "
                "does not install them either)",
            ) from err
        raise ConfigError(
            f"{_COMPONENTS} {name}", reference, f"an importable '{name}' ({err})"
        ) from err
    except (error, ImportError) as err:
        raise ConfigError(
            f"{_COMPONENTS} {name}", reference, f"an importable '{name}' ({err})"
        ) from err
    if not isinstance(obj, kind):
        raise ConfigError(
            f"{_COMPONENTS} {name}", reference, f"a {kind.__name__} (found a {type(obj).__name__})"
        )
    return obj


#: the engine's cohort models a Flower app can run under (``--sampling``)
SAMPLINGS = ("uniform", "poisson")


def cohort_model(
    sampling: str | None, clients_per_round: int | None, num_supernodes: int, seed: int
) -> CohortModel | None:
    """The engine's cohort model for ``--sampling`` (None: the grid offers every node):
    ``uniform``, ``clients_per_round`` nodes without replacement, or ``poisson``, each node
    with probability ``clients_per_round / num_supernodes``; cohorts are drawn from the
    public ``seed``."""
    if sampling is None:
        require(
            clients_per_round is None,
            "--clients-per-round",
            clients_per_round,
            f"nothing without --sampling (one of {', '.join(SAMPLINGS)})",
        )
        return None
    require(sampling in SAMPLINGS, "--sampling", sampling, f"one of {', '.join(SAMPLINGS)}")
    require(
        isinstance(clients_per_round, int) and 1 <= clients_per_round <= num_supernodes,
        "--clients-per-round",
        clients_per_round,
        f"an integer in [1, {num_supernodes}] (the number of supernodes) with --sampling",
    )
    if sampling == "poisson":
        return PoissonCohort(num_supernodes, clients_per_round / num_supernodes, seed)
    return UniformCohort(num_supernodes, clients_per_round, seed)


def flower_engine(
    app_dir: str | Path,
    *,
    ray_address: str | None = None,
    workers: int | None = None,
    backend: str | None = None,
    device: str | None = None,
    client_cpus: float | None = None,
    client_gpus: float | None = None,
    ray_cpus: int | None = None,
) -> Engine:
    """The engine (not started) that runs the app in ``app_dir``: Ray workers by default; on
    a cluster, the app's directory travels to the nodes with fedsim's packages.
    ``client_cpus``/``client_gpus``: Ray resources of each worker (None: the engine's
    defaults; GPUs make ``device`` default to "cuda": the app's ClientApp places its model
    itself); ``ray_cpus``: CPUs of a Ray fedsim starts (None: all)."""
    return Engine(
        EngineConfig(
            backend=backend or "ray",  # type: ignore[arg-type]
            workers=workers or 0,
            ray_address=ray_address or "",
            cpus_per_worker=1.0 if client_cpus is None else client_cpus,
            gpus_per_worker=client_gpus,
            num_cpus=ray_cpus or 0,
            device=device or ("cuda" if client_gpus else "cpu"),
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
    device: str | None = None,
    progress: bool | Cadence = True,
    engine: Engine | None = None,
    secrets: RootSource | RunSecret | None = None,
    client_cpus: float | None = None,
    client_gpus: float | None = None,
    ray_cpus: int | None = None,
    participation: CohortModel | None = None,
    public_cohorts: bool = False,
) -> dict[str, Any]:
    """Run ``app`` with ``num_supernodes`` virtual nodes; rounds are inferred from
    the messages' ``server-round`` unless a fedsim strategy reports them. ``secrets``: where the
    run's secret root lies (None: a fresh one a worker writes; the run cannot be repeated).
    ``engine``: the engine to run on (started or not; left open), else one of
    :func:`flower_engine` (with ``device`` and the resources), closed at the end.
    ``participation``: the cohort the grid offers each phase (None: every node), drawn from
    the server's secret (amplification by sampling holds against clients that know the seed)
    unless ``public_cohorts``, which draws it from its public seed (accounted without
    amplification)."""
    writer = RunWriter(out_dir)
    started = time.perf_counter()
    try:
        own_engine = engine is None
        if engine is None:
            engine = flower_engine(
                app.app_dir,
                ray_address=ray_address,
                workers=workers,
                backend=backend,
                device=device,
                client_cpus=client_cpus,
                client_gpus=client_gpus,
                ray_cpus=ray_cpus,
            )
        engine.start()
        source = engine.fresh_root() if secrets is None else secrets
        record = app_record(out_dir, secrets, source)  # run.json: the root's public record
        if participation is not None and not public_cohorts:
            participation = secret_cohorts(participation, _server_secret(engine, source))
        recorder = _run_rounds(app, engine, num_supernodes, writer, progress, participation, source)
        finished = time.perf_counter()
        summary = _summary(app, num_supernodes, recorder, engine, finished - started)
        summary["participation"] = _described(participation)
        summary["run_nonce"] = record["nonce"]
        writer.write_summary(summary)
        if own_engine:
            engine.close()
        return summary
    finally:
        writer.close()


def _server_secret(engine: Engine, source: RootSource | RunSecret) -> PartySecret:
    """The server's secret of the run's root (``source``: the root, or where it lies)."""
    return source.server() if isinstance(source, RunSecret) else engine.server_secret(source)


def _run_rounds(
    app: FlowerApp,
    engine: Engine,
    num_supernodes: int,
    writer: RunWriter,
    progress: bool | Cadence,
    participation: CohortModel | None,
    source: RootSource | RunSecret,
) -> RoundRecorder:
    """Run the app's ServerApp on ``engine``, every round to ``writer`` (and the progress
    bar), the server's errors and the strategy's metrics to the records; returns the closed
    recorder."""
    rounds = app.run_config.get("num-server-rounds")
    with RunProgress(rounds if isinstance(rounds, int) else None, enabled=progress) as bar:
        recorder = RoundRecorder([writer.write_round, bar], infer_rounds=True)
        with (
            _server_errors(recorder.server_error),
            recorded_metrics(recorder.strategy_metrics),
        ):
            engine.run_server_app(
                app.server_app,
                app.client_source(),
                num_supernodes,
                run_config=app.run_config,
                participation=participation,
                observer=recorder,
                round_log=recorder,
                secrets=source,
            )
        recorder.close()
    return recorder


class _ErrorsOf(logging.Filter):
    """On Flower's logger: passes every record on, and hands the text of each ERROR of the
    server side to ``sink`` (not Flower's client code, which an in-process worker runs in
    this process too)."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        super().__init__()
        self.sink = sink

    def filter(self, record: logging.LogRecord) -> bool:
        client_side = re.search(r"[\\/]flwr[\\/](client|clientapp)[\\/]", record.pathname)
        if record.levelno >= logging.ERROR and not client_side:
            self.sink(record.getMessage())
        return True


@contextlib.contextmanager
def _server_errors(sink: Callable[[str], None]) -> Iterator[None]:
    """While the ServerApp runs, every error it logs through Flower's logger goes to ``sink``:
    Flower's workflows stop a round by logging one (SecAgg+'s ``Insufficient available
    nodes.``) and returning, so the round is marked incomplete rather than finished. A filter,
    not a handler: the console detaches the handlers of Flower's logger."""
    flower = logging.getLogger("flwr")
    errors = _ErrorsOf(sink)
    flower.addFilter(errors)
    try:
        yield
    finally:
        flower.removeFilter(errors)


def _summary(
    app: FlowerApp, num_supernodes: int, recorder: RoundRecorder, engine: Engine, seconds: float
) -> dict[str, Any]:
    """summary.json of a Flower app's run (with what a fedsim strategy adds: its final
    privacy report and why it stopped, as ``fedsim run`` writes them)."""
    rounds = [r for r in recorder.records if r["round"] >= 1]
    return {
        "app_dir": str(app.app_dir),
        "components": {"serverapp": app.serverapp, "clientapp": app.clientapp},
        "run_config": app.run_config,
        "federation": app.federation.name,
        "num_supernodes": num_supernodes,
        "rounds": len(rounds),
        "rounds_incomplete": sum(bool(r.get("incomplete")) for r in rounds),
        "clients_trained": sum(r.get("train", {}).get("clients", 0) for r in rounds),
        "seconds": {"total": seconds, "engine_startup": dict(engine.startup_s)},
        "final": recorder.records[-1] if recorder.records else None,
        "engine": engine.describe(),
        "versions": {"fedsim": __version__, "python": platform.python_version()},
        **recorder.run_summary,
        **recorder.summary_privacy(),
    }


def _described(participation: CohortModel | None) -> dict[str, Any] | None:
    """The cohort model the grid used, as summary.json records it (None: every node)."""
    if participation is None:
        return None
    drawn = {"cohorts": "secret" if participation.secret_draws else "public"}
    if isinstance(participation, PoissonCohort):
        return {"sampling": "poisson", "rate": participation.rate, **drawn}
    return {"sampling": "uniform", "clients_per_round": participation.cohort_size, **drawn}
