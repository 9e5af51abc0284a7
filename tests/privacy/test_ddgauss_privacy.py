"""The DDGauss bound (sum of n discrete Gaussians vs one discrete Gaussian) and its events."""

import math

import dp_accounting as dpa
import numpy as np
import pytest

from fedsim.privacy.ddgauss import (
    DEFAULT_ORDERS,
    epsilon_from_rdp_curve,
    rdp_curve,
    round_event,
    tau,
    zcdp_epsilon,
)


def _sum_of_discrete_gaussians(sigma, n, support=80):
    grid = np.arange(-support, support + 1)
    one = np.exp(-(grid**2) / (2 * sigma**2))
    one /= one.sum()
    total = one
    for _ in range(n - 1):
        total = np.convolve(total, one)
    half = (total.size - 1) // 2
    return np.arange(-half, half + 1), total


def _renyi(p, q, alpha):
    mask = (p > 1e-250) & (q > 1e-250)
    terms = alpha * np.log(p[mask]) + (1 - alpha) * np.log(q[mask])
    top = terms.max()
    return (top + math.log(np.sum(np.exp(terms - top)))) / (alpha - 1)


@pytest.mark.parametrize("sigma,n,shift", [(0.6, 3, 1), (0.8, 4, 2), (1.0, 5, 3)])
def test_bound_dominates_the_exact_renyi_divergence(sigma, n, shift):
    support, pmf = _sum_of_discrete_gaussians(sigma, n)
    shifted = np.roll(pmf, shift)
    shifted[:shift] = 0
    curve = rdp_curve(shift, shift, sigma, n, 1, orders=(2, 4, 8))
    eps = zcdp_epsilon(shift, shift, sigma, n, 1)
    for alpha, bound in zip((2, 4, 8), curve):
        exact = max(_renyi(shifted, pmf, alpha), _renyi(pmf, shifted, alpha))
        assert exact <= bound + 1e-9
        assert exact <= alpha * eps**2 / 2 + 1e-9


def test_large_noise_approaches_the_continuous_gaussian():
    # tau vanishes, so the event is the zCDP of the Gaussian with z = sqrt(n) sigma / Delta_2
    assert tau(5.0, 100) < 1e-100
    event = round_event(3.0, 30.0, 5.0, 100, 1024)
    assert isinstance(event, dpa.ZCDpEvent) and event.xi == 0
    assert math.isclose(event.rho, (10 * 5.0 / 3.0) ** -2 / 2, rel_tol=1e-12)


def test_small_noise_is_penalised_by_tau():
    plain = 3.0 / (math.sqrt(50) * 0.6)
    assert zcdp_epsilon(3.0, 9.0, 0.6, 50, 1024) > plain * 1.01


def test_fewer_clients_with_noise_means_larger_epsilon():
    eps = [zcdp_epsilon(10.0, 100.0, 2.0, n, 256) for n in (30, 27, 10, 1)]
    assert eps == sorted(eps)
    assert isinstance(round_event(10.0, 100.0, 2.0, 0, 256), dpa.NonPrivateDpEvent)


def test_ledger_event_never_understates_the_full_curve():
    args = (20.0, 300.0, 1.0, 20, 512)
    full = epsilon_from_rdp_curve([rdp_curve(*args)] * 3, 1e-5)
    acc = dpa.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    acc.compose(round_event(*args), 3)
    assert acc.get_epsilon(1e-5) >= full - 1e-9


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="sigma >= 1/2"):
        zcdp_epsilon(1.0, 1.0, 0.4, 10, 4)
    with pytest.raises(ValueError, match="count"):
        zcdp_epsilon(1.0, 1.0, 1.0, -1, 4)
