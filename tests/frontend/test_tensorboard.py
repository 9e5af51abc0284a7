"""``[output] tensorboard = true``: the run's TensorBoard events, read back with TensorBoard's
own EventAccumulator, hold every round of rounds.jsonl once, also after a resume."""

import sys

import numpy as np
import pytest
from run_dir_support import expected, private, rounds, run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import fedsim.frontend.run_config as run_config
import fedsim.frontend.rundir as rundir
from fedsim.config import ConfigError
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.frontend.run_series import round_values
from fedsim.frontend.tensorboard_events import TensorBoardEvents

SHOWN = ("central/accuracy", "central/loss", "privacy/epsilon", "bytes_up", "bytes_down", "seconds")


def with_tensorboard(seed):
    raw = private(seed=seed, noise_multiplier=1.2)
    raw["output"] = {"tensorboard": True}
    return raw


def scalars(run_dir):
    """tag -> [(step, value)] of the run's event files."""
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def as_float32(xs, ys):
    return [(x, float(np.float32(y))) for x, y in zip(xs, ys)]


def test_events_are_the_rounds_values(tmp_path):
    out = tmp_path / "run"
    run(with_tensorboard(seed=5), out)
    records = rounds(out)
    read = scalars(out)
    assert set(read) == {name for record in records for name in round_values(record)}
    for tag in SHOWN:
        assert read[tag] == as_float32(*expected(records, tag)), tag
    assert [step for step, _ in read["central/accuracy"]] == [0, 2, 3]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_a_resumed_run_writes_each_round_once(tmp_path, monkeypatch):
    real_save = rundir.save_checkpoint

    def dies_at_round_2(directory, checkpoint, **kwargs):
        if checkpoint.server_round == 2:
            raise KeyboardInterrupt  # the process stops while writing this checkpoint
        return real_save(directory, checkpoint, **kwargs)

    monkeypatch.setattr(rundir, "save_checkpoint", dies_at_round_2)
    out = tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        run(with_tensorboard(seed=6), out)
    assert [step for step, _ in scalars(out)["seconds"]] == [1, 2]  # round 2 was written
    monkeypatch.setattr(rundir, "save_checkpoint", real_save)

    run(with_tensorboard(seed=6), out, resume=True)  # from the checkpoint of round 1
    records = rounds(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    read = scalars(out)
    for tag in SHOWN:
        assert read[tag] == as_float32(*expected(records, tag)), tag  # each round once


def test_a_missing_package_is_named_by_the_key(monkeypatch, tmp_path):
    monkeypatch.setattr(run_config, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as refused:
        ExperimentConfig.from_dict(with_tensorboard(seed=0))
    assert refused.value.key == "output.tensorboard"
    assert "tensorboard package is not installed" in str(refused.value)

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError) as failed:
        TensorBoardEvents(tmp_path)
    assert failed.value.key == "output.tensorboard"
    assert not (tmp_path / "tensorboard").exists()
