"""``fedsim audit RUN_DIR``: membership inference against finished ``fedsim run`` directories."""

import json
import math

import numpy as np
import pytest

from fedsim.audits.dataset_inference import (
    dataset_inference,
    resample_features,
    row_classifier,
)
from fedsim.audits.run_audit import audit_run
from fedsim.cli import main
from fedsim.config import ConfigError, load_toml
from fedsim.data import build_dataset
from fedsim.frontend.experiment import load_finished_run, trained_clients
from fedsim.frontend.run_config import ExperimentConfig

CONFIG = """
name = "audit"
seed = 4
rounds = {rounds}

[data]
source = "digits"
partition = "iid"
num_clients = 4
test_fraction = 0.9

[model]
kind = "mlp"
hidden = [64]

[client]
epochs = {epochs}
batch_size = 8
lr = 0.1

[strategy]
name = "dp-fedavg"
clients_per_round = 4
options = {{ clipping_norm = {clip}, noise_multiplier = {z} }}

[evaluation]
every = {rounds}

[engine]
backend = "local"
"""


def _run(tmp_path, name, audit="", **values):
    config = tmp_path / f"{name}.toml"
    config.write_text(CONFIG.format(**values) + audit)
    out = tmp_path / name
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(autouse=True)
def _secrets_dir(_session_secrets_dir):
    """This module audits its runs across tests, and an audit authenticates a run's config.json
    under the root fedsim kept for it: the roots stay in the session's directory."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An overfit run without noise (epsilon = inf) and a short noisy one (finite epsilon)."""
    tmp = tmp_path_factory.mktemp("audit-runs")
    return {
        "overfit": _run(tmp, "overfit", rounds=2, epochs=8, clip=100.0, z=0.0),
        "noisy": _run(tmp, "noisy", rounds=1, epochs=1, clip=1.0, z=1.0),
    }


