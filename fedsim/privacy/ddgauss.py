"""Privacy of the distributed discrete Gaussian (DDGauss): a sum of n discrete Gaussians.

Kairouz, Liu & Steinke, ICML 2021 (KLS21, arXiv 2102.06387), Theorem 1 and Proposition 14. Each
of n clients adds independent N_Z(0, sigma^2) noise (sigma >= 1/2, integer units) to every one
of D coordinates; the sum Y is not a discrete Gaussian, but close to N_Z(0, n sigma^2). With

    tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))

and a change Delta in Z^D of the summed input with ||Delta||_2 <= Delta_2, ||Delta||_1 <= Delta_1,
eps_2 = Delta_2 / (sqrt(n) sigma), eps_1 = Delta_1 / (sqrt(n) sigma), Proposition 14 bounds the
Renyi divergence of every order alpha > 1 by the minimum of

    (a) alpha/2 * eps_2^2 + tau D
    (b) alpha/2 * (eps_2^2 + 2 eps_1 tau + tau^2 D)
    (c) alpha/2 * (eps_2 + tau sqrt(D))^2.

**The bound used for the ledger** is min((b), (c)) = alpha/2 * eps^2 with

    eps = min( sqrt(eps_2^2 + 2 eps_1 tau + tau^2 D),  eps_2 + tau sqrt(D) ),

i.e. 1/2 eps^2-zCDP (KLS21 Theorem 1's form), recorded as ``ZCDpEvent(eps^2 / 2)``; the RDP
accountant composes it as the Gaussian of the same RDP curve (z = 1/eps) and converts to
(epsilon, delta), and the PLD accountant refuses it (a Gaussian's PLD would be optimistic).
Dropping term (a) can only overstate epsilon; :func:`rdp_curve` keeps all three for comparison.
Because the equivalence holds for the unsampled mechanism only, no amplification by sampling is
claimed: every round composes in full (as if every client took part in every round).

Units: Delta_1, Delta_2 and sigma in integer (granularity) units, D the padded dimension.

**Neighbouring: zero-out** (:data:`RELATION`; the relation of Kairouz et al., ICML 2021,
"Practical and private (deep) learning without sampling or shuffling"): one client's rounded
vector is zeroed (a change Delta with ||Delta||_2 <= Delta_2, ||Delta||_1 <= Delta_1) while
every client's noise, its own share included, stays in the sum -- what Proposition 14 bounds.
It is not add/remove: removing the client removes its noise share too (n - 1 shares against
n: a wider distribution against a narrower one, whose Renyi divergence exceeds the bound
above and, for Gaussians, is infinite from order n on), and the server sees who contributed
anyway. The
ledger's Gaussian of sensitivity Delta is the same arithmetic under either name, so a ledger
may keep dp_accounting's add/remove convention; what a report states is :data:`RELATION`.
Replace-one neighbours would need 2 Delta_2 and 2 Delta_1. **Dropout rule**: ``count`` is the
number of clients whose noise is actually in the released sum (the survivors), never the
planned cohort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

DEFAULT_ORDERS: tuple[float, ...] = tuple(range(2, 129)) + (256.0,)

RELATION = "zero_out"
"""The neighbouring relation KLS21's bound proves (module docstring): one client's update
zeroed, its noise share kept."""


def _check(count: int, scaled_std: float, l2_bound: float, l1_bound: float, dim: int) -> None:
    if not isinstance(count, int | np.integer) or count < 0:
        raise ValueError(
            f"count must be an integer >= 0 (clients whose noise is present), got {count!r}"
        )
    if not (math.isfinite(scaled_std) and scaled_std >= 0.5):
        raise ValueError(
            f"scaled_std={scaled_std!r}: KLS21 Theorem 1 needs a per-client discrete Gaussian "
            "parameter sigma >= 1/2 in integer units (lower gamma or raise noise_std)"
        )
    for name, value in (("l2_bound", l2_bound), ("l1_bound", l1_bound)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")


def tau(scaled_std: float, count: int) -> float:
    """KLS21's tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1)) (0 for n = 1)."""
    k = np.arange(1, max(int(count), 1), dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * scaled_std**2 * k / (k + 1.0))))


def zcdp_epsilon(
    l2_bound: float, l1_bound: float, scaled_std: float, count: int, dim: int
) -> float:
    """eps of KLS21 Theorem 1: the round is 1/2 eps^2-zCDP (``inf`` when count = 0)."""
    _check(count, scaled_std, l2_bound, l1_bound, dim)
    if count == 0:
        return math.inf
    t = tau(scaled_std, count)
    central = math.sqrt(count) * scaled_std
    eps2, eps1 = l2_bound / central, l1_bound / central
    return min(math.sqrt(eps2**2 + 2 * eps1 * t + t * t * dim), eps2 + t * math.sqrt(dim))


def round_event(
    l2_bound: float, l1_bound: float, scaled_std: float, count: int, dim: int
) -> dpa.DpEvent:
    """One DDGauss release as a dp_accounting event: ``ZCDpEvent(eps^2 / 2)`` with eps from
    :func:`zcdp_epsilon`; ``NonPrivateDpEvent`` when no noise is present (count = 0)."""
    eps = zcdp_epsilon(l2_bound, l1_bound, scaled_std, count, dim)
    if math.isinf(eps):
        return dpa.NonPrivateDpEvent()
    if eps == 0:
        return dpa.NoOpDpEvent()
    return dpa.ZCDpEvent(eps**2 / 2)


def rdp_curve(
    l2_bound: float,
    l1_bound: float,
    scaled_std: float,
    count: int,
    dim: int,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> np.ndarray:
    """KLS21 Proposition 14: RDP at ``orders`` as the minimum of all three terms."""
    _check(count, scaled_std, l2_bound, l1_bound, dim)
    orders = np.asarray(orders, dtype=np.float64)
    if count == 0:
        return np.full(orders.shape, np.inf)
    t = tau(scaled_std, count)
    central = math.sqrt(count) * scaled_std
    eps2, eps1 = l2_bound / central, l1_bound / central
    first = orders / 2 * eps2**2 + t * dim
    second = orders / 2 * (eps2**2 + 2 * eps1 * t + t * t * dim)
    third = orders / 2 * (eps2 + t * math.sqrt(dim)) ** 2
    return np.minimum(np.minimum(first, second), third)


def epsilon_from_rdp_curve(
    rounds_rdp: Sequence[np.ndarray], delta: float, orders: Sequence[float] = DEFAULT_ORDERS
) -> float:
    """(epsilon, delta) of composed rounds given their RDP curves (summed), converted by
    dp_accounting's RDP-to-DP conversion."""
    total = np.sum(np.stack([np.asarray(r, dtype=np.float64) for r in rounds_rdp]), axis=0)
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders, total, delta)
    return float(eps)
