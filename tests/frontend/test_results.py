"""Round records: built from phase reports, written line by line, never overwritten."""

import json
import math

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.engine.phase_report import PhaseReport
from fedsim.frontend.results import RoundRecorder, RunWriter, read_rounds
from fedsim.results_json import json_ready


def report(phase, kind, server_round, clients=4, nodes=frozenset()):
    return PhaseReport(
        phase=phase,
        server_round=server_round,
        message_type=kind,
        messages=clients,
        succeeded=clients,
        failed=0,
        timed_out=0,
        dropped=0,
        bytes_down=100,
        bytes_up=50,
        wall_s=0.1,
        compute_s=0.2,
        client_metrics={"loss": 1.0 / (phase + 1)},
        nodes=frozenset(nodes),
    )


def test_inferred_rounds_close_at_a_new_round():
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    recorder.phase_finished(report(0, "train", 1))
    recorder.phase_finished(report(1, "evaluate", 1))
    assert records == []  # another evaluate phase of round 1 may follow
    recorder.phase_finished(report(2, "train", 2))  # closes round 1
    assert [r["round"] for r in records] == [1]
    recorder.phase_finished(report(3, "train", 3))  # a new round closes round 2
    recorder.phase_finished(report(4, "train", None))  # no round number: same round
    recorder.close()
    assert [r["round"] for r in records] == [1, 2, 3]
    assert set(records[0]) >= {"train", "evaluate", "bytes_down", "clients_per_s", "seconds"}
    assert records[0]["bytes_down"] == 200 and records[0]["train"]["clients"] == 4
    assert "evaluate" not in records[1]
    # round 3's two train phases are one section: 8 clients, loss weighted 1/4 and 1/5
    assert records[2]["train"]["clients"] == 8 and records[2]["train"]["messages"] == 8
    assert records[2]["train"]["metrics"]["loss"] == pytest.approx((0.25 + 0.2) / 2)


def test_an_evaluate_phase_without_a_round_number_closes_its_round():
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    for phase in range(4):
        recorder.phase_finished(report(phase, "train" if phase % 2 == 0 else "evaluate", None))
    recorder.close()
    assert [r["round"] for r in records] == [1, 2]


def test_start_grid_phases_of_one_node_each_make_one_round_line():
    """``start_grid`` (``ServerApp(server_fn=...)``): the initial ``get_parameters`` without
    a round number is round 0; each round's one-node phases make one train and one evaluate
    section with every node in it."""
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    recorder.phase_finished(report(0, "get_parameters", None, clients=1, nodes={7}))
    phase = 1
    for server_round in (1, 2):
        for kind in ("train", "evaluate"):
            for node in range(3):
                recorder.phase_finished(report(phase, kind, server_round, 1, nodes={node}))
                phase += 1
    recorder.close()
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[0]["get_parameters"]["clients"] == 1 and "train" not in records[0]
    for record in records[1:]:
        assert record["train"]["clients"] == 3 and record["evaluate"]["clients"] == 3
        assert record["train"]["bytes_down"] == 300 and record["bytes_down"] == 600


def test_explicit_rounds_carry_strategy_sections():
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=False)
    recorder.phase_finished(report(0, "train", 1))
    recorder.phase_finished(report(1, "evaluate", 1))
    recorder.end_round(1, aggregated={"loss": 0.5}, central=None)
    assert (
        len(records) == 1
        and records[0]["aggregated"] == {"loss": 0.5}
        and "central" not in records[0]
    )


def test_writer_appends_lines_and_refuses_old_results(tmp_path):
    writer = RunWriter(tmp_path / "run")
    writer.write_round({"round": 1, "x": float("nan"), "y": np.float32(2.5)})
    writer.write_round({"round": 2})
    writer.write_summary({"rounds": 2})
    writer.close()
    lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]
    assert json.loads(lines[0])["x"] is None and json.loads(lines[0])["y"] == 2.5
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {"rounds": 2}
    with pytest.raises(ConfigError, match="already holds results"):
        RunWriter(tmp_path / "run")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="a file has this name"):
        RunWriter(tmp_path / "file")


