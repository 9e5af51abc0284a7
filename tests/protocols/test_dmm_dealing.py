"""The DMM client's dealing is exact: shares, pads and masked rows equal a direct evaluation in
Python integers of the share polynomials at the seats' points, with the client's randomness
drawn in the same order (segment by segment, then one pad seed per seat), at edge values too."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from protocols.channels import Endpoint, new_session_id
from protocols.dmm.client import (
    ShareFold,
    fold_pad,
    low_bits_mod_p,
    mask_client_shares,
    share_segments,
    sharing_inputs,
)
from protocols.dmm.common import PROTOCOL, RoundKeys
from protocols.field import MersenneField
from protocols.kit import SEAT_ID_BASE
from protocols.limbs import LimbPlan, limb_plan
from protocols.shamir import PackedShamir

F = MersenneField(61)
P = F.modulus


def _lagrange_at(nodes: list[int], values: list[int], x: int, p: int) -> int:
    """The polynomial of degree < len(nodes) through (nodes, values), at x (mod p)."""
    total = 0
    for j, (xj, yj) in enumerate(zip(nodes, values)):
        num, den = 1, 1
        for m, xm in enumerate(nodes):
            if m != j:
                num, den = num * (x - xm) % p, den * (xj - xm) % p
        total += yj * num * pow(den, p - 2, p)
    return total % p


def _reference_shares(scheme: PackedShamir, segments, rng) -> np.ndarray:
    """Shares of each block's polynomial (secrets at 0, -1, .., -(k-1); the t random values,
    drawn per segment as (t, blocks), at 1..t) evaluated at every seat's point 1..n."""
    p, k, t = scheme.field.modulus, scheme.k, scheme.t
    nodes = [(-i) % p for i in range(k)] + list(range(1, t + 1))
    columns = []
    for segment in segments:
        values = [int(v) % p for v in np.asarray(segment).ravel()]
        blocks = -(-len(values) // k)
        values += [0] * (blocks * k - len(values))
        randomness = rng.integers(0, p, size=(t, blocks), dtype=np.int64)
        for b in range(blocks):
            known = values[b * k : (b + 1) * k] + [int(r) for r in randomness[:, b]]
            columns.append([_lagrange_at(nodes, known, j, p) for j in range(1, scheme.n + 1)])
    return np.array(columns, dtype=np.int64).T.reshape(scheme.n, -1)


def _rng() -> np.random.Generator:
    return np.random.default_rng([77, 1])


def _edge_segments(rng, dim: int, rows: int) -> list[np.ndarray]:
    half = (P - 1) // 2
    update = rng.integers(-half, half + 1, dim, dtype=np.int64)
    update[: min(dim, 4)] = [0, half, -half, -1][: min(dim, 4)]
    noise = [rng.integers(-(2**20), 2**20, dim, dtype=np.int64) for _ in range(rows)]
    return [update, *noise]


@pytest.mark.parametrize("n, t, k", [(20, 3, 3), (7, 2, 3), (5, 1, 1), (9, 3, 4)])
@pytest.mark.parametrize("dim, rows", [(1, 0), (10, 2), (31, 1)])
def test_shares_equal_the_polynomials_evaluated_at_the_seats(n, t, k, dim, rows):
    scheme = PackedShamir(n, t, k)
    segments = _edge_segments(np.random.default_rng([n, dim]), dim, rows)
    got = share_segments(scheme, segments, np.random.default_rng([n, dim, 1]))
    expected = _reference_shares(scheme, segments, np.random.default_rng([n, dim, 1]))
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    secrets, randomness = sharing_inputs(scheme, segments, np.random.default_rng([n, dim, 1]))
    columns = (1 + rows) * scheme.blocks_for(dim)
    assert secrets.shape == (k, columns) and randomness.shape == (t, columns)
    assert np.array_equal(F.matmul(scheme.share_matrix, np.vstack([secrets, randomness])), got)


def test_segments_of_unequal_lengths_draw_their_randomness_segment_by_segment():
    scheme = PackedShamir(7, 2, 3)
    segments = [np.arange(-5, 5), np.array([3, -4]), np.arange(7)]
    got = share_segments(scheme, segments, np.random.default_rng(4))
    assert np.array_equal(got, _reference_shares(scheme, segments, np.random.default_rng(4)))
    with pytest.raises(ValueError, match="segments is empty"):
        share_segments(scheme, [], np.random.default_rng(4))


def test_dealing_is_exact_at_zero_and_p_minus_1_in_every_input():
    """Whole input matrices of 0 and p - 1 (and mixed): the share matrix times them, against
    Python integers."""
    scheme = PackedShamir(20, 3, 3)
    rng = np.random.default_rng(3)
    width = 5000
    for fill in (0, P - 1, None):
        if fill is None:
            inputs = rng.choice(np.array([0, 1, P - 1, P - 2, 2**60, 2**31]), (6, width))
        else:
            inputs = np.full((6, width), fill, dtype=np.int64)
        got = F.matmul(scheme.share_matrix, inputs)
        expected = (scheme.share_matrix.astype(object) @ inputs.astype(object)) % P
        assert np.array_equal(got.astype(object), expected)


@pytest.mark.parametrize("exponent", [2, 3, 5, 13, 31, 61])
@pytest.mark.parametrize(
    "rows, inner, columns", [(20, 6, 9000), (1, 1, 1), (6, 20, 50), (2, 0, 3), (3, 4, 0)]
)
def test_matmul_against_python_integers_in_every_field(exponent, rows, inner, columns):
    field = MersenneField(exponent)
    p = field.modulus
    rng = np.random.default_rng(exponent + rows + inner)
    left = rng.integers(0, p, (rows, inner), dtype=np.int64)
    right = rng.integers(0, p, (inner, columns), dtype=np.int64)
    if inner and columns:
        left[0, 0], right[0, 0], right[-1, -1] = p - 1, p - 1, 0
    expected = (
        (left.astype(object) @ right.astype(object)) % p if inner else np.zeros((rows, columns))
    )
    assert np.array_equal(field.matmul(left, right).astype(object), expected)


def test_every_limb_plan_and_chunk_gives_the_same_product():
    """Plans other than the chosen one (fewer or more limbs, the inner dimension in chunks)
    give the same exact product: the plan changes the arithmetic, never the result."""
    rng = np.random.default_rng(11)
    left = rng.integers(0, P, (4, 40), dtype=np.int64)
    right = rng.integers(0, P, (40, 70), dtype=np.int64)
    left[0], right[:, 0] = P - 1, P - 1
    expected = (left.astype(object) @ right.astype(object)) % P
    plans = [limb_plan(61, 40, 4, 70), LimbPlan(31, 2, 16, 4, 7), LimbPlan(21, 3, 21, 3, 13)]
    plans += [LimbPlan(8, 8, 8, 8, 1), LimbPlan(16, 4, 31, 2, 20)]
    for plan in plans:
        assert plan.right_limbs * plan.chunk << (plan.left_bits + plan.right_bits) <= 2**53
        assert np.array_equal(F._matmul_2d(left, right, plan).astype(object), expected), plan


def test_pads_are_the_aes_ctr_words_low_bits_mod_p():
    seed = bytes(range(32))
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * 300)), dtype="<u8").tolist()
    assert fold_pad(F, seed, 300).tolist() == [(w & P) % P for w in words]
    edges = [0, 1, P - 1, P, P + 1, 2**61, 2**62 + P, 2**64 - 1]
    got = low_bits_mod_p(F, np.array(edges, dtype=np.uint64))
    assert got.dtype == np.int64 and got.tolist() == [(w & P) % P for w in edges]


