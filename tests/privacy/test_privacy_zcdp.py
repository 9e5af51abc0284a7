"""zCDP releases (DDGauss, DMM) have their own event kind: the RDP accountant composes them by
their RDP curve ``alpha * rho`` (Bun & Steinke 2016, Def. 1.1), the PLD accountant refuses them."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from fedsim.config import ConfigError
from fedsim.privacy import ddgauss, dmm
from fedsim.privacy.accountant import event_epsilon, for_accountant
from fedsim.privacy.events import event_from_dict, event_to_dict
from fedsim.privacy.ledger import PrivacyLedger

DELTA = 1e-5


def test_rdp_epsilon_is_the_conversion_of_alpha_times_rho():
    rho = 0.02
    orders = rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    expected, _ = rdp_privacy_accountant.compute_epsilon(
        orders, [alpha * rho for alpha in orders], DELTA
    )
    got = event_epsilon(dpa.ZCDpEvent(rho), "rdp", "add_remove", DELTA)
    assert got == pytest.approx(expected, rel=1e-12)
    # replace-one doubles the sensitivity: rho becomes 4 rho
    assert event_epsilon(dpa.ZCDpEvent(rho), "rdp", "replace_one", DELTA) == pytest.approx(
        event_epsilon(dpa.ZCDpEvent(4 * rho), "rdp", "add_remove", DELTA), rel=1e-12
    )


def test_the_pld_accountant_refuses_a_zcdp_event_rather_than_read_it_as_a_gaussian():
    """A Gaussian's PLD is tighter than what rho-zCDP guarantees, so it would be optimistic."""
    event = dpa.ZCDpEvent(0.02)
    assert for_accountant(event, "pld", "add_remove") is event
    with pytest.raises(ConfigError) as err:
        event_epsilon(event, "pld", "add_remove", DELTA)
    assert err.value.key == "accountant" and "rdp" in err.value.allowed
    ledger = PrivacyLedger("add_remove", DELTA)
    ledger.record(1, event)
    with pytest.raises(ConfigError):
        ledger.epsilon(accountant="pld")


def test_ddgauss_and_dmm_record_zcdp_with_the_same_rdp_epsilon_as_the_old_gaussian():
    eps = ddgauss.zcdp_epsilon(50.0, 400.0, 20.0, 12, 64)
    event = ddgauss.round_event(50.0, 400.0, 20.0, 12, 64)
    assert event == dpa.ZCDpEvent(eps**2 / 2)
    old = dpa.GaussianDpEvent(1.0 / eps)  # how a round was recorded before the zCDP kind
    for relation in ("add_remove", "replace_one"):
        assert for_accountant(event, "rdp", relation) == for_accountant(old, "rdp", relation)
    increment = dmm.increment_event(0.1, 0.3)
    assert increment == dpa.ZCDpEvent((0.3**2 - 0.1**2) / 2)
    assert for_accountant(increment, "rdp", "add_remove") == dpa.GaussianDpEvent(
        1.0 / math.sqrt(0.3**2 - 0.1**2)
    )


def test_zcdp_round_trips_and_bad_rho_is_named():
    event = dpa.SelfComposedDpEvent(dpa.ZCDpEvent(0.5), 3)
    assert event_from_dict(event_to_dict(event)) == event
    with pytest.raises(ConfigError) as err:
        event_from_dict({"type": "zcdp", "rho": -1.0, "xi": 0.0})
    assert err.value.key == "event.rho"
    with pytest.raises(ConfigError) as err:  # (xi, rho)-zCDP has no Gaussian of equal RDP
        event_from_dict({"type": "zcdp", "rho": 0.1, "xi": 0.5})
    assert err.value.key == "event.xi"
    assert for_accountant(dpa.ZCDpEvent(0.0), "rdp", "add_remove") == dpa.NoOpDpEvent()
