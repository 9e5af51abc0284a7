"""`fedsim flwr-run` reads the app's older [tool.flwr.federations] as `flwr run` does
(tests/frontend/test_flwr_config.py: the whole resolution): the federation gives the supernodes and
each client's Ray resources, flags override it, and what it cannot use is refused by name;
so are bad --run-config tokens."""

import dataclasses
import json
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend import flwr_app
from fedsim.frontend.flwr_federation import Federation, read_federation, with_flags

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower_app_dp"


def project(federations: dict) -> dict:
    return {"tool": {"flwr": {"federations": federations}}}


SIMULATION = {
    "default": "local",
    "local": {"options": {"num-supernodes": 10}},
    "gpu": {
        "options": {
            "num-supernodes": 4,
            "backend": {
                "client-resources": {"num-cpus": 2, "num-gpus": 0.25},
                "init-args": {"num-cpus": 8, "logging-level": "warning"},
            },
        }
    },
    "remote": {"address": "127.0.0.1:9093", "insecure": True},
}


def test_the_default_federation_and_a_named_one_are_read():
    assert read_federation(project(SIMULATION), None) == Federation(
        "local", 10, 2.0, None, None, "[tool.flwr.federations.local] options"
    )  # client-resources.num-cpus: Flower's default, 2
    assert read_federation(project(SIMULATION), "gpu") == Federation(
        "gpu", 4, 2.0, 0.25, 8, "[tool.flwr.federations.gpu] options"
    )
    # no federations: Flower's default connection ("local") on Flower's defaults
    assert read_federation({}, None) == Federation("local", 2, 2.0, None, None, "Flower's defaults")


def default_x(options: dict) -> dict:
    return {"default": "x", "x": {"options": options}}


@pytest.mark.parametrize(
    ("federations", "name", "needle"),
    [
        (SIMULATION, "nope", "SUPERLINK (--federation) = 'nope' is not allowed: a SuperLink "
         "connection of"),
        ({"local": {"options": {"num-supernodes": 2}}}, "local", "[tool.flwr.federations] "
         "default = None"),
        ({**SIMULATION, "default": "missing"}, None, "default = 'missing'"),
        ({**SIMULATION, "default": "remote"}, None, "address = '127.0.0.1:9093'"),
        (SIMULATION, "remote", "address = '127.0.0.1:9093'"),
        (default_x({"num-supernodes": 0}), "x", "options.num-supernodes = 0"),
        (default_x({"num-supernodes": 2.5}), "x", "options.num-supernodes = 2.5"),
        (default_x({"num-supernodes": 2, "backend": {"client-resources": {"num-gpus": -1}}}),
         "x", "client-resources.num-gpus = -1"),
        (default_x({"num-supernodes": 2, "backend": {"client-resources": {"num-cpus": 0}}}),
         "x", "client-resources.num-cpus = 0"),
        (default_x({"num-supernodes": 2, "workers": 3}), "x", "options.workers = 3"),
        (default_x({"backend": {"name": "mp"}}), "x", "backend.name = 'mp'"),
    ],
)
def test_what_a_federation_cannot_give_is_refused_by_name(federations, name, needle):
    with pytest.raises(ConfigError) as err:
        read_federation(project(federations), name)
    assert needle in str(err.value)


def test_flags_override_the_federation():
    federation = Federation("gpu", 4, 2.0, 0.25, 8)
    merged = with_flags(federation, num_supernodes=9, client_cpus=None, client_gpus=0.5)
    assert merged == Federation("gpu", 9, 2.0, 0.5, 8)
    with pytest.raises(ConfigError, match="--num-supernodes = None.*options.num-supernodes"):
        with_flags(Federation(), num_supernodes=None, client_cpus=None, client_gpus=None)
    with pytest.raises(ConfigError, match="--client-gpus = -0.5"):
        with_flags(federation, num_supernodes=None, client_cpus=None, client_gpus=-0.5)


@pytest.fixture
def engine_configs(monkeypatch):
    """The EngineConfig each flwr-run builds (run on the local backend)."""
    seen = []
    real = flwr_app.Engine

    def capture(config, **kwargs):
        seen.append(config)
        return real(dataclasses.replace(config, backend="local"), **kwargs)

    monkeypatch.setattr(flwr_app, "Engine", capture)
    return seen


def flwr_run(out: Path, *args: str) -> int:
    argv = ["flwr-run", str(EXAMPLE), "--run-config", "num-server-rounds=1", "--no-progress"]
    return main([*argv, *args, "--out", str(out)])


def test_flwr_run_takes_the_supernodes_and_resources_from_the_federation(tmp_path, engine_configs):
    assert flwr_run(tmp_path / "default") == 0  # the default federation: local, 20 supernodes
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["federation"] == "local" and summary["num_supernodes"] == 20
    assert summary["final"]["train"]["messages"] == 10  # fraction-train 0.5 of 20
    assert engine_configs[-1].cpus_per_worker == 1.0 and not engine_configs[-1].gpus_per_worker
    assert engine_configs[-1].device == "cpu"
    assert flwr_run(tmp_path / "gpu", "--federation", "local-gpu", "--num-supernodes", "8") == 0
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["federation"] == "local-gpu" and summary["num_supernodes"] == 8
    assert engine_configs[-1].gpus_per_worker == 0.25  # a quarter GPU per worker, via Ray
    assert engine_configs[-1].device == "cuda"  # GPUs reserved for the workers' own use
    args = ("--federation", "local-gpu", "--client-gpus", "0.5", "--client-cpus", "2")
    assert flwr_run(tmp_path / "flags", *args) == 0
    assert engine_configs[-1].gpus_per_worker == 0.5 and engine_configs[-1].cpus_per_worker == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--federation", "cloud"), "SUPERLINK (--federation) = 'cloud' is not allowed: a "
         "SuperLink connection of"),
        (("--run-config", "num-server-rounds=1 stray"), "--run-config = 'stray'"),
        (("--run-config", "lr=fast"), "--run-config lr = 'fast'"),
        (("--run-config", "lr=1 momentum=0.9"), "--run-config momentum = 0.9 is not allowed: a "
         "key of [tool.flwr.app.config]"),
        (("--run-config", "local-epochs=1.5"), "--run-config local-epochs = 1.5"),
        (("--run-config", 'strategy=2'), "--run-config strategy = 2"),
        (("--clients-per-round", "3"), "--clients-per-round = 3 is not allowed: nothing "
         "without --sampling"),
        (("--sampling", "uniform", "--clients-per-round", "21"), "--clients-per-round = 21"),
    ],
)
def test_flwr_run_refuses_bad_flags_naming_them(tmp_path, capsys, args, needle):
    argv = ["flwr-run", str(EXAMPLE), "--backend", "local", "--no-progress"]
    assert main([*argv, *args, "--out", str(tmp_path / "o")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o" / "summary.json").exists()
