"""The DMM study's differences: paired by seed, with the 95 % t interval of the mean."""

from __future__ import annotations

import statistics

import pytest
from scipy import stats

from experiments.dmm import table


def _run(method: str, seed: int, accuracy: float, eps: float = 2.0) -> dict:
    return {"method": method, "seed": seed, "accuracy": accuracy, "target_epsilon": eps}


def test_differences_pair_the_seeds_and_leave_out_unpaired_ones():
    runs = [
        _run("dmm-banded", 0, 0.50),
        _run("dmm-banded", 1, 0.40),
        _run("dmm-banded", 2, 0.90),  # no partner: left out
        _run("central-bandmf", 0, 0.45),
        _run("central-bandmf", 1, 0.30),
        _run("central-bandmf", 3, 0.10),  # no partner: left out
        _run("central-bandmf", 1, 0.99, eps=4.0),  # another epsilon
    ]
    assert table.paired(runs, "dmm-banded", "central-bandmf", 2.0) == pytest.approx([0.05, 0.10])


def test_the_interval_is_the_t_interval_of_the_paired_mean():
    differences = [0.05, 0.10, -0.02, 0.07]
    mean, low, high = table.interval(differences)
    half = stats.t.ppf(0.975, 3) * statistics.stdev(differences) / 2
    assert mean == pytest.approx(0.05)
    assert (low, high) == pytest.approx((0.05 - half, 0.05 + half))
    # pairing removes the seed effect an unpaired standard error would keep
    runs = [_run("a", s, 0.2 * s + d) for s, d in enumerate(differences)]
    runs += [_run("b", s, 0.2 * s) for s in range(4)]
    assert table.difference(runs, "a", "b", 2.0) == f"+0.050 [{low:+.3f}, {high:+.3f}] (n=4)"


def test_a_single_pair_has_no_interval():
    runs = [_run("a", 0, 0.5), _run("b", 0, 0.4)]
    assert table.difference(runs, "a", "b", 2.0) == "-"


def _tuned(method: str, lr: float, seed: int, validation: float, test: float, eps=2.0) -> dict:
    return {
        "method": method,
        "target_epsilon": eps,
        "server_learning_rate": lr,
        "seed": seed,
        "validation_accuracy": validation,
        "accuracy": test,
    }


def test_the_rate_is_chosen_on_validation_and_never_on_test():
    runs = [
        _tuned("dp-fedavg", 0.5, 100, 0.40, 0.90),
        _tuned("dp-fedavg", 0.5, 101, 0.44, 0.90),
        _tuned("dp-fedavg", 1.0, 100, 0.50, 0.10),
        _tuned("dp-fedavg", 1.0, 101, 0.46, 0.10),
        _tuned("non-private", 1.0, 100, 0.8, 0.8, eps=None),
        _tuned("non-private", 2.0, 100, 0.8, 0.9, eps=None),  # tie: the smaller rate
    ]
    choices = table.choose_rates(runs)
    assert table.choice_of({"choices": choices}) == {
        ("dp-fedavg", 2.0): 1.0,
        ("non-private", None): 1.0,
    }
    assert choices[0]["validation_mean"] == pytest.approx({"0.5": 0.42, "1": 0.48})
    shuffled = [{**r, "accuracy": 1.0 - r["accuracy"]} for r in runs]  # test only: same choice
    assert table.choose_rates(shuffled) == choices
    flipped = [{**r, "validation_accuracy": 1.0 - r["validation_accuracy"]} for r in runs]
    assert table.choice_of({"choices": table.choose_rates(flipped)})[("dp-fedavg", 2.0)] == 0.5


def test_the_rates_table_counts_the_choices_at_the_top_of_the_grid():
    runs = [_tuned("dp-fedavg", lr, 100, v, v) for lr, v in ((1.0, 0.4), (2.0, 0.5))]
    runs += [_tuned("ddgauss", lr, 100, v, v) for lr, v in ((1.0, 0.5), (2.0, 0.4))]
    choice = {"grid": [1.0, 2.0], "seeds": [100], "criterion": "c.", "choices": []}
    choice["choices"] = table.choose_rates(runs)
    text = table.rates_table(choice)
    assert "| dp-fedavg | 2 | 2 | 0.400 | 0.500 |" in text
    assert text.endswith("1 of 2 choices are the grid's largest rate (2).")


