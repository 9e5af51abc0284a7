"""Checkpoint and resume: a killed run, resumed, writes what an uninterrupted run writes."""

import json
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest

import fedsim.frontend.rundir as rundir
from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret

CONFIG = """
seed = 11
rounds = 6
checkpoint_every = 1
state_memory_mb = 0

[data]
source = "digits"
partition = "dirichlet"
alpha = 0.5
num_clients = 24

[model]
kind = "mlp"
hidden = [16]

[client]
epochs = 1
batch_size = 8
lr = 0.1
momentum = 0.9
keep_momentum = true

[strategy]
name = "dp-fedavg"
clients_per_round = 6
sampling = "poisson"
options = { clipping_norm = 1.0, noise_multiplier = 0.3 }

[evaluation]
clients = 3
every = 1

[faults]
dropout = 0.15

[engine]
backend = "local"
"""

TIMING = ("seconds", "time_s", "clients_per_s", "compute_s")


def strip_times(record):
    if isinstance(record, dict):
        return {k: strip_times(v) for k, v in record.items() if k not in TIMING}
    return record


PASSPHRASE = "tests"


def secret_root() -> RunSecret:
    """The fixed secret root that resuming needs."""
    return RunSecret.from_passphrase(PASSPHRASE)


@pytest.fixture
def secrets():
    return secret_root()


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    return path


def run(config, out, secrets, resume=False, replay=None):
    return run_experiment(
        ExperimentConfig.load(config),
        out,
        resume=resume,
        progress=False,
        secrets=secrets,
        replay=replay,
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted run of CONFIG (read only; a test that writes into it copies it) and
    its rounds without timings."""
    base = tmp_path_factory.mktemp("resume")
    (base / "run.toml").write_text(CONFIG)
    run(base / "run.toml", base / "full", secret_root())
    return base / "full", [strip_times(r) for r in read_rounds(base / "full" / "rounds.jsonl")]


def forked_run(config: Path, out: Path, replay: Path) -> int:
    """A replay of ``replay``'s run of ``config`` into ``out``, in a child forked from this
    process (its own process, to be killed); the child's pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            run(config, out, secret_root(), replay=replay)
        except BaseException:  # noqa: BLE001  (reported by the exit status and stderr)
            traceback.print_exc()
        finally:
            os._exit(1)
    return pid


def test_killed_run_resumes_to_the_same_rounds(tmp_path, config, secrets, full_run):
    full, expected = full_run
    assert [r["round"] for r in expected] == list(range(7))

    killed = tmp_path / "killed"
    # the same streams as the full run: a replay of it (a fresh run draws a fresh nonce)
    pid = forked_run(config, killed, full)
    deadline = time.monotonic() + 300
    while len(read_rounds(killed / "rounds.jsonl")) < 4:  # rounds 0..3 written
        assert os.waitpid(pid, os.WNOHANG)[0] == 0, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not (killed / "summary.json").exists()

    run(config, killed, secrets, resume=True)  # as `fedsim run --resume` does, in this process
    resumed = [strip_times(r) for r in read_rounds(killed / "rounds.jsonl")]
    assert resumed == expected  # nothing lost, nothing duplicated, the same numbers
    summary = json.loads((killed / "summary.json").read_text())
    # round 3 was written; its checkpoint may not have been when the kill came
    assert summary["rounds"] == 6 and summary["resumed_after_round"] >= 2
    # the resumed replay says its releases are a copy of the full run's
    assert summary["replay_of"]["run_dir"] == str(full.resolve())
    assert "copy" in summary["replay_of"]["note"]


def test_resume_refuses_a_different_config_or_a_foreign_directory(tmp_path, config, capsys):
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    before = (out / "rounds.jsonl").read_text()
    changed = tmp_path / "changed.toml"
    changed.write_text(CONFIG.replace("lr = 0.1", "lr = 0.2"))
    assert main(["run", str(changed), "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "client" in err and str(out / "config.json") in err
    assert (out / "rounds.jsonl").read_text() == before
    assert main(["run", "--resume", str(tmp_path / "nothing-here")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_resuming_needs_the_runs_secret_root(tmp_path, config, full_run):
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    with pytest.raises(ConfigError, match="the root file this run was started with"):
        run_experiment(ExperimentConfig.load(config), out, resume=True, progress=False)
    with pytest.raises(ConfigError, match="the root this run was started with"):
        run(config, out, RunSecret.from_passphrase("another"), resume=True)


def test_resuming_a_finished_run_rewrites_nothing(tmp_path, config, secrets, full_run):
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    before = (out / "rounds.jsonl").read_bytes()
    run(config, out, secrets, resume=True)
    assert (out / "rounds.jsonl").read_bytes() == before


def test_a_crash_while_checkpointing_resumes_from_the_previous_checkpoint(
    tmp_path, config, secrets, monkeypatch, full_run
):
    full, expected = full_run

    real_save = rundir.save_checkpoint

    def dies_at_round_3(directory, checkpoint, **kwargs):
        if checkpoint.server_round == 3:
            raise KeyboardInterrupt  # the process stops while writing this checkpoint
        return real_save(directory, checkpoint, **kwargs)

    monkeypatch.setattr(rundir, "save_checkpoint", dies_at_round_3)
    out = tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        run(config, out, secrets, replay=full)  # the full run's streams
    monkeypatch.setattr(rundir, "save_checkpoint", real_save)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == [
        "checkpoint-000001.ckpt",
        "checkpoint-000002.ckpt",
    ]
    run(config, out, secrets, resume=True)
    assert [strip_times(r) for r in read_rounds(out / "rounds.jsonl")] == expected
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == [
        "checkpoint-000005.ckpt",
        "checkpoint-000006.ckpt",
    ]


def test_resume_finds_the_kept_root_or_refuses_clearly(tmp_path, config, capsys, _secrets_dir):
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    kept = list(_secrets_dir.iterdir())  # the fresh root, kept outside the run directory
    assert len(kept) == 1 and oct(kept[0].stat().st_mode & 0o777) == "0o600"
    assert kept[0].read_text().strip() not in "".join(
        f.read_text(errors="replace") for f in out.iterdir() if f.is_file()
    )
    other = tmp_path / "other.hex"
    assert main(["run", "--resume", str(out), "--secrets", str(other)]) == 2
    assert "existing file" in capsys.readouterr().err and not other.exists()  # never created
    other.write_text(os.urandom(32).hex())
    assert main(["run", "--resume", str(out), "--secrets", str(other)]) == 2
    assert "the root this run was started with" in capsys.readouterr().err
    kept[0].unlink()  # the kept root is gone: the run cannot continue with its secrets
    assert main(["run", "--resume", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--secrets" in err and str(kept[0]) in err


def test_a_root_file_inside_the_run_directory_is_refused(tmp_path, config, capsys):
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--secrets", str(out / "k.hex")]) == 2
    assert "outside the run directory" in capsys.readouterr().err
    assert not (out / "k.hex").exists()
