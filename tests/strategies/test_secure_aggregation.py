"""FedAvg with secure aggregation and no DP, from a config: ``secure_sum = "secagg"`` or
``"committee"`` gives plain FedAvg's model up to the fixed-point quantisation (the bound is
asserted), reports no DP (epsilon infinite, "secure aggregation without DP"), and refuses what
would break it (a value beyond the fixed-point range, worker-side folding, evaluation)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from fedsim.config import ConfigError
from strategies import secure
from strategies.plumbing.secure_aggregation import (
    MECHANISM,
    SECURE_SUM_KEYS,
    SUM_OPTIONS,
    FixedPoint,
    SecureAggregation,
    SecureSumOptions,
)
from strategies.registry import build_strategy

RUN = """
seed = 5
rounds = 1

[data]
source = "digits"
partition = "iid"
num_clients = 16

[model]
kind = "logreg"

[client]
lr = 0.2

[strategy]
name = "fedavg"
clients_per_round = 8

[strategy.options]
{options}

[engine]
backend = "local"
"""
FRACTIONAL_BITS = 16


def run(tmp_path, name: str, options: str):
    from fedsim.cli import main
    from fedsim.frontend.results import read_rounds

    config = tmp_path / f"{name}.toml"
    config.write_text(RUN.format(options=options))
    out = tmp_path / name
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    rounds = [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]
    summary = json.loads((out / "summary.json").read_text())
    return dict(np.load(out / "model.npz")), rounds, summary


@pytest.mark.parametrize(
    "secure_sum, extra",
    [("secagg", ""), ("committee", "committee_size = 5\nthreshold = 1\npacking = 2\n")],
)
def test_fedavg_with_a_secure_sum_is_fedavg_up_to_the_quantisation(tmp_path, secure_sum, extra):
    plain, _, _ = run(tmp_path, "plain", "")
    options = f'secure_sum = "{secure_sum}"\nfractional_bits = {FRACTIONAL_BITS}\n{extra}'
    secured, rounds, summary = run(tmp_path, secure_sum, options)
    (record,) = rounds
    aggregated = record["aggregated"]
    assert aggregated["secure-contributors"] == 8 and aggregated["secure-aborted"] == 0
    weight = aggregated["secure-weight"]
    bound = FixedPoint(FRACTIONAL_BITS).error_bound(8, weight)
    assert aggregated["secure-error-bound"] == pytest.approx(bound)
    assert plain.keys() == secured.keys()
    worst = 0.0
    for key in plain:
        a, b = plain[key].astype(np.float64), secured[key].astype(np.float64)
        slack = bound + 4 * np.spacing(np.abs(plain[key]).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(a - b) <= slack), (key, float(np.max(np.abs(a - b))), bound)
        worst = max(worst, float(np.max(np.abs(a - b))))
    assert 0 < worst  # a fixed-point sum, not the same arithmetic
    for privacy in (record["privacy"], summary["privacy"]):
        assert privacy["mechanism"] == MECHANISM and privacy["dp"] is False
        assert privacy["secure_sum"] == secure_sum
        assert privacy.get("epsilon_infinite") is True or privacy["epsilon"] == math.inf


def facts(**kwargs):
    base = dict(expected_clients=8, evaluate_fraction=0.0, seed=0)
    base.update(kwargs)
    return base


def test_options_are_checked_and_named():
    built = build_strategy("fedadam", {"secure_sum": "secagg", "eta": 0.1}, **facts())
    assert isinstance(built, SecureAggregation) and built.secure.name == "secagg"
    assert math.isinf(built.epsilon()) and built.privacy_report()["dp"] is False
    with pytest.raises(ConfigError, match="strategy.options.secure_sum"):
        build_strategy("fedavg", {"secure_sum": "plaintext"}, **facts())
    with pytest.raises(ConfigError, match="strategy.options.value_bound"):
        build_strategy("fedavg", {"value_bound": 3.0}, **facts())
    with pytest.raises(ConfigError, match="strategy.options.threshold"):
        build_strategy("fedavg", {"secure_sum": "secagg", "threshold": 2}, **facts())
    with pytest.raises(ConfigError, match="strategy.options.secure_sum"):
        build_strategy("fedmedian", {"secure_sum": "secagg"}, **facts())
    with pytest.raises(ConfigError, match="partial_aggregation"):
        build_strategy("fedavg", {"secure_sum": "secagg"}, partial_aggregation="on", **facts())
    with pytest.raises(ConfigError, match="strategy.options.committee_size = None"):
        build_strategy("fedavg", {"secure_sum": "committee", "threshold": 1}, **facts())
    with pytest.raises(ConfigError, match="could wrap"):
        build_strategy(
            "fedavg",
            {"secure_sum": "secagg", "fractional_bits": 40, "value_bound": 2.0**19},
            **facts(),
        )
    with pytest.raises(ValueError, match="federated evaluation"):
        build_strategy("fedavg", {"secure_sum": "secagg"}, **facts(evaluate_fraction=0.5))


def test_the_options_are_composed_from_each_secure_sums_own():
    """``SecureSumOptions`` holds ``secure_sum``, the fixed point's keys and every secure sum's
    own (:attr:`SecureSum.options_type`); a sum's exclusive keys are refused with another."""
    own = [secure.CLASSES[n].options_type for n in secure.WITHOUT_DP]
    assert list(SUM_OPTIONS) == [o for o in own if o is not None]
    parts = [f.name for part in SUM_OPTIONS for f in dataclasses.fields(part)]
    assert SECURE_SUM_KEYS == ("secure_sum", "fractional_bits", "value_bound", *parts)
    assert {"secagg_degree", "stage_timeout", "committee_size", "member_dropout"} <= set(parts)
    with pytest.raises(ConfigError, match="only with secure_sum = 'committee'") as error:
        SecureSumOptions(secure_sum="secagg", member_dropout=0.1)
    assert error.value.key == "strategy.options.member_dropout"
    with pytest.raises(ConfigError, match="strategy.options.secagg_degree"):
        SecureSumOptions(secure_sum="committee", secagg_degree=3, committee_size=5, threshold=1)
    with pytest.raises(ConfigError, match="set only with secure_sum"):
        SecureSumOptions(stage_timeout=3.0)
    chosen = SecureSumOptions(
        secure_sum="committee", secagg_degree=4, committee_size=5, threshold=1, member_dropout=0.2
    )
    arguments = chosen.arguments()
    assert arguments["secagg_degree"] == 4 and arguments["member_dropout"] == 0.2
    assert arguments["committee"].size == 5 and "stage_timeout" not in arguments
    assert SecureSumOptions(secure_sum="secagg", stage_timeout=9.0).arguments() == {
        "stage_timeout": 9.0
    }


