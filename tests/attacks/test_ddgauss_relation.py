"""Which neighbours DDGauss's epsilon is for: the server that sees the sum tells two datasets
apart.

KLS21's bound compares a sum of n discrete Gaussian noise shares with the target's update
(``x + Z_n``) to the same sum with the update zeroed (``Z_n``): its share stays. That is
zero-out. Add/remove compares ``x + Z_n`` to the sum without the target at all, ``Z_{n-1}`` --
less noise -- and the server that sees the released sum distinguishes those better than the
bound allows. The exact Renyi divergences of the two pairs (computed from the distributions,
in one dimension) settle it; the report must name the relation that holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.serverapp.strategy import FedAvg

from fedsim.privacy import ddgauss as ddgauss_privacy
from strategies.methods.ddgauss.strategy import DDGauss

SIGMA, SHIFT, SHARES, DELTA = 1.5, 2, 3, 1e-5
ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)
SUPPORT = np.arange(-120, 121)


def discrete_gaussian_sum(shares: int, shift: int = 0) -> np.ndarray:
    """The pmf on SUPPORT of ``shift`` plus a sum of ``shares`` independent N_Z(0, SIGMA^2), in
    extended precision (its tails on SUPPORT stay far above underflow)."""
    wide = np.arange(-200, 201)
    one = np.exp(-(wide.astype(np.longdouble) ** 2) / (2 * SIGMA**2))
    one /= one.sum()
    total = one
    for _ in range(shares - 1):
        total = np.convolve(total, one)
        middle = total.size // 2
        total = total[middle - 200 : middle + 201]
    total /= total.sum()
    return total[SUPPORT - shift + 200]


def renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """D_order(p || q) on SUPPORT (both are positive on all of it), summed in logs."""
    logs = order * np.log(p) + (1 - order) * np.log(q)
    top = logs.max()
    return float((top + np.log(np.exp(logs - top).sum())) / (order - 1))


def worst(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.array([max(renyi(p, q, a), renyi(q, p, a)) for a in ORDERS])


def test_the_bound_holds_for_zero_out_and_not_for_add_remove():
    bound = ddgauss_privacy.rdp_curve(SHIFT, SHIFT, SIGMA, SHARES, 1, orders=ORDERS)
    present = discrete_gaussian_sum(SHARES, SHIFT)  # the target's update and its share
    zeroed = discrete_gaussian_sum(SHARES)  # its update zeroed, its share kept
    absent = discrete_gaussian_sum(SHARES - 1)  # no target at all: one share fewer
    zero_out, add_remove = worst(present, zeroed), worst(present, absent)
    assert np.all(zero_out <= bound * (1 + 1e-9)), (zero_out, bound)
    assert np.all(add_remove > bound), (add_remove, bound)
    claimed, _ = rdp_privacy_accountant.compute_epsilon(ORDERS, bound, DELTA)
    exact, _ = rdp_privacy_accountant.compute_epsilon(ORDERS, add_remove, DELTA)
    assert exact > 1.5 * claimed  # add/remove costs far more than the bound says


@pytest.mark.parametrize("mode", ["full", "plaintext"])
def test_the_report_names_the_relation_the_bound_proves(mode):
    strategy = DDGauss(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_clients=SHARES,
        seed=0,
        mode=mode,
    )
    relation = strategy.privacy_report()["relation"]
    assert relation == "zero_out", (
        f"the report says {relation!r}: KLS21's bound (kept noise share) is for zero-out "
        "neighbours; the exact add/remove divergence exceeds it (the test above)"
    )
