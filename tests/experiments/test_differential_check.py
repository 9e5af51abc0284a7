"""experiments/differential/run.py, the check that a refactor changes no bit of any method's
run: it covers every registered strategy (and each secure sum and DDGauss mode), its configs
are valid, and ``compare`` tells a changed run from a replayed one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from fedsim.frontend.experiment import build_experiment_strategy, participation_for
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.randomness import RunSecret
from strategies.registry import NAMES

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "differential" / "run.py"


def load():
    spec = importlib.util.spec_from_file_location("differential_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["differential_run"] = module
    spec.loader.exec_module(module)
    return module


def test_every_registered_strategy_has_a_valid_tiny_run():
    check = load()
    names = {check.config(key)["strategy"]["name"] for key in check.STRATEGIES}
    assert names == set(NAMES)
    for key in check.STRATEGIES:
        config = ExperimentConfig.from_dict(check.config(key))
        server = RunSecret.from_passphrase("differential check test").server()
        cohorts = participation_for(config, config.data.num_clients, server)
        assert build_experiment_strategy(config, cohorts) is not None, key


def test_compare_passes_a_replay_and_fails_a_changed_run(tmp_path, capsys):
    check = load()
    root = ["--secrets", str(tmp_path / "root.key")]
    assert check.main(["record", str(tmp_path / "base"), "--only", "dp-fedavg", *root]) == 0
    assert (tmp_path / "root.key").stat().st_mode & 0o077 == 0  # the root is the owner's alone
    assert check.main(["compare", str(tmp_path / "base"), str(tmp_path / "same"),
                       "--only", "dp-fedavg", *root]) == 0
    assert "dp-fedavg: model same, rounds same" in capsys.readouterr().out
    check.DP["noise_multiplier"] = 0.8  # the "refactor" changed the noise
    assert check.main(["compare", str(tmp_path / "base"), str(tmp_path / "changed"),
                       "--only", "dp-fedavg", *root]) == 1
    assert "dp-fedavg: model DIFFERS, rounds DIFFER" in capsys.readouterr().out