def test_the_fixed_point_range_is_an_error_naming_the_option_not_the_value():
    codec = FixedPoint(16, 10.0)
    np.testing.assert_allclose(codec.decode(codec.encode(np.array([9.5, -3.25]))), [9.5, -3.25])
    with pytest.raises(ValueError, match="strategy.options.value_bound = 10.0") as error:
        codec.encode(np.array([0.5, 12.345678]))
    assert "12.34" not in str(error.value)
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([np.nan]))
    with pytest.raises(ValueError, match="fractional_bits"):
        FixedPoint(41)


def test_further_secagg_plan_fields_reach_the_plan_and_unknown_ones_are_named():
    from flwr.serverapp.strategy import FedAvg

    wrapped = SecureAggregation(
        FedAvg(fraction_evaluate=0.0),
        secure_sum="secagg",
        seed=3,
        expected_clients=8,
        secagg_degree=4,
        secagg_plan={"dropout": 0.25},
    )
    assert wrapped.secure.plan == secure.SecAggPlan(3, 4, dropout=0.25)
    with pytest.raises(ValueError, match="secagg_plan key 'kdf'; allowed: dropout, prg, ring_bits"):
        SecureAggregation(
            FedAvg(fraction_evaluate=0.0),
            secure_sum="secagg",
            seed=3,
            expected_clients=8,
            secagg_plan={"kdf": "hkdf"},
        )


def test_secagg_options_other_than_the_wrappers_own_keywords_become_plan_fields():
    options = SecureSumOptions(secure_sum="secagg", secagg_degree=4, stage_timeout=9.0)
    assert options.arguments() == {"secagg_degree": 4, "stage_timeout": 9.0}
    plan_keys = {f.name for f in dataclasses.fields(secure.SecAggPlan)}
    own = {f.name for f in dataclasses.fields(secure.secagg.SecAggOptions)}
    # every SecAgg+ option is a wrapper keyword or a plan field of the same name
    assert own - {"secagg_degree", "stage_timeout"} <= plan_keys