def test_audit_of_an_overfit_run_finds_its_members(runs, capsys):
    run_dir = runs["overfit"]
    assert main(["audit", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((run_dir / "audit.json").read_text())
    assert "loss attack" in printed and "epsilon = inf" in printed
    # 4 clients x ~18 training rows; the held-out side is larger, so all members are used.
    assert result["members"] == result["non_members"] == result["member_rows_available"]
    assert result["clients_trained"] == 4
    assert result["member_mean_loss"] < result["non_member_mean_loss"]
    assert result["auc"] > 0.6 and result["tpr_at_5pct_fpr"] > 0.05
    assert math.isinf(result["epsilon"]) and result["epsilon_infinite"] is True
    written = (run_dir / "audit.json").read_text()
    assert result["epsilon_text"] == "inf" and '"epsilon": 1e999' in written
    # Members are exactly the training rows: the run's dataset has that many.
    dataset = build_dataset(load_finished_run(run_dir).config.data)
    assert result["member_rows_available"] == len(dataset.train.y)
    assert result == audit_run(load_finished_run(run_dir))  # the same rows are drawn again


def test_audit_options_and_the_dp_epsilon(runs, tmp_path):
    run_dir = runs["noisy"]
    out = tmp_path / "nested" / "zlib.json"
    assert (
        main(["audit", str(run_dir), "--attack", "zlib", "--members", "20", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result["attack"] == "zlib" and result["members"] == result["non_members"] == 20
    assert result["epsilon"] == pytest.approx(summary["privacy"]["epsilon"])
    assert 0 < result["epsilon"] < np.inf and result["delta"] == summary["privacy"]["delta"]
    assert not (run_dir / "audit.json").exists()


def test_members_follow_the_cohorts(runs):
    finished = load_finished_run(runs["noisy"])
    assert finished.clients.tolist() == [0, 1, 2, 3]  # 4 of 4, drawn from the server's secret
    with pytest.raises(ConfigError, match="strategy.sampling"):
        trained_clients(finished.config, 4, 1)  # no server secret: the cohorts are not known


def test_audit_errors_name_what_is_wrong(runs, tmp_path, capsys):
    assert main(["audit", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((runs["noisy"] / "config.json").read_text())
    assert main(["audit", str(partial)]) == 2
    err = capsys.readouterr().err
    assert "model.npz" in err and "summary.json" in err and str(partial) in err
    assert main(["audit", str(runs["noisy"]), "--attack", "mink"]) == 2
    assert "--attack = 'mink'" in capsys.readouterr().err
    assert main(["audit", str(runs["noisy"]), "--members", "100000"]) == 2
    assert "--members = 100000" in capsys.readouterr().err
    assert main(["audit", str(runs["noisy"]), "--attack", "ratio"]) == 2
    assert "one of loss, zlib, mink" in capsys.readouterr().err


# --------------------------------------------------------------------------- [audit] and
# dataset inference


def _config_with_audit(tmp_path, audit):
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.format(rounds=1, epochs=1, clip=1.0, z=1.0) + audit)
    return ExperimentConfig.from_dict(load_toml(path))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('attacks = ["ratio"]', "audit.attacks = 'ratio' is not allowed: one of loss, zlib, "),
        ('attacks = ["mink"]', "audit.attacks = 'mink'"),
        ("attacks = []", "audit.attacks = [] is not allowed: one or more of loss, zlib, "),
        ('attacks = ["loss", "loss"]', "audit.attacks = ['loss', 'loss'] is not allowed: distinct"),
        ("members = -1", "audit.members = -1 is not allowed: an integer >= 0"),
        ('members = "all"', "audit.members = 'all'"),
        ("seed = 1.5", "audit.seed = 1.5"),
        ("folds = 3", "audit.folds = 3 is not allowed: a known key"),
    ],
)
def test_audit_table_errors_name_the_key(tmp_path, table, message):
    with pytest.raises(ConfigError) as err:
        _config_with_audit(tmp_path, f"\n[audit]\n{table}\n")
    assert message in str(err.value)


def test_audit_table_defaults(tmp_path):
    assert _config_with_audit(tmp_path, "").audit is None
    audit = _config_with_audit(tmp_path, '\n[audit]\nattacks = ["zlib", "dataset-inference"]\n')
    assert audit.audit.attacks == ("zlib", "dataset-inference")
    assert audit.audit.members == 0 and audit.audit.seed is None
    assert _config_with_audit(tmp_path, "\n[audit]\n").audit.attacks == ("loss",)


def test_resampled_copies_keep_each_feature_in_its_column():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, size=(50, 1, 4, 4)).astype(np.float32)
    copies = resample_features(x, np.random.default_rng(1), rate=0.3)
    assert copies.shape == x.shape and copies.dtype == x.dtype
    flat, flat_copies = x.reshape(50, -1), copies.reshape(50, -1)
    for j in range(flat.shape[1]):  # every value comes from the same feature of some row
        assert set(flat_copies[:, j]) <= set(flat[:, j])
    changed = np.mean(flat_copies != flat)
    assert 0.15 < changed < 0.3  # rate 0.3, minus donors that hold the same value
    np.testing.assert_array_equal(copies, resample_features(x, np.random.default_rng(1), 0.3))
    with pytest.raises(ValueError, match="rate"):
        resample_features(x, rng, rate=0.0)
    with pytest.raises(ValueError, match="two rows"):
        resample_features(x[:1], rng)


def test_row_classifier_calibrates_dataset_inference_on_feature_rows():
    rng = np.random.default_rng(3)
    n = 90
    rows = rng.normal(size=(n, 6))
    synthetic = resample_features(rows, rng, rate=0.5)
    member = dataset_inference(
        rows,
        synthetic,
        rng.normal(size=(n, 2)) + 0.8,
        rng.normal(size=(n, 2)),
        rng,
        splits=4,
        classifier=row_classifier,
    )
    non = dataset_inference(
        rows,
        synthetic,
        rng.normal(size=(n, 2)),
        rng.normal(size=(n, 2)),
        rng,
        splits=4,
        classifier=row_classifier,
    )
    assert member.p_value < 0.01 and non.p_value > 0.05, (member, non)
    # The raw rows hold no real-vs-synthetic signal a linear model can use here.
    assert abs(np.mean(member.auc_text) - 0.5) < 0.15


def _p_values(result):
    return [result["p_value"], *result["split_p_values"]] + [
        result["non_member_control"]["p_value"],
        *result["non_member_control"]["split_p_values"],
    ]


def test_configured_audit_runs_after_the_run(tmp_path):
    audit = '\n[audit]\nattacks = ["loss", "dataset-inference"]\nmembers = 60\n'
    run_dir = _run(tmp_path, "configured", audit=audit, rounds=1, epochs=4, clip=100.0, z=0.0)
    written = json.loads((run_dir / "audit.json").read_text())["attacks"]
    summary = json.loads((run_dir / "summary.json").read_text())["audit"]
    assert set(written) == {"loss", "dataset-inference"}
    loss, inference = written["loss"], written["dataset-inference"]
    assert 0.0 <= loss["auc"] <= 1.0 and loss["members"] == loss["non_members"] == 60
    # The configured audit draws the same rows as `fedsim audit --members 60`.
    assert loss == audit_run(load_finished_run(run_dir), "loss", members=60)
    assert len(inference["split_p_values"]) == inference["splits"] == 10
    assert all(0.0 <= p <= 1.0 for p in _p_values(inference))
    assert inference["members"] == inference["non_members"] == 60
    assert summary == {
        "file": "audit.json",
        "members": 60,
        "loss": {"auc": loss["auc"], "tpr_at_5pct_fpr": loss["tpr_at_5pct_fpr"]},
        "dataset-inference": {
            "p_value": inference["p_value"],
            "non_member_p_value": inference["non_member_control"]["p_value"],
        },
    }


def test_cli_dataset_inference(runs, tmp_path, capsys):
    out = tmp_path / "di.json"
    args = ["audit", str(runs["noisy"]), "--attack", "dataset-inference", "--members", "30"]
    assert main([*args, "--seed", "7", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "dataset inference" in printed and "control p-value" in printed
    assert result["attack"] == "dataset-inference" and result["members"] == 30
    assert all(0.0 <= p <= 1.0 for p in _p_values(result))
    assert 0.0 <= result["auc_combined"] <= 1.0
    assert result == audit_run(
        load_finished_run(runs["noisy"]), "dataset-inference", members=30, seed=7
    )
    assert main([*args[:-1], "10"]) == 2
    assert "--members = 10 is not allowed: at least 14 rows" in capsys.readouterr().err


@pytest.mark.ray
def test_configured_audit_of_a_federation_trained_on_the_ray_engine(tmp_path, ray_engine):
    from fedsim.frontend.experiment import run_experiment
    from fedsim.frontend.run_config import ExperimentConfig

    path = tmp_path / "ray.toml"
    audit = '\n[audit]\nattacks = ["loss"]\n'
    path.write_text(CONFIG.format(rounds=2, epochs=8, clip=100.0, z=0.0) + audit)
    out = tmp_path / "ray-run"
    run_experiment(ExperimentConfig.load(path), out, progress=False, engine=ray_engine)
    result = json.loads((out / "audit.json").read_text())["attacks"]["loss"]
    assert result["clients_trained"] == 4
    assert result["member_mean_loss"] < result["non_member_mean_loss"]
    assert result["auc"] > 0.6  # the overfit federation leaks its training rows
