"""experiments/bench/secure_scale.py --workload lenet: LeNet-5 on FEMNIST-like writers under
FedAvg, DDGauss full and DMM full, at a tiny size (cohort 4, 300 registered clients on 8
writers, one round). Checks the stored fields, that the clients really trained (every cohort
client recorded its training, the global model moved) and how client seconds split; never a
wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.bench.secure_workloads import LENET_DIM, STATE_KEY, writer_app  # noqa: E402

SCRIPT = ROOT / "experiments" / "bench" / "secure_scale.py"
MODES = ["fedavg", "ddgauss", "dmm"]
COHORT = 4


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("secure_lenet")
    command = [sys.executable, str(SCRIPT), "--workload", "lenet", "--modes", ",".join(MODES)]
    command += ["--cohorts", str(COHORT), "--population", "300", "--writers", "8"]
    command += ["--rows-per-writer", "20", "--rounds", "1", "--warmup", "0", "--dropout", "0"]
    command += ["--secagg-degree", "2", "--workers", "1"]  # one worker: one actor start per mode
    command += ["--out", str(out / "r.json"), "--md", str(out / "r.md")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "r.json").read_text()), (out / "r.md").read_text()


def test_every_mode_trains_lenet_on_every_cohort_client(measured):
    result, _ = measured
    assert result["settings"]["workload"] == "lenet"
    assert (result["settings"]["writers"], result["settings"]["rows_per_writer"]) == (8, 20)
    assert [p["mode"] for p in result["points"]] == MODES
    for point in result["points"]:
        assert (point["cohort"], point["dim"], point["population"]) == (COHORT, LENET_DIM, 300)
        summary = point["summary"]
        assert summary["measured_rounds"] == 1
        assert summary["train_calls"] == COHORT  # no dropout: each client trained once
        assert 0 < summary["train_s"] <= summary["client_s"]
        assert summary["secure_s"] == pytest.approx(summary["client_s"] - summary["train_s"])
        assert summary["global_change_l2"] > 0  # the global model moved
        assert summary["bytes_up_per_client"] > 0 and summary["bytes_down_per_client"] > 0
        assert len(point["load_average"]) == 3 and len(point["load_average_after"]) == 3


def test_fedavg_moves_the_model_by_the_training_alone(measured):
    """FedAvg adds no noise: its model change is the clients' training; the secure modes'
    noised change is larger (noise of multiplier 1 at a cohort of 4)."""
    result, _ = measured
    change = {p["mode"]: p["summary"]["global_change_l2"] for p in result["points"]}
    assert 0 < change["fedavg"] < change["ddgauss"]
    assert change["fedavg"] < change["dmm"]


def test_ratios_are_taken_from_the_stored_medians(measured):
    result, _ = measured
    rounds = {p["mode"]: p["summary"]["round_s"] for p in result["points"]}
    rows = {p["mode"]: p for p in result["points"]}
    assert rows["fedavg"]["ratio_round_s"] == pytest.approx(1.0)
    assert rows["ddgauss"]["ratio_round_s"] == pytest.approx(rounds["ddgauss"] / rounds["fedavg"])
    assert rows["dmm"]["ratio_vs_ddgauss"] == pytest.approx(rounds["dmm"] / rounds["ddgauss"])
    key = f"C={COHORT} d={LENET_DIM}"
    assert result["ratios"][f"dmm/ddgauss {key}"] == rows["dmm"]["ratio_vs_ddgauss"]
    assert result["ratios"][f"ddgauss {key}"] == rows["ddgauss"]["ratio_round_s"]
    assert len(result["load_average"]) == 3


def test_the_table_has_a_row_per_mode(measured):
    _, table = measured
    for mode in MODES:
        assert f"| {COHORT} | {mode} |" in table


def test_a_registered_client_beyond_the_writers_trains_on_node_modulo_writers():
    seen = []
    inner = ClientApp()

    @inner.train()
    def train(message: Message, context: Context) -> Message:
        seen.append((context.node_config["partition-id"], context.node_config["num-partitions"]))
        context.state["inner"] = ConfigRecord({"touched": 1})
        return Message(content=RecordDict({"w": ArrayRecord()}), reply_to=message)

    app = writer_app(inner, writers=8)
    state = RecordDict()
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 13, "num-partitions": 300},
        state=state,
        run_config={},
    )
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    for server_round in (1, 2):
        content = RecordDict({"config": ConfigRecord({"server-round": server_round})})
        message = Message(content=content, dst_node_id=5, message_type="train")
        TaskIdentity.node_id = 5  # the client answers as node 5, as a worker sets it
        try:
            reply = app(message, context)
        finally:
            TaskIdentity.node_id = 1
        assert not reply.has_error(), reply.error
    assert seen == [(5, 8), (5, 8)]  # 13 % 8, on 8 writers
    assert context.node_config["partition-id"] == 13  # the client's own config is untouched
    record = state[STATE_KEY]
    assert record["rounds"] == 2 and list(record["train-rounds"]) == [1, 2]
    assert all(s >= 0 for s in record["train-s"])
    assert state["inner"]["touched"] == 1  # the inner app wrote the registered client's state
