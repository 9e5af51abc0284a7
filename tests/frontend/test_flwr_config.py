"""`fedsim flwr-run APP` resolves Flower's simulation config as `flwr run` (Flower 1.42) does:
$FLWR_HOME/config.toml SuperLink connections, the app's older [tool.flwr.federations],
--federation-config over Flower's DEFAULT_SIMULATION_CONFIG, then fedsim's flags; bad values
are refused by name."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend import flwr_app
from fedsim.frontend.flwr_federation import Federation, parse_federation_config, read_federation

QUICKSTART = Path(__file__).parents[1] / "apps" / "quickstart"  # declares no federations
FLOWER_NODES = DEFAULT_SIMULATION_CONFIG.num_supernodes
FLOWER_CPUS = float(DEFAULT_SIMULATION_CONFIG.client_resources_num_cpus)


@pytest.fixture
def flwr_home(tmp_path, monkeypatch):
    home = tmp_path / "flwr-home"
    home.mkdir()
    monkeypatch.setenv("FLWR_HOME", str(home))
    return home


def write_config(home: Path, text: str) -> None:
    (home / "config.toml").write_text(text)


@pytest.fixture
def launched(monkeypatch):
    """What each flwr-run would run (its federation, supernodes and engine config), not run."""
    seen = []

    def capture(app, num_supernodes, out_dir, *, engine, **kwargs):
        seen.append((app.federation, num_supernodes, engine.config))
        return {"rounds": 0}

    monkeypatch.setattr(flwr_app, "run_flower_app", capture)
    return seen


def flwr_run(app: Path, out: Path, *args: str, superlink: str | None = None) -> int:
    """``fedsim flwr-run APP [SUPERLINK] ARGS`` for one round on the local backend."""
    argv = ["flwr-run", str(app), *([superlink] if superlink else []), "--backend", "local"]
    argv.append("--no-progress")
    return main([*argv, "--run-config", "num-server-rounds=1", *args, "--out", str(out)])


def test_an_app_without_federations_runs_with_no_flags_on_flowers_defaults(flwr_home, tmp_path):
    assert FLOWER_NODES == 2  # Flower 1.42's DEFAULT_SIMULATION_CONFIG
    assert flwr_run(QUICKSTART, tmp_path / "o") == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["num_supernodes"] == FLOWER_NODES
    assert summary["federation"] == "local"  # the default connection of Flower's own file
    assert summary["rounds"] == 1 and summary["final"]["train"]["messages"] == FLOWER_NODES
    assert not list(flwr_home.iterdir())  # Flower's config file is read, never written


def test_flowers_client_resources_are_the_workers_when_nothing_is_set(
    flwr_home, tmp_path, launched
):
    assert flwr_run(QUICKSTART, tmp_path / "o") == 0
    federation, nodes, config = launched[-1]
    assert nodes == FLOWER_NODES and federation.source == "Flower's defaults"
    assert config.cpus_per_worker == FLOWER_CPUS == 2.0
    assert config.gpus_per_worker is None and config.device == "cpu"


CONFIG_TOML = """
[superlink]
default = "sim"

[superlink.sim]
address = ":local:"
options.num-supernodes = 5
options.backend.client-resources.num-cpus = 1

[superlink.gpu]
options.num-supernodes = 3
options.backend.client-resources.num-gpus = 0.5

