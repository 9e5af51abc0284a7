"""The command line: fedsim run and fedsim flwr-run, end to end, and their errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedsim.cli import main

HERE = Path(__file__).parents[1]
QUICKSTART = HERE / "apps" / "quickstart"
CONFIG = """
name = "tiny"
seed = 3
rounds = 3

[data]
source = "digits"
partition = "dirichlet"
alpha = 0.5
num_clients = 30

[model]
kind = "mlp"
hidden = [32]

[client]
epochs = 1
batch_size = 8
lr = 0.1

[strategy]
name = "{strategy}"
clients_per_round = 8
{options}

[evaluation]
clients = 4
every = 1

[engine]
backend = "{backend}"
"""


def write_config(tmp_path, backend="local", strategy="fedavg", options=""):
    path = tmp_path / f"{strategy}-{backend}.toml"
    path.write_text(CONFIG.format(backend=backend, strategy=strategy, options=options))
    return path


def rounds(out):
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def strip_times(record):
    if isinstance(record, dict):
        return {
            k: strip_times(v)
            for k, v in record.items()
            if k not in ("seconds", "time_s", "clients_per_s", "compute_s")
        }
    return record


def test_fedsim_run_writes_results_and_repeats_itself(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["run", str(config), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert "results in" in capsys.readouterr().out
    records = rounds(tmp_path / "a")
    assert [r["round"] for r in records] == [0, 1, 2, 3]  # round 0: the initial model
    assert records[1]["train"]["clients"] == 8 and records[1]["evaluate"]["clients"] == 4
    assert {"loss", "accuracy"} <= set(records[3]["central"])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["clients_trained"] == 24
    assert summary["config"]["data"]["seed"] == 3 and (tmp_path / "a" / "model.npz").exists()
    assert main(["run", str(config), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert [strip_times(r) for r in rounds(tmp_path / "b")] == [strip_times(r) for r in records]


@pytest.mark.ray
def test_fedsim_run_on_ray_with_dp_and_poisson(tmp_path, ray_session):
    config = write_config(
        tmp_path,
        backend="ray",
        strategy="dp-fedavg",
        options='sampling = "poisson"\noptions = { clipping_norm = 1.0, noise_multiplier = 0.5 }',
    )
    assert main(["run", str(config), "--out", str(tmp_path / "dp"), "--no-progress"]) == 0
    records = rounds(tmp_path / "dp")
    assert records[-1]["aggregated"]["dp-noise-std"] == pytest.approx(0.5 * 1.0 / 8)
    sizes = [r["train"]["clients"] for r in records[1:] if "train" in r]
    assert all(0 < s < 30 for s in sizes)


@pytest.mark.ray
def test_flwr_run_runs_a_flower_app_project(tmp_path, ray_session):
    out = tmp_path / "flwr"
    code = main(
        [
            "flwr-run",
            str(QUICKSTART),
            "--num-supernodes",
            "6",
            "--out",
            str(out),
            "--run-config",
            "num-server-rounds=2 local-epochs=1",
            "--no-progress",
            "--secrets",
            str(tmp_path / "root.hex"),
        ]
    )
    assert code == 0
    assert oct((tmp_path / "root.hex").stat().st_mode & 0o777) == "0o600"  # created, private
    records = rounds(out)
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["train"]["clients"] == 6 and records[0]["evaluate"]["clients"] == 3
    assert records[1]["train"]["metrics"]["times"] == 2.0  # context.state persisted
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_config"]["num-server-rounds"] == 2 and summary["num_supernodes"] == 6


@pytest.mark.parametrize(
    "args,needle",
    [
        (["flwr-run", str(HERE), "--num-supernodes", "4"], "pyproject.toml"),
        (["flwr-run", str(QUICKSTART), "--num-supernodes", "0"], "--num-supernodes = 0"),
        (
            ["flwr-run", str(QUICKSTART), "--num-supernodes", "4", "--run-config", "nope=1"],
            "--run-config",
        ),
        (["flwr-run", str(QUICKSTART), "--num-supernodes", "4", "--workers", "0"], "--workers = 0"),
    ],
)
def test_flwr_run_errors_name_the_argument(tmp_path, capsys, args, needle):
    assert main([*args, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing started, nothing written


def test_a_secrets_file_inside_the_results_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "x"
    inside = str(out / "root.hex")
    args = ["flwr-run", str(QUICKSTART), "--num-supernodes", "2", "--secrets", inside]
    assert main([*args, "--out", str(out), "--no-progress"]) == 2
    assert "outside the run directory" in capsys.readouterr().err
    config = str(write_config(tmp_path))
    assert main(["run", config, "--out", str(out), "--secrets", inside, "--no-progress"]) == 2
    assert "outside the run directory" in capsys.readouterr().err
    assert not out.exists()  # nothing started, nothing written


def test_missing_app_component_is_named(tmp_path, capsys):
    app = tmp_path / "app"
    app.mkdir()
    text = (QUICKSTART / "pyproject.toml").read_text()
    (app / "pyproject.toml").write_text(
        text.replace(
            'clientapp = "quickstart_app.client_app:app"',
            'clientapp = "quickstart_app.client_app:missing"',
        )
    )
    (app / "quickstart_app").symlink_to(QUICKSTART / "quickstart_app")
    assert main(["flwr-run", str(app), "--num-supernodes", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "clientapp" in err and "quickstart_app.client_app:missing" in err


def test_bad_config_and_existing_results_stop_before_work(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        CONFIG.format(backend="local", strategy="fedavg", options="").replace(
            "clients_per_round = 8", "clients_per_round = 31"
        )
    )
    assert main(["run", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "strategy.clients_per_round = 31" in err and "data.num_clients = 30" in err
    assert not (tmp_path / "o").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "rounds.jsonl").write_text('{"round": 1}\n')
    assert main(["run", str(write_config(tmp_path)), "--out", str(tmp_path / "old")]) == 2
    assert "already holds results" in capsys.readouterr().err
    assert (tmp_path / "old" / "rounds.jsonl").read_text() == '{"round": 1}\n'


def test_unreachable_ray_address_fails_fast(tmp_path):
    # A fresh process: no Ray is running in it, so the address is really used.
    env = dict(os.environ, RAY_ADDRESS="")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "run",
            str(write_config(tmp_path, backend="ray")),
            "--out",
            str(tmp_path / "o"),
            "--ray-address",
            "127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--ray-address = '127.0.0.1:9'" in done.stderr and "nothing answers there" in done.stderr
    assert not (tmp_path / "o").exists()
