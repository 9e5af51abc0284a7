"""``fedsim sweep``: the cartesian product of --grid values and --seeds, one run directory per
point, an index, one engine (one Ray start) for every point, and re-runs that skip finished
points and resume interrupted ones."""

import json

import pytest

import fedsim.engine.simulation as simulation
import fedsim.frontend.experiment as experiment
from fedsim.cli import main
from fedsim.commands.sweep import INDEX_FILE, parse_seeds, split_values
from fedsim.config import ConfigError
from fedsim.frontend.run_root import RUN_FILE
from fedsim.frontend.rundir import RunDirectory

CONFIG = """
name = "tiny"
seed = 0
rounds = 2

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = {lr}

[strategy]
name = "dp-fedavg"
clients_per_round = 5

[strategy.options]
clipping_norm = 1.0
noise_multiplier = 1.0

[engine]
backend = "{backend}"
"""
GRID = ["--grid", "strategy.options.noise_multiplier=0.8,1.5", "--seeds", "0..1"]
NAMES = [
    "noise_multiplier=0.8,seed=0",
    "noise_multiplier=0.8,seed=1",
    "noise_multiplier=1.5,seed=0",
    "noise_multiplier=1.5,seed=1",
]


def write(tmp_path, backend="local", lr=0.1):
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(backend=backend, lr=lr))
    return path


def index(out):
    return json.loads((out / INDEX_FILE).read_text())


