"""LAWA and EMA: exact window means, degenerate cases, a noisy quadratic, the server wrapper."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedsim.config import ConfigError, from_mapping
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.averaging import EMA, LAWA, Averaging
from strategies.methods.averaging import AveragedGlobalModel


def checkpoints(count, rng):
    return [{"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)} for _ in range(count)]


def test_lawa_equals_the_mean_of_the_last_k_checkpoints_exactly():
    pushed = checkpoints(25, np.random.default_rng(0))
    lawa = LAWA(k=10)
    for t, arrays in enumerate(pushed, start=1):
        lawa.push(arrays)
        window = pushed[max(0, t - 10) : t]
        for name in ("w", "b"):
            expected = np.mean(np.stack([c[name] for c in window]), axis=0)
            np.testing.assert_array_equal(lawa.average()[name], expected)


def test_lawa_gives_each_checkpoint_weight_one_over_k():
    # A mean seeded with the whole first checkpoint keeps a trace of it for ever.
    lawa = LAWA(k=4)
    lawa.push({"w": np.full(3, 1000.0)})
    for _ in range(4):
        lawa.push({"w": np.zeros(3)})
    np.testing.assert_array_equal(lawa.average()["w"], np.zeros(3))


def test_lawa_with_k_1_and_ema_with_beta_0_return_the_last_iterate():
    pushed = checkpoints(7, np.random.default_rng(1))
    lawa, ema = LAWA(k=1), EMA(beta=0.0)
    for arrays in pushed:
        lawa.push(arrays)
        ema.push(arrays)
        for name in arrays:
            np.testing.assert_array_equal(lawa.average()[name], arrays[name])
            np.testing.assert_array_equal(ema.average()[name], arrays[name])


def test_ema_starts_at_the_first_checkpoint_and_weights_recent_ones_geometrically():
    ema = EMA(beta=0.5)
    ema.push({"w": np.array([4.0])})
    assert ema.average()["w"][0] == 4.0
    ema.push({"w": np.array([0.0])})
    ema.push({"w": np.array([0.0])})
    assert ema.average()["w"][0] == 1.0


def test_averages_keep_the_pushed_dtype_and_shape():
    lawa, ema = LAWA(k=3), EMA(beta=0.9)
    for arrays in checkpoints(4, np.random.default_rng(2)):
        f32 = {n: a.astype(np.float32) for n, a in arrays.items()}
        lawa.push(f32)
        ema.push(f32)
    for avg in (lawa.average(), ema.average()):
        assert avg["w"].dtype == np.float32 and avg["w"].shape == (3, 4)


def noisy_quadratic_losses(averager, steps=4000, lr=0.1, dim=50, seed=3):
    """SGD on 0.5 * |theta|^2 with unit gradient noise: (last iterate, average) losses."""
    rng = np.random.default_rng(seed)
    theta = np.ones(dim)
    for step in range(1, steps + 1):
        theta = theta - lr * (theta + rng.standard_normal(dim))
        averager.observe(step, {"theta": theta})
    average = averager.average()["theta"]
    return 0.5 * float(theta @ theta), 0.5 * float(average @ average)


def test_ema_099_is_far_below_the_last_iterate_on_a_noisy_quadratic():
    last, averaged = noisy_quadratic_losses(EMA(beta=0.99))
    assert last > 1.0  # stationary noise floor of constant-lr SGD
    assert averaged < 0.2 * last


def test_lawa_also_beats_the_last_iterate_on_a_noisy_quadratic():
    last, averaged = noisy_quadratic_losses(Averaging(kind="lawa").for_budget(4000))
    assert averaged < 0.5 * last


def test_schedule_defaults_follow_the_step_budget():
    lawa = Averaging(kind="lawa").for_budget(5000)
    assert (lawa.k, lawa.every, lawa.burn_in) == (10, 10, 100)
    assert [s for s in range(1, 131) if lawa.due(s)] == [100, 110, 120, 130]
    tiny = Averaging(kind="ema", beta=0.9).for_budget(20)
    assert (tiny.every, tiny.burn_in) == (1, 0) and tiny.due(1)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="averaging.k"):
        Averaging(k=0)
    with pytest.raises(ConfigError, match="averaging.beta"):
        from_mapping(Averaging, {"kind": "ema", "beta": 1.0}, "client.averaging")
    with pytest.raises(ConfigError, match="kind"):
        from_mapping(Averaging, {"kind": "swa"}, "client.averaging")
    with pytest.raises(RuntimeError, match="no checkpoint"):
        LAWA().average()


class Fixed:
    """A strategy stub: round r's aggregate is the constant r; records what it is asked."""

    def __init__(self):
        self.evaluated = []
        self.trained = []

    def configure_train(self, server_round, arrays, config, grid):
        self.trained.append(to_numpy(arrays)["w"].copy())
        return []

    def aggregate_train(self, server_round, replies):
        return to_record({"w": np.full(2, float(server_round))}), MetricRecord({})

    def configure_evaluate(self, server_round, arrays, config, grid):
        self.evaluated.append(to_numpy(arrays)["w"].copy())
        return []


def test_server_wrapper_trains_raw_and_evaluates_the_average():
    inner = Fixed()
    wrapper = AveragedGlobalModel(inner, Averaging(kind="lawa", k=3, every=1, burn_in=0), 10)
    seen = []
    central = wrapper.evaluate_fn(lambda r, a: seen.append(to_numpy(a)["w"][0]) or None)
    arrays: ArrayRecord = to_record({"w": np.zeros(2)})
    central(0, arrays)
    for server_round in range(1, 6):
        wrapper.configure_train(server_round, arrays, ConfigRecord(), None)
        arrays, _ = wrapper.aggregate_train(server_round, [])
        wrapper.configure_evaluate(server_round, arrays, ConfigRecord(), None)
        central(server_round, arrays)
    assert [t[0] for t in inner.trained] == [0, 1, 2, 3, 4]  # raw global models
    assert [e[0] for e in inner.evaluated] == [1, 1.5, 2, 3, 4]  # mean of the last 3
    assert seen == [0, 1, 1.5, 2, 3, 4]
    np.testing.assert_array_equal(to_numpy(wrapper.averaged())["w"], [4.0, 4.0])
