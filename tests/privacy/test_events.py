"""The JSON form of ledger events: one table row per event class drives checks, writing,
reading and the Gaussian reduction."""

import json
import math

import dp_accounting as dpa
import pytest

from fedsim.config import ConfigError
from fedsim.privacy.accountant import for_accountant
from fedsim.privacy.events import KINDS, check_event, event_from_dict, event_to_dict
from fedsim.privacy.round_events import effective_noise_multiplier

G = dpa.GaussianDpEvent(1.5)
EXAMPLES = {
    "gaussian": G,
    "poisson_sampled": dpa.PoissonSampledDpEvent(0.1, G),
    "sampled_without_replacement": dpa.SampledWithoutReplacementDpEvent(100, 10, G),
    "self_composed": dpa.SelfComposedDpEvent(G, 4),
    "composed": dpa.ComposedDpEvent([G, dpa.GaussianDpEvent(3.0)]),
    "non_private": dpa.NonPrivateDpEvent(),
    "no_op": dpa.NoOpDpEvent(),
    "zcdp": dpa.ZCDpEvent(0.125),
}


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(KINDS)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_kind_round_trips_through_json(name):
    event = dpa.SelfComposedDpEvent(EXAMPLES[name], 2)  # nested too
    data = json.loads(json.dumps(event_to_dict(event)))
    assert data["event"]["type"] == name
    assert event_from_dict(data) == event


def test_json_fields_keep_the_constructor_order():
    data = event_to_dict(EXAMPLES["sampled_without_replacement"])
    assert list(data) == ["type", "source_dataset_size", "sample_size", "event"]
    assert list(event_to_dict(EXAMPLES["self_composed"])) == ["type", "event", "count"]


def test_bad_fields_are_named_by_their_path():
    with pytest.raises(ConfigError) as err:
        check_event(dpa.ComposedDpEvent([G, dpa.PoissonSampledDpEvent(1.5, G)]))
    assert err.value.key == "event.events[1].sampling_probability"
    with pytest.raises(ConfigError) as err:
        event_from_dict({"type": "self_composed", "event": {"type": "no_op"}, "count": -1})
    assert err.value.key == "event.count"
    with pytest.raises(ConfigError) as err:
        event_from_dict({"type": "gaussian", "noise_multiplier": 1.0, "module": "os"})
    assert err.value.key == "event.module"
    with pytest.raises(ConfigError) as err:
        event_from_dict({"type": "composed", "events": {"type": "no_op"}})
    assert err.value.key == "event.events"
    with pytest.raises(ConfigError):
        check_event(dpa.LaplaceDpEvent(1.0))


def test_gaussian_reduction_and_accountant_form():
    assert effective_noise_multiplier(EXAMPLES["self_composed"]) == pytest.approx(0.75)
    composed = effective_noise_multiplier(EXAMPLES["composed"])
    assert composed == pytest.approx((1.5**-2 + 3.0**-2) ** -0.5)
    assert effective_noise_multiplier(EXAMPLES["no_op"]) == math.inf
    assert effective_noise_multiplier(EXAMPLES["poisson_sampled"]) is None
    sampled = dpa.PoissonSampledDpEvent(0.1, dpa.SelfComposedDpEvent(G, 4))
    assert for_accountant(sampled, "rdp", "replace_one") == dpa.PoissonSampledDpEvent(
        0.1, dpa.GaussianDpEvent(0.375)
    )
    assert for_accountant(dpa.SelfComposedDpEvent(G, 3), "pld", "add_remove") == (
        dpa.SelfComposedDpEvent(G, 3)
    )
