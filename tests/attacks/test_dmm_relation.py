"""Which neighbours DMM's epsilon is for, when a released row may carry one client's noise.

DMM's bound (KLS21 Prop. 14 on the integer query M X, :mod:`fedsim.privacy.dmm`) compares the
release with the target's updates to the release with them zeroed, every noise share kept:
zero-out. Add/remove also takes the target's noise shares away. With DMM's default
``min_clients = 1`` a round may release a row carrying one client: under add/remove its
neighbour has no noise at all and the divergence is infinite, while zero-out keeps the finite
bound the ledger accounts. The report must name the relation that holds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dmm_support import digits_setup, make_dmm, run_dmm

from attacks.test_ddgauss_relation import ORDERS, SHIFT, SIGMA, SUPPORT, discrete_gaussian_sum
from attacks.test_ddgauss_relation import worst as worst_divergence
from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy import dmm as dmm_privacy

CLIENTS = 12


def test_one_client_row_is_finite_under_zero_out_and_infinite_under_add_remove():
    bound = ddgauss_privacy.rdp_curve(SHIFT, SHIFT, SIGMA, 1, 1, orders=ORDERS)
    present = discrete_gaussian_sum(1, SHIFT)  # the one client's update and its noise
    zeroed = discrete_gaussian_sum(1)  # its update zeroed, its noise kept
    assert np.all(worst_divergence(present, zeroed) <= bound * (1 + 1e-9))
    absent = (SUPPORT == 0).astype(float)  # no client at all: the row is 0, no noise
    # present puts mass where absent has none: D_alpha(present || absent) is infinite
    assert np.all(present > 0) and np.any(absent == 0)
    assert np.all(worst_divergence(present, zeroed) < np.inf)


@pytest.mark.parametrize("mode", ["ideal", "full"])
def test_the_report_names_the_relation_the_bound_proves(local_engine, mode):
    """A round where one client answers: the release carries one client's noise, epsilon is
    the finite zero-out bound for it, and the report says zero_out."""
    one = lambda server_round, replies: sorted(  # noqa: E731
        replies, key=lambda r: r.metadata.src_node_id
    )[:1]
    strategy = make_dmm(mode, CLIENTS, 2)
    _, recorded = run_dmm(local_engine, digits_setup(CLIENTS), strategy, 1, alter=one)
    assert recorded.metrics[0]["dmm-clients"] == 1
    assert math.isfinite(strategy.epsilon()) and strategy.epsilon() > 0
    relation = strategy.privacy_report()["relation"]
    assert relation == "zero_out", (
        f"the report says {relation!r} for a release carrying one client's noise: under "
        "add/remove its neighbour is noise-free (epsilon infinite); the bound is zero-out's"
    )
    assert dmm_privacy.RELATION == relation
