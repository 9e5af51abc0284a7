"""Layer-wise unbiased quantisation: unbiasedness, exact variance, QSGD bound, wire format."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedsim.config import ConfigError
from fedsim.record_codec import content_nbytes, to_numpy, to_record
from fedsim.workloads.compression import (
    Quantization,
    adapt_levels,
    decode,
    encode,
    intervals_for_bits,
    quantize,
    quantize_with_uniforms,
    uniform_levels,
    variance,
)
from fedsim.workloads.upload import UPLOAD_BITS, dequantize_reply, quantized_upload

GRID = 1 << 14


@pytest.fixture(autouse=True)
def _identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1


def grid_moments(v, levels):
    """Mean of Q(v) and of |Q(v) - v|^2 over a fine grid of uniform draws.

    Each coordinate's draw sweeps [0, 1) evenly, so per-coordinate means are
    exact up to 1/GRID (the squared error is a sum of per-coordinate terms).
    """
    total, squares = np.zeros(v.size), 0.0
    for j in range(GRID):
        q = quantize_with_uniforms(v, levels, np.full(v.size, (j + 0.5) / GRID)).value()
        q = q.reshape(-1).astype(np.float64)
        total += q
        squares += float(np.sum((q - v.reshape(-1)) ** 2))
    return total / GRID, squares / GRID


@pytest.mark.parametrize("levels", [uniform_levels(3), np.array([0.0, 0.05, 0.2, 0.6, 1.0])])
def test_unbiased_and_variance_exact_over_the_draw_distribution(levels):
    v = np.array([0.3, -1.2, 0.0, 2.5, -0.01, 0.7], dtype=np.float32)
    mean, mse = grid_moments(v, levels)
    norm = float(np.linalg.norm(v))
    np.testing.assert_allclose(mean, v, atol=2 * norm / GRID)
    assert mse == pytest.approx(variance(v, levels), rel=1e-3)
    assert variance(v, levels) > 0


def test_unbiased_statistically_with_a_generator():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(40)
    levels = uniform_levels(intervals_for_bits(3))
    draws = np.stack([quantize(v, levels, rng).value() for _ in range(4000)]).astype(np.float64)
    error = draws.mean(axis=0) - v
    per_coordinate_var = draws.var(axis=0).sum()
    assert per_coordinate_var == pytest.approx(variance(v, levels), rel=0.08)
    standard_error = np.sqrt(draws.var(axis=0) / len(draws)) + 1e-12
    assert np.all(np.abs(error) < 5 * standard_error + 1e-6)


@pytest.mark.parametrize("d", [1, 10, 100, 5000])
@pytest.mark.parametrize("intervals", [1, 3, 7, 127])
def test_variance_is_under_the_qsgd_bound(d, intervals):
    rng = np.random.default_rng(d + intervals)
    levels = uniform_levels(intervals)
    for v in (rng.standard_normal(d), rng.standard_cauchy(d), np.ones(d)):
        bound = min(d / intervals**2, np.sqrt(d) / intervals) * float(v @ v)
        assert variance(v, levels) <= bound * (1 + 1e-12)


def test_adapted_levels_lower_the_variance_of_peaked_layers():
    rng = np.random.default_rng(4)
    v = rng.laplace(size=2000) ** 3  # most mass near 0
    u = np.abs(v) / np.linalg.norm(v)
    adapted = adapt_levels(u, interior=2)
    assert adapted[0] == 0 and adapted[-1] == 1 and np.all(np.diff(adapted) > 0)
    assert variance(v, adapted) < 0.5 * variance(v, uniform_levels(3))


@pytest.mark.parametrize("bits", [2, 3, 4, 8, 9, 16])
def test_encode_decode_round_trip_and_packed_size(bits):
    rng = np.random.default_rng(bits)
    levels = uniform_levels(intervals_for_bits(bits))
    for v in (rng.standard_normal((7, 5)), np.eye(1, 9).reshape(9), np.zeros(4)):
        layer = quantize(v, levels, rng)
        packed = encode(layer, bits)
        assert packed.dtype == np.uint8 and packed.size == -(-v.size * bits // 8)
        decoded = decode(packed, float(layer.norm), levels, bits, v.shape)
        np.testing.assert_array_equal(decoded, layer.value())


def test_quantization_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="client.compression.bits"):
        Quantization(bits=1)
    with pytest.raises(ConfigError, match="bits_by_type"):
        Quantization(bits_by_type={"conv": 4})
    with pytest.raises(ValueError, match="levels"):
        variance(np.ones(3), np.array([0.0, 0.5, 0.4, 1.0]))


def trained_app(local):
    def app_with(config):
        app = ClientApp(mods=[quantized_upload(config)])

        @app.train()
        def train(message, context):
            metrics = MetricRecord({"num-examples": 5})
            return Message(
                RecordDict({"arrays": to_record(local), "metrics": metrics}), reply_to=message
            )

        return app

    return app_with


def run_train(app, global_arrays, server_round=1, partition=0):
    content = RecordDict(
        {"arrays": to_record(global_arrays), "config": ConfigRecord({"server-round": server_round})}
    )
    message = Message(content, dst_node_id=1, message_type="train")
    context = Context(1, 1, {"partition-id": partition}, RecordDict(), {})
    return app(message, context)


@pytest.mark.parametrize("levels", ["uniform", "adaptive"])
def test_quantized_upload_ships_packed_codes_and_counts_its_bits(levels):
    rng = np.random.default_rng(5)
    global_arrays = {
        "w": rng.standard_normal((50, 40)).astype(np.float32),
        "b": np.zeros(10, np.float32),
    }
    local = {
        k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
        for k, v in global_arrays.items()
    }
    config = Quantization(bits=4, bits_by_type={"bias": 8}, levels=levels)
    reply = run_train(trained_app(local)(config), global_arrays)
    adapted = 0 if levels == "uniform" else (2**3 - 2) + (2**7 - 2)
    expected_bits = (32 + 2000 * 4) + (32 + 10 * 8) + 32 * adapted
    assert reply.content["metrics"][UPLOAD_BITS] == expected_bits
    packed = to_numpy(reply.content["arrays"])
    assert packed["w"].nbytes == 1000 and packed["b"].nbytes == 10
    dense = content_nbytes(RecordDict({"arrays": to_record(local)}))
    assert content_nbytes(reply.content) < (0.2 if levels == "uniform" else 0.5) * dense
    restored = to_numpy(dequantize_reply(reply, global_arrays).content["arrays"])
    assert all(restored[name].shape == local[name].shape for name in local)
    assert all(restored[name].dtype == np.float32 for name in local)
    # One draw of a 2000-coordinate layer: its squared error concentrates at the variance.
    delta = local["w"].astype(np.float64) - global_arrays["w"]
    error = float(np.sum((restored["w"] - local["w"]).astype(np.float64) ** 2))
    uniform = variance(delta, uniform_levels(intervals_for_bits(4)))
    if levels == "uniform":
        assert error == pytest.approx(uniform, rel=0.15)
    else:
        assert error < 0.8 * uniform


def test_quantized_uploads_are_unbiased_over_rounds_and_seeded():
    rng = np.random.default_rng(6)
    global_arrays = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    local = {"w": global_arrays["w"] + rng.standard_normal((4, 3)).astype(np.float32)}
    app = trained_app(local)(Quantization(bits=2))
    restored = [
        to_numpy(
            dequantize_reply(run_train(app, global_arrays, r), global_arrays).content["arrays"]
        )["w"]
        for r in range(1, 3001)
    ]
    np.testing.assert_allclose(np.mean(restored, axis=0), local["w"], atol=0.12)
    again = dequantize_reply(run_train(app, global_arrays, 7), global_arrays)
    np.testing.assert_array_equal(to_numpy(again.content["arrays"])["w"], restored[6])


def test_server_refuses_replies_without_a_quantised_upload():
    from flwr.serverapp.strategy import FedAvg

    from strategies.methods.quantized import DequantizedUploads

    global_arrays = {"w": np.zeros((3, 2), np.float32)}
    reply = run_train(
        trained_app({"w": np.ones((3, 2), np.float32)})(Quantization(bits=3)), global_arrays
    )
    reply.content = RecordDict({k: v for k, v in reply.content.items() if k != "fedsim.quantized"})
    strategy = DequantizedUploads(FedAvg())
    strategy._sent = {1: to_record(global_arrays)}
    with pytest.raises(RuntimeError, match="client.compression"):
        strategy.aggregate_train(1, [reply])