def test_json_ready_handles_numpy_and_non_finite():
    assert json_ready({"a": (np.int64(3), math.inf)}) == {"a": [3, None]}


def test_an_infinite_epsilon_is_written_as_1e999_with_its_flag_and_read_back_as_inf(tmp_path):
    writer = RunWriter(tmp_path / "run")
    writer.write_round({"round": 1, "privacy": {"epsilon": math.inf, "delta": 1e-5}})
    writer.write_round({"round": 2, "privacy": {"epsilon": 2.5}, "note": "Infinity"})
    writer.write_summary({"privacy": {"epsilon": math.inf}, "max_client_epsilon": math.inf})
    writer.close()
    text = (tmp_path / "run" / "rounds.jsonl").read_text()
    assert '"epsilon": 1e999' in text and "null" not in text and "Infinity," not in text
    first, second = read_rounds(tmp_path / "run" / "rounds.jsonl")
    assert first["privacy"]["epsilon"] == math.inf and first["privacy"]["epsilon_infinite"] is True
    assert second["privacy"] == {"epsilon": 2.5, "epsilon_infinite": False}
    assert second["note"] == "Infinity"  # a string is left alone
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == math.inf and summary["privacy"]["epsilon_infinite"]
    assert summary["max_client_epsilon"] == math.inf and summary["max_client_epsilon_infinite"]
    # a resumed run rewrites the kept lines the same way
    RunWriter(tmp_path / "run", "--resume", resume_after=2).close()
    assert (tmp_path / "run" / "rounds.jsonl").read_text() == text


