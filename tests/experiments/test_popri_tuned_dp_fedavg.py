"""experiments/popri/tuned_dp_fedavg.py: DP-FedAvg under POPri's privacy relation, tuned on
validation texts, on a tiny docstring federation (real engine, real LM, real accounting)."""

from __future__ import annotations

import json
import math

import pytest

from experiments.popri import tuned_dp_fedavg as tuned
from experiments.popri.run import Context, load_config, run_stage, stage_public
from experiments.roots import study_root
from fedsim.privacy.calibration import calibrate_noise
from fedsim.privacy.sampling import NeighbouringRelation, PoissonSampling

TINY = """
name = "tiny"
epsilons = [1.0]
[data]
client_packages = ["numpy"]
max_clients = 8
held_out_fraction = 0.3
[dp_fedavg]
rounds = 2
clients_per_round = 4
[dp_fedavg.local]
epochs = 1
batch_size = 8
[downstream]
vocab_size = 256
hidden = 16
layers = 1
heads = 2
max_tokens = 32
pretrain_texts = 60
eval_texts = 20
[downstream.pretrain]
epochs = 1
batch_size = 16
"""
GRID = ["--learning-rates", "0", "1", "--clipping-norms", "0.5"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """One epsilon, server learning rates 0 and 1: the points, the table, the context."""
    out = tmp_path_factory.mktemp("tuned")
    path = out / "config.toml"
    path.write_text(TINY)
    key = tmp_path_factory.mktemp("keys") / "popri.key"  # outside the results
    ctx = Context(load_config(path), out, study_root(key, out))
    (out / "stages").mkdir()
    public = run_stage(ctx, "public", stage_public)
    (out / "stages" / "public.json").write_text(json.dumps(public))
    argv = [str(path), "--out", str(out), "--secrets", str(key), *GRID]
    table = tuned.main(argv)
    points = {p.stem: json.loads(p.read_text()) for p in (out / "tuned").glob("dp-fedavg-*.json")}
    return argv, out, ctx, points, table


def test_every_point_is_poisson_add_remove_at_its_target_epsilon(grid):
    _, out, ctx, points, _ = grid
    assert set(points) == {"dp-fedavg-tuned-eps1-lr0-clip0.5", "dp-fedavg-tuned-eps1-lr1-clip0.5"}
    n = ctx.federation.num_clients
    z = calibrate_noise(
        1.0, ctx.delta, PoissonSampling(4 / n), 2, "rdp", NeighbouringRelation.ADD_REMOVE
    )
    for p in points.values():
        assert p["relation"] == "add_remove" and p["sampling_rate"] == pytest.approx(4 / n)
        assert p["noise_multiplier"] == pytest.approx(z)
        assert p["epsilon_spent"] <= 1.0 + 1e-6
        assert len(p["rounds"]) == 2 and "run_nonce" in p
    assert len({p["run_nonce"] for p in points.values()}) == 2


def test_a_zero_server_learning_rate_returns_the_fully_private_model(grid):
    _, out, _, points, _ = grid
    public = json.loads((out / "stages" / "public.json").read_text())["accuracy"]
    still = points["dp-fedavg-tuned-eps1-lr0-clip0.5"]
    assert still["accuracy"] == public
    assert all(r["accuracy"]["test"] == public for r in still["rounds"])


def test_validation_texts_are_held_out_and_disjoint_from_the_evaluation_texts(grid):
    _, _, ctx, _, _ = grid
    held = ctx.federation.all_held_out()
    evaluation = ctx.subset(held, ctx.config.downstream.eval_texts, 1)
    validation = [t for t in held if t not in set(evaluation)]
    assert validation and not set(validation) & set(evaluation)
    assert len(tuned.validation_sequences(ctx)) == len(validation)


def test_the_table_names_each_report_and_a_second_run_trains_nothing(grid, capsys):
    argv, out, _, _, table = grid
    for report in tuned.REPORTS:
        assert f"| {report} | 1 |" in table
    mtimes = {p.name: p.stat().st_mtime for p in (out / "tuned").glob("dp-fedavg-*.json")}
    tuned.main(argv)
    assert "done earlier" in capsys.readouterr().out
    assert mtimes == {p.name: p.stat().st_mtime for p in (out / "tuned").glob("dp-fedavg-*.json")}


def _point(lr, clip, validation, test):
    rounds = [
        {"round": i + 1, "accuracy": {"validation": v, "test": t}}
        for i, (v, t) in enumerate(zip(validation, test, strict=True))
    ]
    return {"server_learning_rate": lr, "clipping_norm": clip, "rounds": rounds, "epsilon_spent": 1}


def test_the_three_reports_select_on_what_they_say():
    points = [
        _point(0.0, 0.5, [0.10, 0.10, 0.10], [0.20, 0.20, 0.20]),
        _point(0.1, 0.5, [0.30, 0.12, 0.11], [0.25, 0.40, 0.21]),
        _point(1.0, 0.1, [0.05, 0.06, 0.14], [0.50, 0.10, 0.12]),
    ]
    chosen = tuned.selections(points)
    fixed, best_val, paper = (chosen[r] for r in tuned.REPORTS)
    assert (fixed["server_learning_rate"], fixed["round"], fixed["accuracy"]) == (1.0, 3, 0.12)
    assert (best_val["server_learning_rate"], best_val["round"], best_val["accuracy"]) == (
        0.1,
        1,
        0.25,
    )
    assert (paper["server_learning_rate"], paper["round"], paper["accuracy"]) == (1.0, 1, 0.50)
    assert not math.isnan(fixed["validation"])


def test_replicates_average_each_report_with_the_sample_sd(tmp_path):
    outs = []
    for i, acc in enumerate((0.12, 0.14)):
        chosen = {"server_learning_rate": 0.1, "clipping_norm": 0.5, "round": 2, "accuracy": acc}
        result = {"fully_private_accuracy": 0.10, "nonprivate_accuracy": 0.20}
        result["1"] = dict.fromkeys(tuned.REPORTS, chosen)
        out = tmp_path / f"seed{i}"
        (out / "tuned").mkdir(parents=True)
        (out / "tuned" / "results.json").write_text(json.dumps(result))
        outs.append(out)
    config = load_config_text(tmp_path, 'name = "x"\nepsilons = [1.0]\n')
    table = tuned.combined_table(config, outs)
    # mean 13.00, sample sd of (12, 14) = 1.41 (the population sd would be 1.00); gap (0.2+0.4)/2
    assert "| fixed schedule | 1 | 13.00 ± 1.41 | +30% | 0.1, 0.5, 2; 0.1, 0.5, 2 |" in table
    assert (outs[0] / "tuned" / "table_replicates.md").read_text().count("13.00 ± 1.41") == 3


def load_config_text(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path)
