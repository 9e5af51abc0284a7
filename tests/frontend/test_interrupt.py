"""Ctrl-C and SIGTERM during ``fedsim run`` (issue 29, point 4): the round in progress is
finished and checkpointed, one line gives the exact ``--resume`` command, the exit status is
130 and no traceback is printed; a second signal stops at once, and the directory still
resumes. Each resumed run is compared with an uninterrupted one: the same rounds.jsonl values
and the same final model.

The interrupted runs are replays of the uninterrupted one (``--replay``), so that all three
draw the same noise streams (a fresh run draws a fresh run nonce)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fedsim
import fedsim.frontend.experiment as experiment
from fedsim.checkpoint import checkpoint_files, round_of
from fedsim.cli import main
from fedsim.frontend.interrupt import Interrupted, StopRequests, stop_requests
from fedsim.frontend.results import read_rounds

ROOT = Path(fedsim.__file__).resolve().parent.parent

CONFIG = """
seed = 5
rounds = 8
checkpoint_every = 4

[data]
source = "digits"
partition = "iid"
num_clients = 20

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = 5
sampling = "poisson"
options = { clipping_norm = 1.0, noise_multiplier = 0.5 }

[evaluation]
every = 1

[engine]
backend = "local"
workers = 1
"""

TIMING = ("seconds", "time_s", "clients_per_s", "compute_s")


def strip_times(record):
    if isinstance(record, dict):
        return {k: strip_times(v) for k, v in record.items() if k not in TIMING}
    return record


def values(out: Path) -> list:
    return [strip_times(r) for r in read_rounds(out / "rounds.jsonl")]


def model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as saved:
        return {k: np.array(saved[k]) for k in saved.files}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted run (and its config and secrets file), in process."""
    base = tmp_path_factory.mktemp("interrupt")
    config = base / "run.toml"
    config.write_text(CONFIG)
    secrets = base / "keys" / "root.hex"
    out = base / "full"
    assert main(["--quiet", "run", str(config), "--out", str(out), "--secrets", str(secrets)]) == 0
    return config, secrets, out


def start(config: Path, secrets: Path, out: Path, replay: Path) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "fedsim", "run", str(config), "--out", str(out)]
    command += ["--secrets", str(secrets), "--replay", str(replay)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_round(proc: subprocess.Popen, out: Path, server_round: int = 1) -> None:
    """Until rounds.jsonl holds ``server_round`` (never a time limit on the run itself)."""
    while not any(r["round"] >= server_round for r in read_rounds(out / "rounds.jsonl")):
        assert proc.poll() is None, f"the run ended first: {proc.communicate()}"
        time.sleep(0.01)


def resume_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "--resume" in line]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def resume_and_compare(line: str, out: Path, full: Path, in_process: bool) -> None:
    command = shlex.split(line.split("to continue: ", 1)[1])
    assert command[:3] == [sys.executable, "-m", "fedsim"]
    assert command[3:6] == ["run", "--resume", str(out)]
    if in_process:
        assert main(command[3:]) == 0
    else:  # the exact command, as printed
        env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=str(ROOT))
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    assert values(out) == values(full)  # nothing lost, nothing duplicated, the same numbers
    expected, got = model(full), model(out)
    assert sorted(got) == sorted(expected)
    for key, array in expected.items():
        assert got[key].tobytes() == array.tobytes(), key


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_after_the_round_and_says_how_to_resume(tmp_path, full, sig):
    config, secrets, done = full
    out = tmp_path / "stopped"
    proc = start(config, secrets, out, done)
    wait_for_round(proc, out)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 130, stderr
    line = resume_line(stderr)
    name = signal.Signals(sig).name
    assert line.startswith(f"fedsim: stopped by {name};")
    assert f"{name} received: stopping after the current round" in stderr
    assert str(secrets) in line  # the root it needs is part of the command
    # the round it stopped after is written and checkpointed, and nothing after it
    rounds = read_rounds(out / "rounds.jsonl")
    last = rounds[-1]["round"]
    assert 1 <= last < 8 and f"rounds up to {last} " in line
    assert round_of(checkpoint_files(out)[0]) == last
    assert not (out / "summary.json").exists() and not (out / "run.lock").exists()
    resume_and_compare(line, out, done, in_process=sig == signal.SIGTERM)


def test_a_second_ctrl_c_stops_at_once_and_the_directory_still_resumes(
    tmp_path, full, monkeypatch, capsys
):
    """Two Ctrl-C in the middle of round 6 (sent from its central evaluation, so that both
    arrive inside the round: two signals sent together from outside may merge into one):
    round 6 is abandoned, and the directory resumes from its checkpoint of round 4."""
    config, secrets, done = full
    out = tmp_path / "twice"
    real = experiment.central_evaluator

    def evaluator(*args):
        evaluate = real(*args)

        def interrupted(server_round, arrays):
            if server_round == 6:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return evaluate(server_round, arrays)

        return interrupted

    monkeypatch.setattr(experiment, "central_evaluator", evaluator)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "fedsim" / "__main__.py")])  # python -m fedsim
    command = ["run", str(config), "--out", str(out), "--secrets", str(secrets)]
    assert main([*command, "--replay", str(done), "--no-progress"]) == 130
    stderr = capsys.readouterr().err
    line = resume_line(stderr)
    assert "a second SIGINT stopped it at once" in line
    assert "keeps its rounds up to the checkpoint of round 4" in line
    assert [r["round"] for r in read_rounds(out / "rounds.jsonl")] == list(range(6))
    assert not (out / "summary.json").exists() and not (out / "run.lock").exists()
    monkeypatch.setattr(experiment, "central_evaluator", real)
    resume_and_compare(line, out, done, in_process=True)


def test_a_second_signal_waits_for_the_write_in_progress():
    """A stop at once is never raised inside a checkpoint or a rounds.jsonl line: it comes
    when that write ends; the first signal only asks, and after_round then stops the run."""
    stops = StopRequests(announce=False)
    stops._handle(signal.SIGINT, None)
    assert stops.requested
    done = []
    with pytest.raises(Interrupted) as err, stops.writing():
        stops._handle(signal.SIGINT, None)  # held back ...
        done.append("written")  # ... so the write finishes
    assert done == ["written"] and err.value.at_once
    later = StopRequests(announce=False)
    later.after_round(3)  # nothing asked: nothing happens
    later._handle(signal.SIGTERM, None)
    with pytest.raises(Interrupted) as err:
        later.after_round(3)
    assert not err.value.at_once and err.value.server_round == 3
    assert err.value.signal_name == "SIGTERM"
    later._handle(signal.SIGTERM, None)  # already stopping: ignored, nothing raised


def test_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_requests(announce=False) as stops:
        assert signal.getsignal(signal.SIGINT) == stops._handle
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init does
        stops.install()
        assert signal.getsignal(signal.SIGTERM) == stops._handle
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
