"""The pFedHB scale study's KL weights: chosen on validation runs only."""

import pytest

from experiments.pfedhb import study, tuning

FED = "femnist-pairs-300"


def _run(federation, method, seed, acc):
    return {
        "federation": federation,
        "method": method,
        "seed": seed,
        "curve": [{"round": 50, "personal_acc_mean": acc}],
    }


def _grid_runs(accs, federation=FED + tuning.VALIDATION, seed=tuning.TUNING_SEEDS[0]):
    values = tuning.GRID["pfedbayes"][1]
    return [
        _run(federation, tuning.variant("pfedbayes", v), seed, a)
        for v, a in zip(values, accs, strict=True)
    ]


def test_the_best_validation_value_is_chosen_and_test_runs_do_not_count():
    runs = _grid_runs([0.2, 0.9, 0.5, 0.1, 0.0])
    assert tuning.choose(runs, FED, "pfedbayes") == 1.0
    # the same grid on the test federation (or under a reported seed) changes nothing
    decoys = _grid_runs([0.0, 0.0, 0.0, 1.0, 1.0], federation=FED)
    decoys += _grid_runs([0.0, 0.0, 0.0, 1.0, 1.0], seed=0)
    assert tuning.choose(runs + decoys, FED, "pfedbayes") == 1.0
    assert tuning.choose(_grid_runs([0.2, 0.1, 0.5, 0.9, 0.3]), FED, "pfedbayes") == 0.01


def test_ties_go_to_the_earlier_value_and_missing_runs_are_named():
    assert tuning.choose(_grid_runs([0.4] * 5), FED, "pfedbayes") == 10.0
    with pytest.raises(ValueError, match="pfedbayes-z0.001"):
        tuning.choose(_grid_runs([0.4] * 5)[:4], FED, "pfedbayes")


def test_tuned_and_grid_methods_configure_their_weight(monkeypatch):
    monkeypatch.setattr(study, "load_runs", lambda: _grid_runs([0.2, 0.1, 0.8, 0.3, 0.1]))
    tuned = study.config_for(FED, "pfedbayes-tuned", 0, 50)
    assert tuned["personal"]["zeta"] == 0.1
    assert tuned["data"]["client_test"] == "class-pool"
    grid = study.config_for(FED + tuning.VALIDATION, "pfedhb-adam-kl0.01", 100, 50)
    assert grid["personal"]["head_kl"] == 0.01
    assert grid["data"]["client_test"] == "class-pool-validation"
    assert grid["strategy"]["options"] == {"server_solver": "adam"}
    with pytest.raises(ValueError, match="method 'pfedhb-z1'"):
        study.method_settings("pfedhb-z1", FED)


def test_every_scale_config_is_a_valid_run_config():
    from fedsim.frontend.run_config import ExperimentConfig

    for name in tuning.variants():
        ExperimentConfig.from_dict(study.config_for(FED + tuning.VALIDATION, name, 100, 50))


def test_every_stored_tuned_run_ran_the_weight_validation_chooses_now():
    runs = study.load_runs()
    tuned = [r for r in runs if r["method"].endswith("-tuned")]
    assert {r["method"] for r in tuned} == {tuning.tuned(m) for m in tuning.GRID}
    for r in tuned:
        method = r["method"].removesuffix("-tuned")
        key = tuning.GRID[method][0]
        assert r["config"]["personal"][key] == tuning.choose(runs, r["federation"], method), r
        assert r["config"]["data"]["client_test"] == "class-pool"
