"""One writer per run directory (issue 29, point 6): a second run into a directory a live run
is writing is refused, naming the holder, and leaves the first run's files whole; a lock left
by a dead run is taken over."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedsim
from fedsim.cli import main
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_lock import LOCK_FILE, RunLock, RunLocked, locked

ROOT = Path(fedsim.__file__).resolve().parent.parent

CONFIG = """
seed = 2
rounds = 30

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
name = "fedavg"
clients_per_round = 5

[engine]
backend = "local"
workers = 1
"""


def test_a_held_lock_refuses_a_second_writer_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    with locked(out, command="fedsim run") as held:
        with pytest.raises(RunLocked) as err:
            RunLock.acquire(out, "--resume")
        message = str(err.value)
        assert message.startswith(f"--resume = '{out}' is not allowed")
        assert f"run pid {os.getpid()} on host {socket.gethostname()}, started " in message
        assert "(fedsim run)" in message and str(out / LOCK_FILE) in message
        assert err.value.holder == held.holder
    assert not (out / LOCK_FILE).exists()  # released: removed
    assert not tmp_path.joinpath("run").exists()  # with the empty directory it made
    RunLock.acquire(out).release()  # and free again
    kept = tmp_path / "kept"
    (kept / "a" / "b").mkdir(parents=True)
    with locked(kept / "a" / "b" / "c" / "d"):
        pass
    assert sorted(p.name for p in kept.rglob("*")) == ["a", "b"]  # only what it made went
    with locked(kept / "a"):
        (kept / "a" / "results.txt").write_text("x")
    assert (kept / "a" / "results.txt").is_file()  # a directory with files stays


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path, caplog):
    out = tmp_path / "run"
    dies = (
        "import os, signal, sys\n"
        "from fedsim.frontend.run_lock import RunLock\n"
        "RunLock.acquire(sys.argv[1])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", dies, str(out)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    stale = json.loads((out / LOCK_FILE).read_text())
    assert stale["pid"] != os.getpid()  # the dead run's details are still in the file
    with caplog.at_level(logging.WARNING, logger="fedsim.frontend.run_lock"):
        lock = RunLock.acquire(out)
    try:
        assert lock.holder["pid"] == os.getpid()
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert f"took over a stale lock of run pid {stale['pid']}" in caplog.text
    finally:
        lock.release()


def test_a_second_run_into_a_running_runs_directory_is_refused(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    secrets = tmp_path / "keys" / "root.hex"
    out = tmp_path / "run"
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "fedsim", "run", str(config), "--out", str(out)]
    first = subprocess.Popen(
        [*command, "--secrets", str(secrets), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not read_rounds(out / "rounds.jsonl"):
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)  # held mid-run (whatever this machine's speed)
    try:
        holder = f"run pid {first.pid} on host {socket.gethostname()}, started "
        again = ["run", str(config), "--out", str(out), "--secrets", str(secrets), "--quiet"]
        codes = [main(again), main(["run", "--resume", str(out), "--secrets", str(secrets)])]
        assert first.poll() is None
    finally:
        os.kill(first.pid, signal.SIGCONT)
    stderr = capsys.readouterr().err
    assert codes == [2, 2], stderr  # both refused while the first holds the directory
    assert stderr.count(holder) == 2, stderr
    assert "fedsim: error: --out = " in stderr and "fedsim: error: --resume = " in stderr
    stdout, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err
    # the first run's files are its own: every round once, its summary, its count
    assert [r["round"] for r in read_rounds(out / "rounds.jsonl")] == list(range(31))
    assert json.loads((out / "summary.json").read_text())["rounds"] == 30
    assert stdout.startswith("fedsim: 30 rounds in ")
    assert not (out / LOCK_FILE).exists()
