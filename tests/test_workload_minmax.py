"""Quantized Optimistic Dual Averaging on monotone quadratic games."""

import numpy as np
import pytest

from fedsim.workloads.compression import Quantization
from fedsim.workloads.minmax import LinearGame, qoda


def distance(point, target):
    return float(np.sqrt(sum(np.sum((point[k] - target[k]) ** 2) for k in target)))


def setup(mu, seed=1, workers=4, n=6):
    game = LinearGame.random(np.random.default_rng(seed), n, n, workers, mu=mu)
    start = {"x": np.zeros(n), "y": np.zeros(n)}
    return game, [game.operator(k) for k in range(workers)], start, game.equilibrium()


def test_equilibrium_zeroes_the_mean_operator():
    game, operators, _, star = setup(0.3)
    values = [op(star) for op in operators]
    for name in ("x", "y"):
        np.testing.assert_allclose(np.mean([v[name] for v in values], axis=0), 0, atol=1e-12)


def test_exact_optimistic_dual_averaging_converges_on_a_bilinear_game_where_plain_da_does_not():
    _, operators, start, star = setup(0.0)
    d0 = distance(start, star)
    optimistic = qoda(
        operators, start, 1500, lr=1.0, quantization=None, rng=np.random.default_rng(0)
    )
    plain = qoda(
        operators,
        start,
        1500,
        lr=1.0,
        quantization=None,
        rng=np.random.default_rng(0),
        optimistic=False,
    )
    assert distance(optimistic.last, star) < 1e-6 * d0
    assert distance(plain.last, star) > d0


@pytest.mark.parametrize("mu", [0.0, 0.2])
def test_qoda_with_4_bit_layer_wise_uploads_converges(mu):
    _, operators, start, star = setup(mu)
    d0 = distance(start, star)
    result = qoda(
        operators,
        start,
        1000,
        lr=2.0,
        quantization=Quantization(bits=4),
        rng=np.random.default_rng(3),
    )
    assert distance(result.average, star) < 0.03 * d0
    if mu > 0:  # strongly monotone: the last iterate too
        assert distance(result.last, star) < 0.15 * d0


def test_qoda_counts_the_bits_each_worker_sends():
    _, operators, start, _ = setup(0.2)
    quantized = qoda(
        operators,
        start,
        10,
        lr=1.0,
        quantization=Quantization(bits=3),
        rng=np.random.default_rng(0),
    )
    exact = qoda(operators, start, 10, lr=1.0, quantization=None, rng=np.random.default_rng(0))
    assert quantized.bits_per_worker == 10 * 2 * (32 + 6 * 3)  # two blocks, a norm each
    assert exact.bits_per_worker == 10 * 12 * 32


def test_qoda_is_deterministic_given_the_generator_and_rejects_bad_arguments():
    _, operators, start, _ = setup(0.2)
    runs = [
        qoda(
            operators,
            start,
            50,
            lr=1.0,
            quantization=Quantization(bits=2),
            rng=np.random.default_rng(5),
        )
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0].last["x"], runs[1].last["x"])
    with pytest.raises(ValueError, match="steps"):
        qoda(operators, start, 0, lr=1.0, quantization=None, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="lr"):
        qoda(operators, start, 5, lr=0.0, quantization=None, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="mu"):
        LinearGame((np.eye(2),), (np.zeros(2),), (np.zeros(2),), mu=-1.0)
