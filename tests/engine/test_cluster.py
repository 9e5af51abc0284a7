"""A run on a two-node Ray cluster that the test starts on loopback.

``ray start --head`` plus one ``ray start --address`` node, each with one CPU,
so the run's two workers must land on different nodes; fedsim joins by
``--ray-address`` and ships its packages through Ray's runtime environment.
Each ``ray start --block`` runs in its own process group, which the test kills
at the end, so nothing else on the machine that uses Ray is touched.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedsim.cli import main

RAY = str(Path(sys.executable).with_name("ray"))
CONFIG = """
seed = 5
rounds = 2

[data]
source = "digits"
partition = "iid"
num_clients = 40

[model]
kind = "logreg"

[client]
momentum = 0.5
keep_momentum = true

[strategy]
clients_per_round = 10

[evaluation]
clients = 4

[engine]
backend = "ray"
workers = 2
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_node(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
         "--object-store-memory", str(100 * 2**20), "--disable-usage-stats", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def nodes_alive(address: str, env: dict[str, str]) -> int:
    probe = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR');"
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0


def stop(processes: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in processes:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.2)


@pytest.fixture
def two_node_cluster(tmp_path):
    env = dict(
        os.environ,
        RAY_ADDRESS="",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    address = f"127.0.0.1:{free_port()}"
    port = address.rsplit(":", 1)[1]
    started = [ray_node("--head", "--port", port, "--include-dashboard=false", env=env)]
    try:
        deadline = time.monotonic() + 120
        while True:  # the head must answer before the second node can join
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the head node did not start"
                time.sleep(0.5)
        started.append(ray_node("--address", address, env=env))
        deadline = time.monotonic() + 120
        while nodes_alive(address, env) < 2:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(1)
        yield address, env
    finally:
        stop(started)
        # `ray start --head` names itself the machine's current cluster; forget it.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


@pytest.mark.ray
def test_run_on_a_two_node_cluster_by_address(tmp_path, two_node_cluster):
    address, env = two_node_cluster
    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "fedsim", "run", str(config), "--out", str(out), "--no-progress",
         "--ray-address", address],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"]["workers"] == 2
    assert summary["engine"]["nodes"] == 2  # one worker per node: both nodes trained clients
    assert summary["rounds"] == 2 and summary["clients_trained"] == 20
    # The same numbers as the same config run in one process.
    assert main(["run", str(config), "--out", str(tmp_path / "local"), "--backend", "local",
                 "--no-progress"]) == 0  # fmt: skip
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert summary["final"]["central"] == local["final"]["central"]  # the same model
    for phase in ("train", "evaluate"):  # client metrics, summed in another order
        assert summary["final"][phase] == pytest.approx(local["final"][phase], rel=1e-6)