def test_a_dp_run_without_noise_reports_epsilon_infinite(tmp_path):
    from fedsim.cli import main

    config = tmp_path / "z0.toml"
    config.write_text(
        'rounds = 1\n[data]\nsource = "digits"\npartition = "iid"\nnum_clients = 6\n'
        '[model]\nkind = "logreg"\n[strategy]\nname = "dp-fedavg"\nclients_per_round = 3\n'
        "[strategy.options]\nclipping_norm = 1.0\nnoise_multiplier = 0.0\n"
        '[engine]\nbackend = "local"\n'
    )
    assert main(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    last = read_rounds(tmp_path / "out" / "rounds.jsonl")[-1]
    assert last["privacy"]["epsilon"] == math.inf and last["privacy"]["epsilon_infinite"] is True
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == math.inf and summary["privacy"]["epsilon_infinite"]


def test_the_stages_of_one_protocol_count_each_node_once():
    """SecAgg+'s four train stages to the same 4 nodes: 16 messages, 4 clients."""
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    for stage in range(4):
        recorder.phase_finished(report(stage, "train", 1, clients=4, nodes=range(4)))
    recorder.close()
    (record,) = records
    assert record["train"]["messages"] == 16 and record["train"]["clients"] == 4
    assert record["train"]["bytes_down"] == 400
    assert record["clients_per_s"] == pytest.approx(4 / record["seconds"])


def test_a_flower_strategys_results_land_in_their_rounds_lines():
    """What a Flower strategy files (fedsim.frontend.flwr_metrics): the initial model's central
    evaluation before any phase is a round-0 line; each round's aggregated metrics and central
    evaluation join that round's line; a loss and metrics of one section make one mapping."""
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    recorder.strategy_metrics(0, "central", {"loss": 4.0})
    recorder.strategy_metrics(0, "central", {"acc": 0.1})
    recorder.phase_finished(report(0, "train", 1))
    assert [r["round"] for r in records] == [0]  # a phase of round 1 closed round 0
    assert records[0]["central"] == {"loss": 4.0, "acc": 0.1} and "train" not in records[0]
    recorder.strategy_metrics(1, "aggregated", {"train_loss": 0.5})
    recorder.phase_finished(report(1, "evaluate", 1))
    recorder.strategy_metrics(1, "aggregated_evaluate", {"loss": 0.6})
    recorder.strategy_metrics(1, "central", {"loss": 0.7})
    recorder.phase_finished(report(2, "train", 2))
    recorder.strategy_metrics(2, "aggregated", {"train_loss": 0.2})
    recorder.close()
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[1]["aggregated"] == {"train_loss": 0.5}
    assert records[1]["aggregated_evaluate"] == {"loss": 0.6}
    assert records[1]["central"] == {"loss": 0.7} and records[1]["train"]["clients"] == 4
    assert records[2]["aggregated"] == {"train_loss": 0.2} and "central" not in records[2]


def test_a_strategy_result_of_the_next_round_closes_the_open_one():
    """Central evaluation of round 2 with no phase of round 2 yet (a strategy that
    evaluates centrally only): round 1's line is closed first."""
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    recorder.phase_finished(report(0, "train", 1))
    recorder.strategy_metrics(1, "central", {"loss": 1.0})
    recorder.strategy_metrics(2, "central", {"loss": 0.5})
    recorder.close()
    assert [(r["round"], r["central"]) for r in records] == [(1, {"loss": 1.0}),
                                                            (2, {"loss": 0.5})]
    assert "train" not in records[1]


def test_results_filed_after_an_evaluate_phase_without_a_round_number_join_its_line():
    """An evaluate phase without a round number ends its round at the next phase, so what
    the strategy aggregates from its replies is still that round's."""
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    recorder.phase_finished(report(0, "train", None))
    recorder.phase_finished(report(1, "evaluate", None))
    recorder.strategy_metrics(1, "aggregated_evaluate", {"loss": 0.3})
    recorder.phase_finished(report(2, "train", None))
    recorder.close()
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["aggregated_evaluate"] == {"loss": 0.3} and "evaluate" in records[0]
    assert "aggregated_evaluate" not in records[1]


def test_a_private_run_keeps_the_strategys_client_aggregates_out_but_central_in():
    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True, private=True)
    recorder.phase_finished(report(0, "train", 1))
    recorder.strategy_metrics(1, "aggregated", {"train_loss": 0.5})
    recorder.strategy_metrics(1, "aggregated_evaluate", {"loss": 0.6})
    recorder.strategy_metrics(1, "central", {"loss": 0.7})
    recorder.close()
    (record,) = records
    assert "aggregated" not in record and "aggregated_evaluate" not in record
    assert record["central"] == {"loss": 0.7} and "metrics" not in record["train"]
    shown = []
    clear = RoundRecorder([shown.append], infer_rounds=True, private=True, metrics_in_clear=True)
    clear.phase_finished(report(0, "train", 1))
    clear.strategy_metrics(1, "aggregated", {"train_loss": 0.5})
    clear.close()
    assert shown[0]["aggregated"] == {"train_loss": 0.5} and shown[0]["metrics_in_clear"]


def test_a_run_whose_boundary_accounts_a_mechanism_keeps_flower_aggregates_out():
    """A Flower strategy's aggregates are un-noised means of the clients' numbers: in a run
    whose release boundary accounted a mechanism they are not written (central is)."""
    from fedsim.engine.boundary import ReleaseBoundary
    from fedsim.privacy.accounting import PoissonSampling, PrivacyLedger
    from fedsim.privacy.round_events import round_event

    class Mechanism:
        accountant = "rdp"

        def __init__(self):
            self.ledger = PrivacyLedger("add_remove", 1e-5)
            self.ledger.record(1, round_event(1.0, PoissonSampling(0.1)))

        def epsilon(self):
            return self.ledger.epsilon()

    records = []
    recorder = RoundRecorder([records.append], infer_rounds=True)
    boundary = ReleaseBoundary()
    recorder.attach_boundary(boundary)
    recorder.phase_finished(report(0, "train", 1))
    recorder.strategy_metrics(1, "aggregated", {"train_loss": 0.5})
    recorder.strategy_metrics(1, "central", {"loss": 0.7})
    boundary.register(Mechanism())
    recorder.close()
    (record,) = records
    assert "aggregated" not in record and record["central"] == {"loss": 0.7}
    assert math.isfinite(record["privacy"]["epsilon"])
