"""Accounting for the integer mechanism a DMM run implements."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest

from fedsim.privacy.dmm import IntegerMechanism, increment_event, worst_release, zcdp_epsilon
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.build import Spec, build
from fedsim.privacy.matrix.factorization import from_square_encoder
from fedsim.privacy.matrix.sensitivity import brute_force, sensitivity
from fedsim.privacy.matrix.toeplitz import banded_toeplitz
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.participation import Participation

SEP = Participation(kind="min_sep", min_sep=3)


@pytest.mark.parametrize("bits", [3, 8, 12])
@pytest.mark.parametrize("make", [lambda: banded(8, 3), lambda: banded_toeplitz(8, 3)])
def test_the_mechanism_is_the_integer_matrix_and_its_sensitivity_is_ms(make, bits):
    fac = make()
    mechanism = IntegerMechanism(fac, bits, SEP)
    M = mechanism.integer_matrix
    assert M.dtype == np.int64 and np.array_equal(M, np.rint(fac.encoder * 2**bits))
    # the reported sensitivity is that of M itself, not of 2^f C
    assert mechanism.sensitivity.value == pytest.approx(sensitivity(M.astype(float), SEP).value)
    if np.all(M.T @ M >= 0):
        assert mechanism.sensitivity.value == pytest.approx(brute_force(M.astype(float), SEP))
    real = fac.sensitivity(SEP).value * 2**bits
    if bits == 3:
        assert abs(mechanism.sensitivity.value - real) > 1e-3 * real  # rounding matters


@pytest.mark.parametrize("make", [honaker_tree, binary_tree])
def test_the_tree_is_its_own_integer_matrix_and_decodes_with_its_decoder(make):
    fac = make(8)
    mechanism = IntegerMechanism(fac, 0, SEP)
    np.testing.assert_array_equal(mechanism.integer_matrix, fac.encoder.astype(np.int64))
    D = mechanism.decoding
    np.testing.assert_allclose(D @ mechanism.integer_matrix, np.eye(8), atol=1e-9)
    late = mechanism.rounds[None, :] > np.arange(8)[:, None]
    assert np.all(D[late] == 0)  # causal: round t reads only rows released by t
    with pytest.raises(ValueError, match="already integer"):
        IntegerMechanism(fac, 4)


@pytest.mark.parametrize("kind", ["sqrt", "dense", "blt"])
def test_non_banded_factorizations_are_refused_with_the_reason(kind):
    fac = build(Spec(kind=kind, rounds=6, participations=2, min_sep=3))
    with pytest.raises(ValueError, match="not banded.*whole history.*integer"):
        IntegerMechanism(fac, 12)


def test_coarse_bits_that_make_m_singular_are_refused():
    C = np.eye(4) * 0.2 + np.eye(4, k=-1)
    fac = from_square_encoder("banded", C, np.tri(4), {})
    with pytest.raises(ValueError, match="singular"):
        IntegerMechanism(fac, 1)
    assert IntegerMechanism(fac, 4).integer_matrix[0, 0] == 3
    with pytest.raises(ValueError, match="fractional_bits"):
        IntegerMechanism(banded(8, 3), 41)


def _epsilon(mechanism, rounds, counts, std=4000.0):
    return zcdp_epsilon(mechanism, rounds, 150.0, 3000.0, std, counts, 64)


def test_epsilon_grows_with_rounds_and_with_fewer_clients_present():
    mechanism = IntegerMechanism(banded(8, 3), 12, SEP)
    eps = [_epsilon(mechanism, r, [20] * r) for r in range(1, 9)]
    assert all(a <= b + 1e-12 for a, b in zip(eps, eps[1:]))
    full = _epsilon(mechanism, 4, [20, 20, 20, 20])
    dropped = _epsilon(mechanism, 4, [20, 20, 12, 20])
    assert dropped > full  # the fewest clients' noise decides
    assert dropped == pytest.approx(_epsilon(mechanism, 4, [12] * 4), rel=1e-6)
    assert math.isinf(_epsilon(mechanism, 4, [20, 0, 20, 20]))
    # the Gaussian part scales as sens(M) Delta_2 / (sqrt(n) s)
    ratio = _epsilon(mechanism, 8, [20] * 8, std=8000.0) / _epsilon(mechanism, 8, [20] * 8)
    assert ratio == pytest.approx(0.5, rel=1e-3)


def test_arguments_are_checked():
    mechanism = IntegerMechanism(banded(8, 3), 12)
    with pytest.raises(ValueError, match="counts has 2 entries for 3"):
        _epsilon(mechanism, 3, [5, 5])
    with pytest.raises(ValueError, match="scaled_std"):
        _epsilon(mechanism, 1, [5], std=0.2)
    with pytest.raises(ValueError, match="dim"):
        zcdp_epsilon(mechanism, 1, 1.0, 1.0, 4.0, [3], 0)


def test_increment_events_compose_to_the_run():
    mechanism = IntegerMechanism(honaker_tree(8), 0, SEP)
    accountant, previous = dpa.rdp.RdpAccountant(), 0.0
    for r in range(1, 9):
        rows = int(np.sum(mechanism.rounds < r))
        now = zcdp_epsilon(mechanism, r, 30.0, 300.0, 10.0, [10] * rows, 16)
        accountant.compose(increment_event(previous, now))
        previous = now
    direct = dpa.rdp.RdpAccountant()
    direct.compose(dpa.GaussianDpEvent(1 / previous))
    assert accountant.get_epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert isinstance(increment_event(1.0, math.inf), dpa.NonPrivateDpEvent)


def test_worst_release_bounds_every_simulated_release():
    mechanism = IntegerMechanism(banded(6, 3), 10)
    M, rng = mechanism.integer_matrix, np.random.default_rng(0)
    clients, bound, std = 5, 40.0, 50.0
    worst = worst_release(mechanism, clients, bound, std, 32, 1e-9)
    for _ in range(20):
        X = rng.integers(-int(bound / 6), int(bound / 6) + 1, (6, clients, 32)).sum(axis=1)
        Z = np.rint(rng.normal(0, std * math.sqrt(clients), (6, 32))).astype(np.int64)
        assert np.max(np.abs(M @ X + Z)) <= worst
    assert worst >= mechanism.max_row_l1 * clients * bound
