"""Pins what :mod:`fedsim.privacy.dpa_adapter` reads of dp_accounting's private state, so an
upgrade that changes it fails here (and not as a silently slower or wrong epsilon).

- ``RdpAccountant._orders`` / ``._rdp`` after one compose: the orders and RDP vector that
  ``get_epsilon`` converts with ``compute_epsilon``;
- ``PLDAccountant._pld`` / ``._contains_non_dp_event``: the composed PLD, whose
  ``self_compose(c)`` is what composing ``SelfComposedDpEvent(e, c)`` gives;
- ``PrivacyAccountant._maybe_compose(event, count, do_compose)``: the one hook ``supports``
  (``do_compose=False``) and ``compose`` (``True``) call, which ``CachedAccountant`` overrides.
"""

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant, rdp_privacy_accountant

from fedsim.privacy import dpa_adapter

DELTA = 1e-5
ROUND = dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.2))


def test_rdp_state_is_the_orders_and_vector_get_epsilon_converts():
    one = RdpAccountant().compose(ROUND)
    assert isinstance(one._orders, np.ndarray) and isinstance(one._rdp, np.ndarray)
    assert one._rdp.shape == one._orders.shape
    eps, _ = rdp_privacy_accountant.compute_epsilon(one._orders, one._rdp, DELTA)
    assert eps == one.get_epsilon(DELTA)
    curve = dpa_adapter.rdp_curve(one, ROUND, [0, 1, 9], DELTA)
    assert curve is not None and curve[0] == 0.0
    assert curve[1] == one.get_epsilon(DELTA)
    nine = RdpAccountant().compose(ROUND, 9).get_epsilon(DELTA)
    assert curve[2] == pytest.approx(nine, rel=1e-12)


def test_pld_state_self_composes_like_a_self_composed_event():
    one = PLDAccountant().compose(ROUND)
    assert one._contains_non_dp_event is False
    assert one._pld.get_epsilon_for_delta(DELTA) == one.get_epsilon(DELTA)
    curve = dpa_adapter.pld_curve(one, ROUND, [0, 4], DELTA)
    four = PLDAccountant().compose(dpa.SelfComposedDpEvent(ROUND, 4)).get_epsilon(DELTA)
    assert curve == [0.0, pytest.approx(four, rel=1e-9)]
    non_dp = PLDAccountant().compose(dpa.NonPrivateDpEvent())
    assert non_dp._contains_non_dp_event is True
    assert dpa_adapter.pld_curve(non_dp, dpa.NonPrivateDpEvent(), [1], DELTA) is None


def test_maybe_compose_is_the_hook_of_supports_and_compose():
    calls = []

    class Recording(RdpAccountant):
        def _maybe_compose(self, event, count, do_compose):
            calls.append((event, count, do_compose))
            return super()._maybe_compose(event, count, do_compose)

    acc = Recording()
    assert acc.supports(ROUND)
    acc.compose(ROUND, 3)
    assert calls[0] == (ROUND, 0, False)  # supports() asks with count 0
    assert (ROUND, 3, True) in calls
    assert acc.get_epsilon(DELTA) == RdpAccountant().compose(ROUND, 3).get_epsilon(DELTA)


def test_cached_accountant_accounts_through_a_fresh_one_and_caches():
    built = []

    def fresh():
        built.append(1)
        return RdpAccountant()

    cache = {}
    relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    first = dpa_adapter.CachedAccountant(fresh, relation, cache)
    assert first.supports(ROUND) and not first.supports(dpa.UnsupportedDpEvent())
    expected = RdpAccountant().compose(ROUND, 5).get_epsilon(DELTA)
    assert first.compose(ROUND, 5).get_epsilon(DELTA) == expected
    count = len(built)
    second = dpa_adapter.CachedAccountant(fresh, relation, cache)
    assert second.compose(ROUND, 5).get_epsilon(DELTA) == expected
    assert len(built) == count + 1  # its support check only: the epsilon is a cache hit
