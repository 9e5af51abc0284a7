"""Streaming noise: equals the materialised G Z, holds bounded state, resumes at any round."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.privacy.matrix import (
    banded,
    banded_toeplitz,
    binary_tree,
    blt,
    dense,
    honaker_tree,
    momentum,
    noise_stream,
    sqrt_factorization,
)
from fedsim.privacy.matrix.streaming import (
    BandedStream,
    BLTStream,
    DenseStream,
    TreeStream,
    dense_fresh_noise,
)

SHAPE = (2, 3)
D = math.prod(SHAPE)


def seeded(seed):
    """Round t's fresh noise from ``default_rng([seed, t])``: a public source, for tests."""
    return lambda t: np.random.default_rng([seed, t])

FACTORIES = {
    "tree": lambda n: binary_tree(n),
    "honaker": lambda n: honaker_tree(n),
    "sqrt": lambda n: sqrt_factorization(n),
    "banded_toeplitz": lambda n: banded_toeplitz(n, 3, max_iter=30),
    "banded": lambda n: banded(n, 4, max_iter=30),
    "dense": lambda n: dense(n, 1, max_iter=30),
    "blt": lambda n: blt(n, 3, max_iter=30),
}


def _run(stream, rounds):
    return np.stack([stream.next() for _ in range(rounds)])


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("n", [16, 23])
def test_streamed_noise_equals_dense_product(kind, n):
    f = FACTORIES[kind](n)
    stream = noise_stream(f, seeded(42), shape=SHAPE)
    streamed = _run(stream, n).reshape(n, D)
    Z = dense_fresh_noise(stream).reshape(-1, D)
    assert Z.shape[0] == f.encoder.shape[0]
    assert np.allclose(streamed, f.noising_matrix() @ Z, atol=1e-10)


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("tree", TreeStream),
        ("honaker", TreeStream),
        ("banded", BandedStream),
        ("banded_toeplitz", BandedStream),
        ("blt", BLTStream),
        ("sqrt", DenseStream),
        ("dense", DenseStream),
    ],
)
def test_each_family_gets_its_generator(kind, cls):
    assert isinstance(noise_stream(FACTORIES[kind](8), seeded(0), 1), cls)


def test_banded_and_blt_state_is_bounded_by_their_buffers():
    n = 40
    band = noise_stream(banded(n, 5, max_iter=20), seeded(1), SHAPE)
    toe = noise_stream(banded_toeplitz(n, 3, max_iter=20), seeded(1), SHAPE)
    buf = noise_stream(blt(n, 3, max_iter=20), seeded(1), SHAPE)
    for _ in range(n):
        band.next(), toe.next(), buf.next()
        assert band.state_size() == 4 * D
        assert toe.state_size() == 2 * D
        assert buf.state_size() == 3 * D


@pytest.mark.parametrize("factory", [binary_tree, honaker_tree])
def test_tree_state_is_bounded_by_log_n_nodes(factory):
    n = 100
    stream = noise_stream(factory(n), seeded(3), SHAPE)
    held = []
    for _ in range(n):
        stream.next()
        held.append(stream.state_size())
    # expansion nodes of t + 1 plus the last prefix
    assert max(held) <= (math.floor(math.log2(n)) + 2) * D
    assert max(held) == (max(bin(t + 1).count("1") for t in range(n)) + 1) * D


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_resume_from_state_continues_the_same_stream(kind):
    n, cut = 19, 11
    f = FACTORIES[kind](n)
    whole = _run(noise_stream(f, seeded(9), SHAPE), n)
    first = noise_stream(f, seeded(9), SHAPE)
    _run(first, cut)
    saved = first.state()
    _run(first, 3)  # the saved state is a copy, not a view
    resumed = noise_stream(f, seeded(9), SHAPE)
    resumed.restore(saved)
    assert resumed.round == cut
    assert np.array_equal(_run(resumed, n - cut), whole[cut:])
    replayed = noise_stream(f, seeded(9), SHAPE)  # nothing stored: redrawn from the source
    replayed.advance_to(cut)
    assert np.array_equal(_run(replayed, n - cut), whole[cut:])


def test_fresh_noise_depends_on_the_source_and_round_only():
    f = banded(12, 3, max_iter=20)
    a, b = noise_stream(f, seeded(5), SHAPE), noise_stream(f, seeded(5), SHAPE)
    early = b.fresh(7)  # drawing round 7 first changes nothing
    assert np.array_equal(_run(a, 12), _run(b, 12))
    assert np.array_equal(early, a.fresh(7))
    assert np.array_equal(early[0], np.random.default_rng([5, 7]).standard_normal(SHAPE))
    other = _run(noise_stream(f, seeded(6), SHAPE), 12)
    assert not np.allclose(other, _run(noise_stream(f, seeded(5), SHAPE), 12))


@pytest.mark.parametrize("kind", ["honaker", "blt"])
def test_streamed_noise_has_the_variance_of_the_noising_rows(kind):
    n, d = 12, 40_000
    f = FACTORIES[kind](n)
    y = _run(noise_stream(f, seeded(0), d), n)
    expected = np.sum(f.noising_matrix() ** 2, axis=1)
    # sample variance of d draws: relative sd sqrt(2 / d) ~ 0.7 %
    assert np.allclose(y.var(axis=1), expected, rtol=0.04)


def test_stream_stops_after_n_rounds_and_checks_its_source():
    stream = noise_stream(sqrt_factorization(2), seeded(0), 1)
    _run(stream, 2)
    with pytest.raises(ConfigError, match="round"):
        stream.next()
    with pytest.raises(ConfigError, match="round"):
        stream.advance_to(1)  # backwards
    with pytest.raises(ConfigError, match="noise"):
        noise_stream(sqrt_factorization(2), 0, 1)  # a seed is not a noise source
    with pytest.raises(ConfigError, match="noise"):
        noise_stream(sqrt_factorization(2), lambda t: 0, 1).next()


@pytest.mark.parametrize("factory", [binary_tree, honaker_tree, sqrt_factorization])
def test_stream_is_the_noising_matrix_for_a_momentum_workload_too(factory):
    n = 14
    f = factory(n, momentum(n, 0.9, np.linspace(1.0, 0.1, n)))
    stream = noise_stream(f, seeded(4), 5)
    streamed = _run(stream, n)
    assert np.allclose(streamed, f.apply_noising(dense_fresh_noise(stream)), atol=1e-10)