@pytest.mark.parametrize("offline", [(), (4, 11)])
def test_masked_rows_are_shares_plus_each_seats_pad(offline):
    """Seat j's masked row is its share plus the pad of the j-th seed the client draws after
    its share randomness (seats in ascending order); seats offline get no pad."""
    session = new_session_id()
    seats = [j for j in range(20) if j not in offline]
    keys = RoundKeys(
        round=2, step=1, rows=1, n=20, t=3, k=3, field_exponent=61, dim=40,
        session_id=session,
        member_keys={j: Endpoint(SEAT_ID_BASE + j, session, protocol=PROTOCOL).public_key
                     for j in seats},
    )  # fmt: skip
    segments = _edge_segments(np.random.default_rng(8), 40, 1)
    masked = mask_client_shares(keys, 5, segments[0], np.stack(segments[1:]), _rng(), bytes(32))
    reference_rng = _rng()
    expected = _reference_shares(keys.scheme(), segments, reference_rng).astype(object)
    for j in seats:
        pad = fold_pad(F, reference_rng.bytes(32), keys.width).astype(object)
        expected[j] = (expected[j] + pad) % P
    assert np.array_equal(masked.rows.astype(object), expected)
    assert sorted(masked.client.pads) == seats
    # dealt into a given array (a reply's payload): the same rows, written over what it held
    out = np.full((20, keys.width), -1, dtype=np.int64)
    inputs = (keys, 5, segments[0], np.stack(segments[1:]))
    again = mask_client_shares(*inputs, _rng(), bytes(32), out=out)
    assert again.rows is out and np.array_equal(out, masked.rows)
    for wrong in (np.empty((20, keys.width), np.uint64), np.empty((19, keys.width), np.int64)):
        with pytest.raises(ValueError, match="allowed: a C-contiguous int64 array of shape"):
            mask_client_shares(*inputs, _rng(), bytes(32), out=wrong)


def test_a_fold_deals_the_sum_of_its_parties_inputs():
    keys = RoundKeys(
        round=1, step=0, rows=2, n=7, t=2, k=3, field_exponent=61, dim=11,
        session_id=None, member_keys={j: b"" for j in range(7)},
    )  # fmt: skip
    fold, total = ShareFold(keys), np.zeros((7, keys.width), dtype=object)
    for c in range(3):
        segments = _edge_segments(np.random.default_rng(c), 11, 2)
        segments[0] //= 4  # three summed updates stay within (p - 1) / 2
        _, randomness = sharing_inputs(keys.scheme(), segments, np.random.default_rng([c, 9]))
        fold.add(segments[0], np.stack(segments[1:]), randomness)
        reference = _reference_shares(keys.scheme(), segments, np.random.default_rng([c, 9]))
        total = (total + reference.astype(object)) % P
    assert np.array_equal(fold.shares().astype(object), total)