def test_seeds_and_grid_values_parse():
    assert parse_seeds("0..4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds("7") == [7]
    assert split_values('1, 2.5,"a,b",[1,2],{k = 1}') == ["1", "2.5", '"a,b"', "[1,2]", "{k = 1}"]
    for bad in ("4..1", "a..b", "0,0", "-1", "1.5", ""):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--seeds", "3..x"], ["--seeds", "'3..x'", "0..4"]),
        (
            ["--grid", "strategy.clients_per_round=5,abc"],
            ["--grid strategy.clients_per_round", "'abc'", "integer"],
        ),
        (
            ["--grid", "strategy.clients_per_rnd=5"],
            ["--grid", "clients_per_rnd", "clients_per_round"],
        ),
        (["--grid", "engine.workers=1,2"], ["--grid engine.workers", "share one engine"]),
        (["--grid", "client.lr=0.1,0.1"], ["--grid", "distinct values"]),
        (["--grid", "client.lr="], ["--grid", "at least one value"]),
        (
            ["--grid", "seed=1,2", "--seeds", "0..1"],
            ["--seeds seed", "already set by --grid seed"],
        ),
        (
            ["--set", "client.lr=0.2", "--grid", "client.lr=0.1,0.3"],
            ["already set by --set client.lr"],
        ),
        ([], ["--grid", "at least one --grid"]),
    ],
)
def test_bad_flags_are_named_before_anything_runs(tmp_path, capsys, flags, needles):
    out = tmp_path / "sweep"
    assert main(["sweep", str(write(tmp_path)), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err
    assert not out.exists()


def test_a_sweep_writes_one_run_per_point_and_an_index(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", str(write(tmp_path)), "--out", str(out), "--no-progress", *GRID]) == 0
    listed = index(out)
    assert [p["name"] for p in listed["points"]] == NAMES
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == NAMES
    fingerprints = set()
    for point in listed["points"]:
        run_dir = out / point["run_dir"]
        config = json.loads((run_dir / "config.json").read_text())  # the point's own config
        assert config["strategy"]["options"]["noise_multiplier"] == point["values"][
            "strategy.options.noise_multiplier"
        ]
        assert config["seed"] == config["data"]["seed"] == point["values"]["seed"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert point["status"] == "finished" and point["rounds"] == 2
        assert point["epsilon"] == summary["privacy"]["epsilon"]
        assert point["final"]["central"] == summary["final"]["central"]
        fingerprints.add(json.loads((run_dir / RUN_FILE).read_text())["fingerprint"])
    assert len(fingerprints) == 4  # each point has its own secret root
    eps = {p["name"]: p["epsilon"] for p in listed["points"]}
    assert eps[NAMES[0]] == eps[NAMES[1]] > eps[NAMES[2]] == eps[NAMES[3]]  # more noise, less ε
    assert "4 of 4 points finished" in capsys.readouterr().out


def test_a_rerun_skips_finished_points_and_resumes_an_interrupted_one(tmp_path, monkeypatch):
    config, out = write(tmp_path), tmp_path / "sweep"
    args = ["sweep", str(config), "--out", str(out), "--no-progress", *GRID]
    save, saved = RunDirectory.save, []

    def killed_in_the_third_run(self, checkpoint):
        save(self, checkpoint)
        saved.append(self.out.name)
        if self.out.name == NAMES[2] and checkpoint.server_round == 1:
            raise KeyboardInterrupt  # the sweep dies after round 1 of its third point

    monkeypatch.setattr(RunDirectory, "save", killed_in_the_third_run)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    monkeypatch.setattr(RunDirectory, "save", save)
    assert [p["status"] for p in index(out)["points"]] == [
        "finished",
        "finished",
        "interrupted",
        "pending",
    ]
    calls = []
    run_experiment = experiment.run_experiment

    def counted(config, out_dir, **kwargs):
        calls.append((out_dir.name, kwargs["resume"]))
        return run_experiment(config, out_dir, **kwargs)

    monkeypatch.setattr(experiment, "run_experiment", counted)
    assert main(args) == 0
    assert calls == [(NAMES[2], True), (NAMES[3], False)]
    assert [p["status"] for p in index(out)["points"]] == ["finished"] * 4
    resumed = json.loads((out / NAMES[2] / "summary.json").read_text())
    assert resumed["resumed_after_round"] == 1 and resumed["rounds"] == 2
    lines = (out / NAMES[2] / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]

    calls.clear()
    assert main(args) == 0  # everything finished: nothing runs
    assert calls == []
    # a finished point whose stored config is not the point's (the file was edited) is refused
    write(tmp_path, lr=0.2)
    assert main(args) == 2
    assert calls == []


def test_every_point_runs_on_one_ray_start_and_one_worker_pool(tmp_path, ray_session, monkeypatch):
    starts, pools = [], []
    ensure_ray, backend = simulation.ensure_ray, simulation.RayBackend

    def counted_ensure_ray(*args, **kwargs):
        starts.append(args)
        return ensure_ray(*args, **kwargs)

    def counted_backend(*args, **kwargs):
        pools.append(kwargs)
        return backend(*args, **kwargs)

    monkeypatch.setattr(simulation, "ensure_ray", counted_ensure_ray)
    monkeypatch.setattr(simulation, "RayBackend", counted_backend)
    out = tmp_path / "sweep"
    flags = ["--grid", "client.lr=0.05,0.2", "--workers", "1", "--no-progress"]
    assert main(["sweep", str(write(tmp_path, "ray")), "--out", str(out), *flags]) == 0
    points = index(out)["points"]
    assert [p["status"] for p in points] == ["finished", "finished"]
    assert len(starts) == 1 and len(pools) == 1  # Ray and the workers started once for both
    engines = [
        json.loads((out / p["run_dir"] / "summary.json").read_text())["engine"] for p in points
    ]
    assert engines[0]["backend"] == "ray" and engines[0]["workers"] == 1


def test_a_secrets_dir_gives_each_point_its_own_root_outside_the_sweep(tmp_path, capsys):
    from fedsim.randomness import RunSecret

    config, out, keys = write(tmp_path), tmp_path / "sweep", tmp_path / "keys"
    inside = ["sweep", str(config), "--out", str(out), "--seeds", "0,1"]
    assert main([*inside, "--secrets-dir", str(out / "keys")]) == 2
    assert "--secrets-dir" in capsys.readouterr().err and not out.exists()
    assert main([*inside, "--secrets-dir", str(keys), "--no-progress"]) == 0
    assert sorted(p.name for p in keys.iterdir()) == ["seed=0.hex", "seed=1.hex"]
    for name in ("seed=0", "seed=1"):
        record = json.loads((out / name / RUN_FILE).read_text())
        root = RunSecret.load_or_create(keys / f"{name}.hex")
        assert record["root"] == "given" and record["fingerprint"] == root.fingerprint()
        assert len(record["nonce"]) == 32  # each point draws its own run nonce
