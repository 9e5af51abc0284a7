"""Explicit composition (issue 28, point 5): a wrapper forwards nothing by name; the front
end finds each hook on the layer that declares it (:mod:`fedsim.engine.hooks`)."""

from __future__ import annotations

import pytest
from flwr.serverapp.strategy import FedAvg

from fedsim.engine.hooks import (
    Closable,
    PrivacyReporting,
    Stoppable,
    find,
    layers,
)
from strategies.plumbing.recorded_start import run_summary
from strategies.plumbing.seeded_sampling import SeededSampling
from strategies.plumbing.server_secret import bind_parties
from strategies.plumbing.wrapper import StrategyWrapper, arrayrecord_key, fraction_evaluate


class Budgeted(StrategyWrapper):
    """A private, stoppable layer that also opens something."""

    def __init__(self, strategy) -> None:
        super().__init__(strategy)
        self.stop_reason: str | None = None
        self.closed = 0
        self.secrets: list = []

    def privacy_report(self) -> dict:
        return {"epsilon": 1.5}

    def should_stop(self, server_round: int) -> bool:
        if server_round > 2:
            self.stop_reason = "budget"
        return server_round > 2

    def close(self) -> None:
        self.closed += 1

    def bind_server_secret(self, secret) -> None:
        self.secrets.append(secret)


def test_a_wrapper_forwards_no_attribute_by_name():
    inner = FedAvg(fraction_evaluate=0.25)
    inner.extra = "only on the inner strategy"
    outer = SeededSampling(StrategyWrapper(inner), seed=1)
    with pytest.raises(AttributeError):
        _ = outer.extra
    # what callers read of the wrapped strategy's messages is declared, and passed on
    assert outer.arrayrecord_key == inner.arrayrecord_key == arrayrecord_key(outer)
    assert outer.weighted_by_key == inner.weighted_by_key
    assert fraction_evaluate(outer) == 0.25
    assert list(layers(outer)) == [outer, outer.strategy, inner]


def test_hooks_are_found_on_the_layer_that_declares_them():
    budgeted = Budgeted(FedAvg())
    outer = SeededSampling(StrategyWrapper(budgeted), seed=1)
    assert find(outer, PrivacyReporting) is budgeted
    assert find(outer, Stoppable) is budgeted
    assert find(outer, Closable) is budgeted
    assert find(SeededSampling(FedAvg(), seed=1), PrivacyReporting) is None
    assert not isinstance(outer, PrivacyReporting)  # the outer layers do not pose as it
    assert budgeted.should_stop(3)
    assert run_summary(outer) == {"stopped_reason": "budget", "privacy": {"epsilon": 1.5}}
    assert run_summary(SeededSampling(FedAvg(), seed=1)) == {"stopped_reason": None}


def test_bind_parties_binds_every_layer_that_takes_the_secret():
    inner = Budgeted(FedAvg())
    outer_budget = Budgeted(StrategyWrapper(inner))
    from fedsim.randomness import RunSecret  # noqa: PLC0415

    server = RunSecret.from_passphrase("hooks").server()
    bind_parties(SeededSampling(outer_budget, seed=0), server)
    assert inner.secrets == [server] and outer_budget.secrets == [server]