def test_a_rate_tuned_on_other_seeds_than_its_neighbours_is_refused():
    runs = [_tuned("ddgauss", 0.5, 100, 0.4, 0.4), _tuned("ddgauss", 1.0, 101, 0.5, 0.5)]
    with pytest.raises(ValueError, match="different seeds"):
        table.choose_rates(runs)


def test_the_plateau_is_the_spread_of_the_last_fifth_of_the_rounds():
    curve = [0.1 * i for i in range(5)] + [0.90, 0.905, 0.899, 0.908, 0.902]
    spread, window = table.plateau(curve)
    assert window == 2  # ceil(0.2 * 10)
    assert spread == pytest.approx(0.908 - 0.902)
    spread, window = table.plateau(curve, fraction=0.5)
    assert (spread, window) == (pytest.approx(0.908 - 0.899), 5)
    assert table.plateau([0.5] * 7)[1] == 2  # ceil(1.4)
    with pytest.raises(ValueError, match="fraction"):
        table.plateau(curve, fraction=0.0)


def _curve_run(values: list[float], seed: int) -> dict:
    rounds = [{"round": i + 1, "validation": v, "test": v} for i, v in enumerate(values)]
    return {"method": "non-private", "seed": seed, "target_epsilon": None, "rounds": rounds}


def test_the_curve_table_says_whether_non_private_training_plateaus():
    flat = [_curve_run([0.2, 0.5, 0.80, 0.90, 0.905], s) for s in range(2)]
    assert "FedAvg plateaus" in table.curve_table(flat, every=2)
    assert table.mean_curve(flat, "test") == pytest.approx([0.2, 0.5, 0.80, 0.90, 0.905])
    rising = [_curve_run([0.1 * i for i in range(10)], s) for s in range(2)]
    text = table.curve_table(rising, every=5)  # the last two rounds: 0.8, 0.9
    assert "does NOT plateau" in text and "| test | 0.400 | 0.900 |" in text
    assert "10.00 points over the last 2 rounds" in text
    with pytest.raises(ValueError, match="equal length"):
        table.mean_curve([_curve_run([0.1], 0), _curve_run([0.1, 0.2], 1)], "test")


def test_the_newest_stored_study_is_tabulated_and_v1_is_the_unsuffixed_one(tmp_path):
    from experiments.dmm.table import stored_settings

    def setting(name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "setup.json").write_text("{}")
        return tmp_path / name

    old = setting("digits-750-r20")
    assert stored_settings(tmp_path, None) == [old]  # no v2 yet: the earlier study
    assert stored_settings(tmp_path, "v1") == [old]
    with pytest.raises(SystemExit, match="version v2"):
        stored_settings(tmp_path, "v2")
    new = setting("digits-750-r40-v2")
    assert stored_settings(tmp_path, None) == [new]
    assert stored_settings(tmp_path, "v1") == [old]


def test_the_cost_table_says_so_when_no_row_ran_in_full_mode():
    runs = [{"method": "dmm-banded", "mode": "ideal", "cost_per_round": {"seconds": 0.7}}]
    assert table.cost_table([({"source": "digits"}, runs)]) == table.NO_FULL_RUNS
    full = [{**runs[0], "mode": "full"}]
    assert "| dmm-banded | 1 | 0.7 (0.7–0.7) |" in table.cost_table([({"source": "digits"}, full)])


def test_findings_follow_the_intervals_of_the_paired_differences():
    def run(method, seed, acc):
        return {"method": method, "target_epsilon": 1.0, "seed": seed, "accuracy": acc}

    ahead = [run("dmm-banded", s, 0.5 + 0.01 * s) for s in range(4)]
    ahead += [run("central-bandmf", s, 0.4 + 0.01 * s + 0.001 * (s % 2)) for s in range(4)]
    level = [run("dmm-banded", s, 0.5 + (0.05 if s % 2 else -0.05)) for s in range(4)]
    level += [run("central-bandmf", s, 0.5) for s in range(4)]
    text = table.findings([({"source": "digits"}, ahead), ({"source": "femnist-like"}, level)])
    assert text.startswith("- **dmm-banded against central-bandmf**: digits: ahead at ε = 1.")
    assert "FEMNIST-like: level at ε = 1" in text
    assert table.verdict([0.1]) is None  # one pair: no interval, no finding
    assert table.verdict([-0.2, -0.21, -0.19]) == "behind"
