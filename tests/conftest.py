"""Shared fixtures: one Ray instance for the session, a shared engine, a local engine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

APPS = Path(__file__).parent / "apps"
QUICKSTART = APPS / "quickstart"
sys.path.insert(0, str(QUICKSTART))  # the quickstart app's package, for in-process use


@pytest.fixture(autouse=True, scope="session")
def _session_secrets_dir(tmp_path_factory):
    """Runs keep their secret roots in a temporary directory, never the user's home: also
    the runs that module- and session-scoped fixtures start."""
    from fedsim.randomness import SECRETS_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRETS_DIR_ENV, str(tmp_path_factory.mktemp("secrets")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _flwr_home(tmp_path_factory):
    """Flower's home (its config.toml of SuperLink connections) is an empty temporary
    directory, never the user's: `fedsim flwr-run` reads it as `flwr run` does."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLWR_HOME", str(tmp_path_factory.mktemp("flwr-home")))
        yield


@pytest.fixture(autouse=True)
def _secrets_dir(tmp_path_factory, monkeypatch, _session_secrets_dir):
    """A test's own directory of kept roots (empty when the test starts)."""
    from fedsim.randomness import SECRETS_DIR_ENV

    path = tmp_path_factory.mktemp("secrets")
    monkeypatch.setenv(SECRETS_DIR_ENV, str(path))
    return path


@pytest.fixture(scope="session")
def _ray():
    """One local Ray instance (2 CPUs) for the whole session."""
    import ray

    from fedsim.engine.cluster import ensure_ray

    started = ensure_ray(num_cpus=2, object_store_mb=256)
    yield ray
    if started is not None:
        ray.shutdown()


@pytest.fixture(scope="session")
def _shared_engine(_ray):
    """Holds the session's shared engine while it is up (see ``ray_engine``)."""
    holder = {"engine": None}
    yield holder
    if holder["engine"] is not None:
        holder["engine"].close()


@pytest.fixture
def ray_session(_ray, _shared_engine):
    """Ray with all of its CPUs free, for tests that start their own workers or
    actors: the shared engine's workers hold both CPUs, so it is closed first."""
    if _shared_engine["engine"] is not None:
        _shared_engine["engine"].close()
        _shared_engine["engine"] = None
    return _ray


@pytest.fixture
def ray_engine(_ray, _shared_engine):
    """A started Ray engine with two workers, shared by consecutive tests."""
    from fedsim.engine import Engine, EngineConfig

    if _shared_engine["engine"] is None:
        _shared_engine["engine"] = Engine(EngineConfig(workers=2)).start()
    return _shared_engine["engine"]


@pytest.fixture
def local_engine():
    """The in-process engine (one worker in the test process)."""
    from fedsim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(backend="local")).start()
    yield engine
    engine.close()


class _ClientsWithSecrets:
    """Builds ClientApps that find their own secret in ``node_config``, as the engine gives it
    to the clients of a run with a ``RunSecret`` (the phrase travels, since a RunSecret refuses
    pickling)."""

    def __call__(self, app, phrase: str = "tests"):
        from flwr.clientapp import ClientApp

        from fedsim.randomness import NODE_SECRET_KEY, RunSecret

        class WithSecrets(ClientApp):
            def __call__(self, message, context):
                partition = int(context.node_config["partition-id"])
                secret = RunSecret.from_passphrase(phrase).client(partition)
                context.node_config[NODE_SECRET_KEY] = secret.token()
                return app(message, context)

        return WithSecrets()


@pytest.fixture
def client_secrets():
    """``client_secrets(app, phrase)``: ``app`` with each client's secret in its node_config,
    derived from ``RunSecret.from_passphrase(phrase)``."""
    return _ClientsWithSecrets()
