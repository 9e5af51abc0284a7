"""DDGauss client encoding (clip, rotate, scale, conditional rounding, noise, field) and its
server inverse."""

import math

import numpy as np
import pytest

from fedsim.privacy.mechanisms import discrete_gaussian
from protocols import encoding
from protocols.encoding import (
    DDGaussEncoder,
    choose_gamma,
    conditional_round,
    hadamard_transform,
    padded_dimension,
    rotate,
    rotation_signs,
    rounding_norm_bound,
    sum_headroom_bits,
    unrotate,
)
from protocols.field import DEFAULT_FIELD


def _hadamard_matrix(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def test_fast_hadamard_matches_the_dense_matrix_and_is_an_involution():
    rng = np.random.default_rng(0)
    for n in (1, 2, 8, 64):
        x = rng.normal(size=(3, n))
        np.testing.assert_allclose(hadamard_transform(x), x @ _hadamard_matrix(n).T, atol=1e-12)
        np.testing.assert_allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(np.ones(6))


def test_rotation_preserves_norm_and_inverts():
    rng = np.random.default_rng(1)
    x = rng.normal(size=37)
    assert padded_dimension(37) == 64
    signs = rotation_signs(64, 5)
    np.testing.assert_array_equal(signs, rotation_signs(64, 5))
    y = rotate(x, signs)
    assert y.size == 64
    assert math.isclose(np.linalg.norm(y), np.linalg.norm(x), rel_tol=1e-12)
    np.testing.assert_allclose(unrotate(y, signs, 37), x, atol=1e-12)
    # a spike is spread over every coordinate
    spike = np.zeros(64)
    spike[3] = 1.0
    assert np.allclose(np.abs(rotate(spike, signs)), 1 / 8)


def test_conditional_rounding_is_unbiased_and_respects_the_bound():
    rng = np.random.default_rng(2)
    x = np.array([0.25, -1.5, 2.75, 0.0])
    draws = np.stack([conditional_round(x, 100.0, rng)[0] for _ in range(20000)])
    np.testing.assert_allclose(draws.mean(axis=0), x, atol=0.02)
    assert set(np.unique(draws[:, 0])) == {0, 1}
    bound = 3.2  # tight: only some roundings of x satisfy it
    for _ in range(200):
        rounded, tries = conditional_round(x, bound, rng)
        assert np.linalg.norm(rounded) <= bound and tries >= 1
    with pytest.raises(RuntimeError, match="max_tries"):
        conditional_round(np.full(16, 0.5), 1.0, rng, max_tries=3)


def test_rounding_bound_holds_with_probability_beta():
    rng = np.random.default_rng(3)
    dim, beta = 256, 0.5
    failures = 0
    for _ in range(400):
        x = rng.normal(size=dim)
        x *= 20.0 / np.linalg.norm(x)
        bound = rounding_norm_bound(20.0, dim, beta)
        floor = np.floor(x)
        rounded = floor + (rng.random(dim) < x - floor)
        failures += np.linalg.norm(rounded) > bound
    assert failures / 400 <= beta
    assert rounding_norm_bound(20.0, dim, 0.0) == 20.0 + 16.0
    assert rounding_norm_bound(20.0, dim, beta) < 36.0


def test_encode_decode_without_noise_is_unbiased_and_close():
    rng = np.random.default_rng(4)
    x = rng.normal(size=100)
    enc = DDGaussEncoder(dim=100, clip=100.0, gamma=1e-3, noise_std=0.0)
    total = np.zeros(enc.padded_dim, dtype=np.int64)
    n = 20
    for _ in range(n):
        total = DEFAULT_FIELD.add(total, enc.encode(x, 7, rng).elements)
    decoded = enc.decode(total, 7)
    # each coordinate's rounding error is at most gamma, and it averages out over clients
    np.testing.assert_allclose(decoded / n, x, atol=enc.gamma * 3)


def test_clipping_and_noise_scale():
    rng = np.random.default_rng(5)
    x = np.full(30, 10.0)
    enc = DDGaussEncoder(dim=30, clip=1.0, gamma=0.01, noise_std=0.0)
    out = enc.encode(x, 1, rng)
    assert out.clipped
    assert np.linalg.norm(enc.decode(out.elements, 1)) <= 1.0 + enc.gamma * math.sqrt(32)
    noisy = DDGaussEncoder(dim=1000, clip=1.0, gamma=0.01, noise_std=0.5)
    encoded = noisy.encode(np.zeros(1000), 1, rng, sampler=discrete_gaussian)
    decoded = noisy.decode(encoded.elements, 1)
    assert abs(decoded.std() - 0.5) < 0.05  # sigma/gamma = 50 integer steps, times gamma


def test_same_seed_same_encoding_and_signed_field_mapping():
    x = np.linspace(-1, 1, 10)
    enc = DDGaussEncoder(dim=10, clip=1.0, gamma=0.05, noise_std=0.1)
    a = enc.encode(x, 3, np.random.default_rng(9), sampler=discrete_gaussian).elements
    b = enc.encode(x, 3, np.random.default_rng(9), sampler=discrete_gaussian).elements
    np.testing.assert_array_equal(a, b)
    signed = DEFAULT_FIELD.decode_signed(a)
    assert signed.min() < 0 and np.all(np.abs(signed) < 1000)


def test_encoder_validates_arguments():
    with pytest.raises(ValueError, match="gamma"):
        DDGaussEncoder(dim=4, clip=1.0, gamma=0.0, noise_std=0.1)
    with pytest.raises(ValueError, match="beta"):
        DDGaussEncoder(dim=4, clip=1.0, gamma=0.1, noise_std=0.1, beta=1.0)
    enc = DDGaussEncoder(dim=4, clip=1.0, gamma=0.1, noise_std=0.1)
    with pytest.raises(ValueError, match="dim=4"):
        enc.encode(np.zeros(5), 0, np.random.default_rng(0), sampler=discrete_gaussian)
    with pytest.raises(ValueError, match="sampler=None with noise_std=0.1"):
        enc.encode(np.zeros(4), 0, np.random.default_rng(0))


def test_choose_gamma_fits_the_bit_budget_exactly():
    dim, n, clip, std = 1000, 100, 1.0, 0.01
    for bits in (20, 32, 61):
        gamma = choose_gamma(dim, n, clip, std, bits)
        enc = DDGaussEncoder(dim=dim, clip=clip, gamma=gamma, noise_std=std)
        assert enc.headroom_bits(n, bits=bits) >= 0
        finer = DDGaussEncoder(dim=dim, clip=clip, gamma=gamma * 0.99, noise_std=std)
        with pytest.raises(ValueError, match="wrap"):
            finer.headroom_bits(n, bits=bits)
    with pytest.raises(ValueError, match="bits"):
        choose_gamma(dim, 10**6, clip, std, 8)


def test_headroom_refuses_a_sum_that_can_wrap():
    with pytest.raises(ValueError, match="bits"):
        sum_headroom_bits(100, 2.0**30, 1.0, 1024, bits=32)
    assert sum_headroom_bits(100, 2.0**10, 1.0, 1024) > 40


def test_secure_mode_noise_comes_from_the_os():
    from fedsim.privacy.mechanisms import SecureRandom

    enc = DDGaussEncoder(dim=64, clip=1.0, gamma=0.01, noise_std=0.5)
    x = np.zeros(64)
    draws = [
        enc.encode(
            x, 1, np.random.default_rng(0), noise_rng=SecureRandom(), sampler=discrete_gaussian
        ).elements
        for _ in range(2)
    ]
    assert not np.array_equal(draws[0], draws[1])  # the same seed, different OS noise


@pytest.mark.parametrize("shape", [(2**12,), (2**13,), (3, 2**15), (2, 2, 2**12), (2**17,)])
def test_the_row_wise_transform_is_the_butterfly_to_the_bit(shape):
    """From 2^12 on the stages run on whole rows of the transposed matrix; each value is still
    the same two numbers added in the same stage order, so nothing moves by even one ulp."""
    rng = np.random.default_rng(len(shape) * shape[-1])
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 6, size=shape)
    before = x.copy()
    expected = encoding._butterfly(x.copy()) / np.sqrt(shape[-1])
    np.testing.assert_array_equal(hadamard_transform(x), expected)
    np.testing.assert_array_equal(x, before)  # the input is left alone
    again = hadamard_transform(hadamard_transform(x))
    np.testing.assert_allclose(again, x, rtol=0, atol=1e-9 * np.abs(x).max())