[superlink.remote]
address = "127.0.0.1:9093"
insecure = true
"""


def test_the_local_connection_of_flowers_config_file_is_honoured(flwr_home, tmp_path, launched):
    write_config(flwr_home, CONFIG_TOML)
    assert flwr_run(QUICKSTART, tmp_path / "a") == 0  # [superlink] default = "sim"
    federation, nodes, config = launched[-1]
    assert (federation.name, nodes, config.cpus_per_worker) == ("sim", 5, 1.0)
    assert federation.source.endswith("config.toml [superlink.sim] options")
    # SUPERLINK as `flwr run APP SUPERLINK`; options without an address are a local simulation;
    # a key it leaves out is Flower's default
    assert flwr_run(QUICKSTART, tmp_path / "b", "--device", "cuda", superlink="gpu") == 0
    federation, nodes, config = launched[-1]
    assert (federation.name, nodes) == ("gpu", 3)
    assert config.gpus_per_worker == 0.5 and config.cpus_per_worker == FLOWER_CPUS
    assert flwr_run(QUICKSTART, tmp_path / "c", "--federation", "sim", "--num-supernodes", "7") == 0
    assert launched[-1][1] == 7  # a flag over the connection


def test_federation_config_replaces_the_options_over_flowers_defaults(
    flwr_home, tmp_path, launched
):
    write_config(flwr_home, CONFIG_TOML)
    args = ("--federation-config", "num-supernodes=4 init-args-num-cpus=2")
    assert flwr_run(QUICKSTART, tmp_path / "a", *args) == 0
    federation, nodes, config = launched[-1]
    assert nodes == 4 and config.num_cpus == 2 and federation.source == "--federation-config"
    assert config.cpus_per_worker == FLOWER_CPUS  # the connection's options.* are not read
    toml = tmp_path / "sim.toml"
    toml.write_text("num-supernodes = 6\nclient-resources-num-cpus = 0.5\n")
    assert flwr_run(QUICKSTART, tmp_path / "b", "--federation-config", str(toml)) == 0
    assert launched[-1][1] == 6 and launched[-1][2].cpus_per_worker == 0.5
    assert flwr_run(QUICKSTART, tmp_path / "c", *args, "--num-supernodes", "9") == 0
    assert launched[-1][1] == 9  # fedsim's flag last


LEGACY = """
[tool.flwr.federations]
default = "local-simulation"

[tool.flwr.federations.local-simulation]
options.num-supernodes = 10
options.backend.client-resources.num-cpus = 1

