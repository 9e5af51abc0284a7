"""``fedsim run`` with the matrix-mechanism strategy: epsilon per round, checkpoint and resume."""

import json
import logging

import dp_accounting as dpa
import pytest
from dp_accounting.rdp import RdpAccountant

from fedsim.cli import main
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.rundir import RunDirectory
from fedsim.randomness import RunSecret

RUN = """
name = "mm"
seed = 3
rounds = 6

[data]
source = "digits"
partition = "iid"
num_clients = 30

[model]
kind = "logreg"

[client]
epochs = 1
batch_size = 16
lr = 0.2

[strategy]
name = "matrix-mechanism"
clients_per_round = 10
sampling = "min-separation"
options = {{ {options} }}

[evaluation]
every = 3
central_rows = 200

[engine]
backend = "local"
"""
TIMING = ("seconds", "time_s", "clients_per_s", "compute_s")


@pytest.fixture(autouse=True)
def _quiet_dp_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)


def strip_times(record):
    if isinstance(record, dict):
        return {k: strip_times(v) for k, v in record.items() if k not in TIMING}
    return record


def write(tmp_path, options):
    path = tmp_path / "mm.toml"
    path.write_text(RUN.format(options=options))
    return path


def test_run_reports_epsilon_each_round_ending_at_the_gaussian_of_z(tmp_path):
    z = 1.2
    config = write(tmp_path, f"clipping_norm = 0.5, noise_multiplier = {z}, bands = 3")
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    eps = [r["privacy"]["epsilon"] for r in rounds]
    assert len(eps) == 6 and all(b >= a for a, b in zip(eps, eps[1:]))
    # 3 groups of 10: k = 2 participations, 3-banded column-normalised C: sens = sqrt(2)
    assert rounds[-1]["privacy"]["sensitivity"] == pytest.approx(2**0.5)
    gaussian = RdpAccountant().compose(dpa.GaussianDpEvent(z)).get_epsilon(1e-5)
    assert eps[-1] == pytest.approx(gaussian, rel=1e-6)
    assert rounds[0]["aggregated"]["dp-clients"] == 10


def test_run_with_the_tree_restarted_every_two_rounds(tmp_path):
    options = 'clipping_norm = 0.5, noise_multiplier = 1.0, kind = "tree_restart", '
    config = write(tmp_path, options + "kind_options = { restart_every = 2 }")
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    eps = [r["privacy"]["epsilon"] for r in rounds]
    assert len(eps) == 6 and all(b >= a for a, b in zip(eps, eps[1:]))
    # k = 2 participations 3 rounds apart fall in two blocks of 2 rounds, 2 nodes a round
    assert rounds[-1]["privacy"]["sensitivity"] == pytest.approx(2.0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(eps[-1])
    assert summary["final"]["central"]["accuracy"] > 0.2


def test_interrupted_run_resumes_to_the_same_rounds(tmp_path, monkeypatch):
    path = write(tmp_path, "clipping_norm = 0.5, noise_multiplier = 0.8, server_momentum = 0.5")
    config, secrets = ExperimentConfig.load(path), RunSecret.from_passphrase("tests")
    full = tmp_path / "full"
    run_experiment(config, full, progress=False, secrets=secrets)
    expected = [strip_times(r) for r in read_rounds(full / "rounds.jsonl")]

    save = RunDirectory.save

    def save_then_stop(self, checkpoint):
        save(self, checkpoint)
        if checkpoint.server_round == 3:
            raise KeyboardInterrupt  # the process dies right after round 3's checkpoint

    cut = tmp_path / "cut"
    monkeypatch.setattr(RunDirectory, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):  # a replay of the full run: its streams
        run_experiment(config, cut, progress=False, secrets=secrets, replay=full)
    monkeypatch.setattr(RunDirectory, "save", save)
    run_experiment(config, cut, resume=True, progress=False, secrets=secrets)
    assert [strip_times(r) for r in read_rounds(cut / "rounds.jsonl")] == expected


def test_a_bad_option_is_named(tmp_path, capsys):
    config = write(tmp_path, "clipping_norm = 0.5, noise_multiplier = 1.0, bands = 4")
    assert main(["run", str(config), "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "strategy.options.bands = 4" in capsys.readouterr().err
