"""Kind ``tree_restart`` (fedsim/privacy/matrix/kinds/tree_restart.py): DP-FTRL's binary tree
restarted every ``restart_every`` rounds -- B C is the prefix-sum workload, C is the
block-diagonal of tree node matrices, the sensitivity is the direct maximum over participation
patterns, the streamed noise is A^{-1} B z, and DMM takes it as its 0/1 M = C."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedsim.config import ConfigError
from fedsim.privacy import dmm
from fedsim.privacy.matrix import Factorization, binary_tree
from fedsim.privacy.matrix.build import Spec, build, cached
from fedsim.privacy.matrix.kinds import kind
from fedsim.privacy.matrix.kinds.tree_restart import RestartTreeStream, tree_restart
from fedsim.privacy.matrix.streaming import dense_fresh_noise, noise_stream
from fedsim.privacy.matrix.structure import tree_encoder
from fedsim.privacy.participation import Participation


def restarted(n, every, **spec):
    return build(Spec(kind="tree_restart", rounds=n, options=(("restart_every", every),), **spec))


@pytest.mark.parametrize(("n", "every"), [(8, 4), (10, 4), (7, 3), (5, 8), (6, 1), (16, 16)])
def test_b_c_is_the_prefix_sum_workload_and_c_the_block_diagonal_trees(n, every):
    f = restarted(n, every)
    np.testing.assert_array_equal(f.workload, np.tril(np.ones((n, n))))
    np.testing.assert_allclose(f.decoder @ f.encoder, f.workload, rtol=0, atol=1e-12)
    assert set(np.unique(f.encoder)) <= {0.0, 1.0} and set(np.unique(f.decoder)) <= {0.0, 1.0}
    row = 0
    for start in range(0, n, every):
        length = min(every, n - start)
        block = tree_encoder(length)
        rows = slice(row, row + block.shape[0])
        np.testing.assert_array_equal(f.encoder[rows, start : start + length], block)
        assert not f.encoder[rows, :start].any() and not f.encoder[rows, start + length :].any()
        row += block.shape[0]
    assert row == f.encoder.shape[0]
    assert f.kind == "tree_restart" and f.params == {"restart_every": every}
    assert kind("tree_restart").mismatch(f) is None


def test_one_block_is_the_binary_tree():
    f, tree = restarted(8, 8), binary_tree(8)
    np.testing.assert_array_equal(f.encoder, tree.encoder)
    np.testing.assert_array_equal(f.decoder, tree.decoder)
    assert restarted(8, 100).encoder.shape == tree.encoder.shape


def direct_sensitivity(C, n, min_sep, k):
    """max over every pattern of at most k rounds min_sep apart of ||sum_{j in pi} C[:, j]||
    (C is 0/1, so aligned unit gradients are the worst)."""
    best = 0.0
    for size in range(1, k + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in itertools.pairwise(pattern)):
                best = max(best, float(np.linalg.norm(C[:, list(pattern)].sum(axis=1))))
    return best


@pytest.mark.parametrize(
    ("n", "every", "min_sep", "k"),
    [(8, 4, 1, 1), (8, 4, 2, 3), (9, 4, 4, 2), (10, 3, 2, 4), (8, 8, 3, 2)],
)
def test_the_sensitivity_is_the_direct_maximum_over_patterns(n, every, min_sep, k):
    f = restarted(n, every, participations=k, min_sep=min_sep)
    participation = Participation.separated(min_sep, k)
    expected = direct_sensitivity(f.encoder, n, min_sep, k)
    sens = f.sensitivity(participation)
    assert sens.exact and sens.value == pytest.approx(expected, rel=1e-12)


def test_the_sensitivity_is_the_trees_of_one_block_and_adds_over_separate_blocks():
    single = restarted(16, 4).sensitivity().value
    assert single == pytest.approx(math.sqrt(3))  # floor(log2 4) + 1 nodes hold each round
    assert single < binary_tree(16).sensitivity().value
    f = restarted(16, 4, participations=4, min_sep=4)
    assert f.sensitivity(Participation.separated(4, 4)).value == pytest.approx(math.sqrt(4 * 3))


@pytest.mark.parametrize(("n", "every"), [(10, 4), (9, 3), (5, 8)])
def test_the_stream_is_the_decoded_node_noise_and_resumes(n, every):
    f = restarted(n, every)
    stream = noise_stream(f, np.random.default_rng, (2, 3))
    assert isinstance(stream, RestartTreeStream)
    y = np.stack([stream.next() for _ in range(n)])
    z = dense_fresh_noise(noise_stream(f, np.random.default_rng, (2, 3)))
    assert z.shape[0] == f.encoder.shape[0]
    gradient_noise = np.linalg.solve(f.workload, f.decoder)  # A^{-1} B
    np.testing.assert_allclose(np.einsum("tm,mij->tij", gradient_noise, z), y, atol=1e-12)
    half = noise_stream(f, np.random.default_rng, (2, 3))
    half.advance_to(n // 2 + 1)
    resumed = noise_stream(f, np.random.default_rng, (2, 3))
    resumed.restore(half.state())
    rest = np.stack([resumed.next() for _ in range(n // 2 + 1, n)])
    np.testing.assert_allclose(rest, y[n // 2 + 1 :], atol=1e-12)
    assert half.state_size() <= (math.floor(math.log2(every)) + 2) * 6


def test_a_file_saves_loads_and_is_refused_when_not_its_trees(tmp_path):
    spec = Spec(kind="tree_restart", rounds=12, options=(("restart_every", 4),))
    f, info = cached(spec, tmp_path / "r.npz")
    assert not info["cached"] and cached(spec, tmp_path / "r.npz")[1]["cached"]
    loaded = Factorization.load(tmp_path / "r.npz")
    assert loaded.params["restart_every"] == 4 and kind("tree_restart").mismatch(loaded) is None
    other = tree_restart(12, 3)
    wrong = Factorization("tree_restart", f.workload, other.encoder, other.decoder, f.params)
    assert "not the node matrix" in kind("tree_restart").mismatch(wrong)
    wrong.save(tmp_path / "w.npz")
    with pytest.raises(ConfigError, match="noise stream generates"):
        Factorization.load(tmp_path / "w.npz")
    no_option = Factorization("tree_restart", f.workload, f.encoder, f.decoder, {})
    assert "restart_every None" in kind("tree_restart").mismatch(no_option)


def test_the_option_is_required_and_checked_by_name():
    with pytest.raises(ConfigError) as err:
        build(Spec(kind="tree_restart", rounds=8))
    assert err.value.key == "kind_options.restart_every" and "required" in err.value.allowed
    with pytest.raises(ConfigError) as err:
        Spec(kind="tree_restart", rounds=8, options=(("restart_every", 0),))
    assert err.value.key == "kind_options.restart_every"
    with pytest.raises(ConfigError) as err:
        RestartTreeStream(8, 0, np.random.default_rng, 1)
    assert err.value.key == "restart_every"


def test_dmm_takes_it_as_the_0_1_integer_mechanism():
    assert "tree_restart" in dmm.tree_kinds() and "tree_restart" in dmm.kinds()
    f = restarted(8, 4, participations=2, min_sep=4)
    mechanism = dmm.IntegerMechanism(f, 0, Participation.separated(4, 2))
    assert mechanism.is_tree
    np.testing.assert_array_equal(mechanism.integer_matrix, f.encoder.astype(np.int64))
    np.testing.assert_allclose(mechanism.decoding @ mechanism.integer_matrix, np.eye(8), atol=1e-12)
    assert mechanism.sensitivity.value == pytest.approx(math.sqrt(2 * 3))
    assert list(mechanism.rounds) == [0, 1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 7, 7, 7]
    with pytest.raises(ValueError, match="already integer"):
        dmm.IntegerMechanism(f, 12)


def test_dmm_builds_it_from_its_options():
    from strategies.methods.dmm import from_options  # noqa: PLC0415

    options = {"clipping_norm": 1.0, "noise_multiplier": 1.0, "kind": "tree_restart"}
    strategy = from_options(
        {**options, "kind_options": {"restart_every": 2}},
        rounds=4,
        expected_clients=40,
        population=60,
        seed=1,
    )
    f = strategy.mechanism.factorization
    assert f.kind == "tree_restart" and f.params["restart_every"] == 2
    assert strategy.mechanism.is_tree and strategy.mechanism.fractional_bits == 0
    with pytest.raises(ConfigError) as err:
        from_options(options, rounds=4, expected_clients=40, population=60, seed=1)
    assert err.value.key == "strategy.options.kind_options.restart_every"