[tool.flwr.federations.sim]
options.num-supernodes = 8
"""


def test_the_older_pyproject_table_is_still_read(flwr_home, tmp_path, launched):
    app = tmp_path / "app"
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    with (app / "pyproject.toml").open("a") as file:
        file.write(LEGACY)
    write_config(flwr_home, CONFIG_TOML)
    # as `flwr run` migrates it: its default becomes the default connection...
    assert flwr_run(app, tmp_path / "a") == 0
    federation, nodes, config = launched[-1]
    assert (federation.name, nodes, config.cpus_per_worker) == ("local-simulation", 10, 1.0)
    # ...each federation replaces the connection of its name, the others stay
    assert flwr_run(app, tmp_path / "b", superlink="sim") == 0
    assert launched[-1][0].name == "sim" and launched[-1][1] == 8
    assert launched[-1][2].cpus_per_worker == FLOWER_CPUS
    assert flwr_run(app, tmp_path / "c", "--device", "cuda", superlink="gpu") == 0
    assert launched[-1][1] == 3


def test_read_federation_follows_flowers_order(flwr_home):
    assert read_federation({}) == Federation("local", FLOWER_NODES, FLOWER_CPUS, None, None,
                                             "Flower's defaults")
    write_config(flwr_home, CONFIG_TOML)
    assert read_federation({}).num_supernodes == 5
    assert read_federation({}, "sim", "client-resources-num-gpus=0").client_gpus == 0.0
    legacy = {"tool": {"flwr": {"federations": {"default": "sim", "sim": {
        "options": {"num-supernodes": 12}}}}}}
    assert read_federation(legacy) == Federation("sim", 12, FLOWER_CPUS, None, None,
                                                 "[tool.flwr.federations.sim] options")


def federations(table: dict) -> dict:
    return {"tool": {"flwr": {"federations": table}}}


@pytest.mark.parametrize(
    ("config", "project", "name", "overrides", "needle"),
    [
        (CONFIG_TOML, {}, "nope", None, "SUPERLINK (--federation) = 'nope' is not allowed: a "
         "SuperLink connection of"),
        (CONFIG_TOML, {}, "remote", None, "[superlink.remote] address = '127.0.0.1:9093' is not "
         "allowed: a local simulation"),
        ('[superlink]\ndefault = "supergrid"\n[superlink.supergrid]\naddress = "api.flower.ai"\n',
         {}, None, None, "address = 'api.flower.ai'"),
        ('[superlink]\ndefault = "gone"\n', {}, None, None, "[superlink] default = 'gone'"),
        ("[superlink\n", {}, None, None, "Flower's config file in valid TOML"),
        ("[superlink.x]\noptions.num-supernodes = 0\n", {}, "x", None,
         "[superlink.x] options.num-supernodes = 0 is not allowed: an integer >= 1"),
        ("[superlink.x]\noptions.num-supernodes = 2.5\n", {}, "x", None,
         "options.num-supernodes = 2.5"),
        ("[superlink.x]\noptions.num-supernodes = 2\noptions.backend.name = 'mp'\n", {}, "x",
         None, "options.backend.name = 'mp' is not allowed: \"ray\""),
        ("[superlink.x]\noptions.num-supernodes = 2\noptions.workers = 3\n", {}, "x", None,
         "options.workers = 3 is not allowed: one of options.num-supernodes"),
        ("[superlink.x]\naddress = ':local:'\nport = 1\n", {}, "x", None, "[superlink.x] port = 1"),
        ("[superlink.x]\ninsecure = true\n", {}, "x", None, "[superlink.x] address = None"),
        ("", federations({"x": {"options": {"num-supernodes": 2}}}), "x", None,
         "[tool.flwr.federations] default = None is not allowed: the name of a federation of "
         "the app: x"),
        ("", federations({"default": "x", "x": {"options": {"num-supernodes": 2, "backend": {
            "client-resources": {"num-gpus": -1}}}}}), None, None,
         "[tool.flwr.federations.x] options.backend.client-resources.num-gpus = -1 is not "
         "allowed: a number >= 0"),
        ("", {}, None, "num-supernodes=0", "--federation-config num-supernodes = 0 is not "
         "allowed: an integer >= 1"),
        ("", {}, None, "num-clients=4", "--federation-config num-clients = 4 is not allowed: a "
         "key of Flower's simulation config: num-supernodes, client-resources-num-cpus"),
        ("", {}, None, "client-resources-num-cpus=0", "client-resources-num-cpus = 0"),
        ("", {}, None, "backend='local'", "--federation-config backend = 'local'"),
        ("", {}, None, "num-supernodes=4 stray", "--federation-config = 'stray'"),
        ("", {}, None, "verbose=yes", "--federation-config verbose = 'yes'"),
    ],
)
def test_bad_values_are_refused_by_name(flwr_home, config, project, name, overrides, needle):
    if config:
        write_config(flwr_home, config)
    with pytest.raises(ConfigError) as err:
        read_federation(project, name, overrides)
    assert needle in str(err.value)


def test_bad_values_stop_flwr_run_before_it_starts(flwr_home, tmp_path, capsys, launched):
    write_config(flwr_home, CONFIG_TOML)
    for superlink, args, needle in [
        ("remote", (), "address = '127.0.0.1:9093'"),
        (None, ("--federation-config", "num-supernodes=-1"), "num-supernodes = -1"),
        ("sim", ("--federation", "gpu"), "--federation = 'gpu' is not allowed: nothing, or the "
         "same as SUPERLINK (sim)"),
    ]:
        assert flwr_run(QUICKSTART, tmp_path / "o", *args, superlink=superlink) == 2
        assert needle in capsys.readouterr().err
    assert not launched and not (tmp_path / "o").exists()


def test_a_federation_config_file_must_be_readable(tmp_path):
    with pytest.raises(ConfigError, match="--federation-config = .*a readable TOML file"):
        parse_federation_config(str(tmp_path / "missing.toml"))
    assert parse_federation_config('init-args-logging-level="INFO" num_supernodes=3') == {
        "init_args_logging_level": "INFO",
        "num_supernodes": 3,  # `flwr run` takes the proto's field names too
    }


def test_a_component_that_needs_a_missing_package_says_which(
    flwr_home, tmp_path, capsys, monkeypatch
):
    """The reference is read as Flower reads it; a module whose import needs a package this
    environment lacks (as e2e-opacus needs torchvision) is refused naming the package, and a
    module the app does not have is refused as not importable."""
    app = tmp_path / "app"
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    module = app / "quickstart_app" / "client_app.py"
    module.write_text("import fedsim_absent_package  # noqa\n" + module.read_text())
    for loaded in [m for m in sys.modules if m.split(".")[0] == "quickstart_app"]:
        monkeypatch.delitem(sys.modules, loaded)  # Flower's load_app reuses a loaded module
    monkeypatch.setattr(sys, "path", list(sys.path))  # and puts the app's directory first
    assert flwr_run(app, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "clientapp = 'quickstart_app.client_app:app' is not allowed" in err
    assert "needs the package 'fedsim_absent_package', which this environment lacks" in err
    text = (app / "pyproject.toml").read_text().replace("client_app:app", "client_ap:app")
    (app / "pyproject.toml").write_text(text)
    assert flwr_run(app, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "clientapp = 'quickstart_app.client_ap:app' is not allowed: an importable" in err
    assert not (tmp_path / "o").exists()
