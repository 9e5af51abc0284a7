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
