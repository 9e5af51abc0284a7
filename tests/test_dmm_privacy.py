"""Accounting for the integer matrix a DMM committee implements."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest

from fedsim.privacy.dmm import IntegerNoising, increment_event, noise_rounds, run_zcdp_epsilon
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.sensitivity import Participation, brute_force
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree

SEP = Participation(kind="min_sep", min_sep=3)


@pytest.mark.parametrize("build", [lambda: honaker_tree(8), lambda: banded(8, 3)])
@pytest.mark.parametrize("bits", [3, 6, 12])
def test_sensitivity_is_that_of_the_implemented_matrix(build, bits):
    noising = IntegerNoising(build(), bits, participation=SEP)
    Gp, Cp = noising.implemented_noising, noising.implemented_encoder
    # the committee's integer coefficients, divided by 2^f, are exactly G'
    assert np.all(noising.integer_matrix == np.rint(Gp * 2**bits))
    # the released stream x + G'z is the post-processing G'(C'x + z)
    rng = np.random.default_rng(0)
    x, z = rng.normal(size=(8, 3)), rng.normal(size=(Cp.shape[0], 3))
    np.testing.assert_allclose(x + Gp @ z, Gp @ (Cp @ x + z), atol=1e-9)
    # the reported sensitivity is C'`s: between the aligned-gradient value of the worst pattern
    # (a lower bound, exact when C'^T C' >= 0) and the sum of |C'^T C'| over it (an upper bound)
    X = Cp.T @ Cp
    patterns = [list(p) for p in SEP.patterns(8)]
    lower = max(math.sqrt(max(X[np.ix_(p, p)].sum(), 0.0)) for p in patterns)
    upper = max(math.sqrt(np.abs(X[np.ix_(p, p)]).sum()) for p in patterns)
    reported = noising.sensitivity
    assert lower - 1e-9 <= reported.value <= upper + 1e-9
    if np.all(X >= -1e-12):
        assert reported.exact and reported.value == pytest.approx(brute_force(Cp, SEP))


def test_coarse_coefficients_change_the_sensitivity_and_fine_ones_recover_it():
    fac = honaker_tree(8)
    ideal = fac.sensitivity(SEP).value
    coarse = IntegerNoising(fac, 2, participation=SEP).sensitivity.value
    fine = IntegerNoising(fac, 30, participation=SEP).sensitivity.value
    assert abs(coarse - ideal) > 1e-2  # accounting with C would be wrong here
    assert fine == pytest.approx(ideal, rel=1e-6)
    # the binary tree's G has integer entries: nothing is rounded
    exact = IntegerNoising(binary_tree(8), 1, participation=SEP)
    assert exact.sensitivity.value == pytest.approx(binary_tree(8).sensitivity(SEP).value)


def test_window_truncation_is_accounted():
    fac = banded(8, 3)
    full = IntegerNoising(fac, 12)
    windowed = IntegerNoising(fac, 12, window=2)
    M = windowed.integer_matrix
    assert all(M[t, r] == 0 for t in range(8) for r in range(8) if t - r >= 2)
    assert windowed.sensitivity.value != pytest.approx(full.sensitivity.value)
    assert len(windowed.needed_after(4)) <= 1


def test_noise_rounds_follow_completion():
    C = honaker_tree(4).C  # nodes (0,0) (0,1) (1,0) (0,2) (0,3) (1,1) (2,0)
    assert noise_rounds(C).tolist() == [0, 1, 1, 2, 3, 3, 3]


def test_epsilon_grows_with_rounds_and_with_dropouts():
    noising = IntegerNoising(honaker_tree(8), 10)
    args = dict(l2_bound=50.0, l1_bound=400.0, scaled_std=20.0, dim=64)
    full = [run_zcdp_epsilon(noising, t, fewest_clients=10, **args) for t in range(1, 9)]
    assert all(b >= a for a, b in zip(full, full[1:]))
    dropped = run_zcdp_epsilon(noising, 8, fewest_clients=5, **args)
    assert dropped > full[-1]
    assert math.isinf(run_zcdp_epsilon(noising, 8, fewest_clients=0, **args))


def test_increment_events_compose_to_the_run():
    eps = [0.3, 0.5, 0.5, 0.9]
    events, previous = [], 0.0
    for e in eps:
        events.append(increment_event(previous, e))
        previous = e
    assert isinstance(events[2], dpa.NoOpDpEvent)
    precision = sum(1 / ev.noise_multiplier**2 for ev in events if hasattr(ev, "noise_multiplier"))
    assert precision == pytest.approx(eps[-1] ** 2)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="fractional_bits=0"):
        IntegerNoising(honaker_tree(4), 0)
    with pytest.raises(ValueError, match="window=0"):
        IntegerNoising(honaker_tree(4), 8, window=0)
