"""protocols.field: every operation against Python big-integer arithmetic, edge cases 0 and p-1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.field import DEFAULT_FIELD, MERSENNE_EXPONENTS, MersenneField

FIELDS = [MersenneField(e) for e in (5, 13, 31, 61)]


def _samples(field: MersenneField, size: int, seed: int) -> np.ndarray:
    """Random elements with the edge cases 0, 1, p-2, p-1 and values near 2^32 included."""
    values = field.random(np.random.default_rng(seed), size)
    p = field.modulus
    edges = [0, 1, p - 2, p - 1] + [v % p for v in (2**32 - 1, 2**32, 2**31, 2**29 + 3)]
    values[: len(edges)] = edges
    return values


def _ints(values) -> list[int]:
    return [int(v) for v in np.ravel(values)]


@pytest.mark.parametrize("field", FIELDS, ids=repr)
def test_elementwise_ops_match_big_integers(field):
    p = field.modulus
    a = _samples(field, 600, seed=1)
    b = np.random.default_rng(2).permutation(_samples(field, 600, seed=3))
    pairs = list(zip(_ints(a), _ints(b)))
    assert _ints(field.add(a, b)) == [(x + y) % p for x, y in pairs]
    assert _ints(field.sub(a, b)) == [(x - y) % p for x, y in pairs]
    assert _ints(field.neg(a)) == [(-x) % p for x in _ints(a)]
    assert _ints(field.mul(a, b)) == [(x * y) % p for x, y in pairs]
    assert _ints(field.mul(a, p - 1)) == [(x * (p - 1)) % p for x in _ints(a)]
    assert _ints(field.pow(a, 5)) == [pow(x, 5, p) for x in _ints(a)]
    assert _ints(field.mul_pow2(a, 37)) == [(x << 37) % p for x in _ints(a)]
    assert int(field.sum(a)) == sum(_ints(a)) % p


@pytest.mark.parametrize("field", FIELDS, ids=repr)
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 40])
def test_sum_rows_is_the_big_integer_sum_of_each_entry(field, count):
    """sum_rows folds only before uint64 could overflow (every 7 terms at e = 61): each entry
    equals the big-integer sum mod p, with rows of p - 1 everywhere (the largest bound)."""
    p = field.modulus
    rows = [_samples(field, 60, seed=10 + i).reshape(3, 20) for i in range(count)]
    for row in rows[::2]:
        row[:, :5] = p - 1
    total = field.sum_rows(iter(rows), (3, 20))
    assert total.dtype == np.int64 and total.shape == (3, 20)
    expected = [sum(int(r.ravel()[i]) for r in rows) % p for i in range(60)]
    assert _ints(total) == expected


def test_sum_rows_refuses_a_wrong_shape_or_a_value_outside_the_field():
    field = DEFAULT_FIELD
    good = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"rows\[1\] has shape \(4, 2\); allowed: \(2, 4\)"):
        field.sum_rows([good, good.reshape(4, 2)], (2, 4))
    bad = good.copy()
    bad[0, 0] = field.modulus
    with pytest.raises(ValueError, match=r"rows\[0\] has entry .* outside \[0, p\)"):
        field.sum_rows([bad], (2, 4))


def test_every_product_in_a_small_field():
    field = MersenneField(7)
    p = field.modulus
    grid_a, grid_b = np.meshgrid(np.arange(p), np.arange(p), indexing="ij")
    expected = (grid_a.astype(object) * grid_b.astype(object)) % p
    assert (field.mul(grid_a, grid_b) == expected.astype(np.int64)).all()


@pytest.mark.parametrize("field", FIELDS, ids=repr)
@pytest.mark.parametrize("size", [400, 64, 17, 1])  # the batch path and the small-batch path
def test_batch_inverse(field, size):
    a = _samples(field, max(size, 8), seed=4)[:size]
    a[a == 0] = field.modulus - 1
    if size > 1:
        a[:2] = [1, field.modulus - 1]
    inverse = field.inv(a)
    assert inverse.dtype == np.int64 and inverse.shape == a.shape
    assert (field.mul(a, inverse) == 1).all()
    assert _ints(inverse) == [pow(x, -1, field.modulus) for x in _ints(a)]
    square = field.inv(a[: (size // 4) * 4].reshape(-1, 4)) if size >= 4 else inverse
    assert square.shape == ((size // 4, 4) if size >= 4 else a.shape)
    for bad in (np.array([3, 0, 5]), np.zeros(100, dtype=np.int64)):
        with pytest.raises(ValueError, match="zero entries"):
            field.inv(bad)


@pytest.mark.parametrize("field", FIELDS, ids=repr)
@pytest.mark.parametrize("inner", [0, 1, 7, 300])
def test_matmul_matches_big_integers(field, inner):
    rng = np.random.default_rng(inner)
    p = field.modulus
    left = field.random(rng, (5, inner))
    right = field.random(rng, (inner, 6))
    if inner:
        left[0] = p - 1
        right[:, 0] = p - 1
    expected = [
        [sum(int(left[i, k]) * int(right[k, j]) for k in range(inner)) % p for j in range(6)]
        for i in range(5)
    ]
    assert field.matmul(left, right).tolist() == expected
    out = np.full((7, 6), 5, dtype=np.int64)  # rows 1..5 of a larger array, stale values in it
    field.matmul(left, right, out=out[1:6])
    assert out[1:6].tolist() == expected and out[0].tolist() == out[6].tolist() == [5] * 6
    if inner:
        vector = right[:, 1]
        assert field.matmul(left, vector).tolist() == [row[1] for row in expected]


def test_matmul_out_must_be_the_products_contiguous_int64_array():
    field = DEFAULT_FIELD
    left, right = np.ones((2, 3), dtype=np.int64), np.ones((3, 4), dtype=np.int64)
    for bad in (np.empty((2, 5), dtype=np.int64), np.empty((2, 4)), np.empty((4, 2), np.int64).T):
        with pytest.raises(ValueError, match=r"out has shape .*allowed: a C-contiguous int64"):
            field.matmul(left, right, out=bad)
    with pytest.raises(ValueError, match="out has shape"):
        field.matmul(left, right[:, 0], out=np.empty((2, 1), dtype=np.int64))


def test_matmul_long_inner_dimension_is_chunked_exactly():
    field = DEFAULT_FIELD
    p = field.modulus
    left = np.full((2, 40_000), p - 1, dtype=np.int64)
    right = np.full((40_000, 3), p - 1, dtype=np.int64)
    expected = (40_000 * (p - 1) * (p - 1)) % p
    assert (field.matmul(left, right) == expected).all()


@pytest.mark.parametrize("field", FIELDS, ids=repr)
def test_lagrange_interpolation_recovers_polynomial(field):
    rng = np.random.default_rng(7)
    p = field.modulus
    degree = 3 if p < 100 else 6
    coefficients = field.random(rng, (degree + 1, 4))
    nodes = rng.choice(p, size=degree + 1, replace=False)
    targets = np.array([0, p - 1, int(nodes[2])])
    values = field.evaluate(coefficients, nodes)
    expected = field.evaluate(coefficients, targets)
    assert (field.interpolate(nodes, values, targets) == expected).all()
    unit_row = field.lagrange_coefficients(nodes, [int(nodes[2])])[0]
    assert unit_row.tolist() == [1 if j == 2 else 0 for j in range(degree + 1)]
    # each basis polynomial sums to 1 at any target (interpolating the constant 1)
    assert (field.sum(field.lagrange_coefficients(nodes, targets), axis=1) == 1).all()
    with pytest.raises(ValueError, match="distinct"):
        field.lagrange_coefficients([1, 2, 1], [0])


@pytest.mark.parametrize("field", FIELDS, ids=repr)
@pytest.mark.parametrize(("count", "targets"), [(1, 1), (9, 7), (6, 20), (4, 300), (12, 90)])
def test_lagrange_coefficients_match_the_definition_in_big_integers(field, count, targets):
    """Small systems (computed in Python integers) and large ones (vectorised) alike:
    L[i, j] = prod_{l != j} (z_i - x_l) / (x_j - x_l) mod p, with targets at 0, p - 1 and at
    the nodes themselves (unit rows)."""
    p = field.modulus
    rng = np.random.default_rng([count, targets, field.exponent])
    nodes = rng.choice(min(p, 2**40), size=count, replace=False).astype(np.int64) % p
    points = field.random(rng, targets)
    points[:3] = [0, p - 1, int(nodes[0])][: min(3, targets)]
    got = field.lagrange_coefficients(nodes, points)
    x, z = _ints(nodes), _ints(points)
    for i, zi in enumerate(z):
        for j, xj in enumerate(x):
            others = x[:j] + x[j + 1 :]
            numerator = math.prod(zi - xl for xl in others) % p
            denominator = math.prod(xj - xl for xl in others) % p
            assert int(got[i, j]) == numerator * pow(denominator, -1, p) % p
    assert got.dtype == np.int64 and got.shape == (targets, count)


def test_evaluate_against_horner_with_big_integers():
    field = DEFAULT_FIELD
    p = field.modulus
    rng = np.random.default_rng(8)
    coefficients = _samples(field, 9, seed=9)
    points = _samples(field, 50, seed=10)
    expected = []
    for x in _ints(points):
        acc = 0
        for c in reversed(_ints(coefficients)):
            acc = (acc * x + c) % p
        expected.append(acc)
    assert _ints(field.evaluate(coefficients, points)) == expected
    assert field.vandermonde(rng.integers(0, p, 3), 4)[:, 0].tolist() == [1, 1, 1]


def test_signed_encoding_roundtrip_and_limits():
    field = DEFAULT_FIELD
    half = field.max_signed
    values = np.array([0, 1, -1, half, -half, 12345, -98765], dtype=np.int64)
    encoded = field.encode_signed(values)
    assert encoded.tolist()[:3] == [0, 1, field.modulus - 1]
    assert (field.decode_signed(encoded) == values).all()
    # sums of encodings decode to the integer sum while it stays within range
    total = field.sum(field.encode_signed(np.array([-5, 3, -7, 2])))
    assert int(field.decode_signed(total)) == -7
    with pytest.raises(ValueError, match=r"integers has entry .* outside"):
        field.encode_signed(np.array([half + 1]))


def test_fixed_point_roundtrip_with_negative_values():
    field = DEFAULT_FIELD
    rng = np.random.default_rng(11)
    values = rng.normal(scale=100.0, size=1000)
    values[:4] = [-0.0, -1.5, -1e-9, 2.0**40]
    bits = 16
    decoded = field.decode_fixed(field.encode_fixed(values, bits), bits)
    assert np.max(np.abs(decoded - values)) <= 2.0 ** -(bits + 1)
    assert decoded[1] == -1.5
    encoded_sum = field.sum(field.encode_fixed(values[4:], bits))
    assert abs(field.decode_fixed(encoded_sum, bits) - values[4:].sum()) < 996 * 2.0**-bits
    with pytest.raises(ValueError, match="fractional_bits=16"):
        field.encode_fixed(np.array([2.0**50]), bits)
    with pytest.raises(ValueError, match="finite"):
        field.encode_fixed(np.array([np.nan]), bits)
    with pytest.raises(ValueError, match="fractional_bits must be"):
        field.encode_fixed(values, 70)


def test_sum_headroom_bits():
    field = DEFAULT_FIELD
    headroom = field.sum_headroom_bits(1000, 2**40, noise_bound=2**45)
    assert headroom == pytest.approx(math.log2(field.max_signed / (1000 * 2**40 + 2**45)))
    assert headroom > 0
    small = MersenneField(13)  # (p-1)/2 = 4095
    assert small.sum_headroom_bits(4095, 1) == 0.0
    with pytest.raises(ValueError, match=r"n_summands=4096 .*magnitude_bound"):
        small.sum_headroom_bits(4096, 1)
    with pytest.raises(ValueError, match="noise_bound"):
        small.sum_headroom_bits(1, 1, noise_bound=-1)
    with pytest.raises(ValueError, match="n_summands"):
        small.sum_headroom_bits(0, 1)


def test_inputs_out_of_range_are_named():
    field = DEFAULT_FIELD
    with pytest.raises(ValueError, match=r"^b has entry -1 outside"):
        field.add(np.array([1]), np.array([-1]))
    with pytest.raises(ValueError, match=r"^a has entry .* outside"):
        field.mul(np.array([field.modulus]), 1)
    with pytest.raises(ValueError, match="must hold integers"):
        field.add(np.array([1.5]), 1)
    with pytest.raises(ValueError, match="exponent=11"):
        MersenneField(11)
    assert set(MERSENNE_EXPONENTS) >= {31, 61}


@pytest.mark.parametrize("exponent", MERSENNE_EXPONENTS)
def test_the_range_check_refuses_each_end_and_keeps_the_edges(exponent):
    field = MersenneField(exponent)
    p = field.modulus
    edges = np.array([0, p - 1, p // 2], dtype=np.int64)
    assert field.asarray(edges, "v").tolist() == edges.tolist()
    for bad in (-1, p, np.iinfo(np.int64).min, np.iinfo(np.int64).max, -(2**62)):
        with pytest.raises(ValueError, match=rf"^v has entry {bad} outside \[0, p\)"):
            field.asarray(np.array([1, bad, 0], dtype=np.int64), "v")
    low_and_high = np.array([-5, p + 3], dtype=np.int64)  # the low end is named first
    with pytest.raises(ValueError, match=r"^v has entry -5 outside"):
        field.asarray(low_and_high, "v")


def test_random_secure_is_in_range_and_varies():
    field = MersenneField(5)
    draws = field.random_secure(4000)
    assert draws.min() >= 0 and draws.max() < field.modulus
    assert np.unique(draws).size == field.modulus  # every value of F_31 appears
    big = DEFAULT_FIELD.random_secure((3, 4))
    assert big.shape == (3, 4) and (big < DEFAULT_FIELD.modulus).all()


def test_reduce_div_and_prod():
    field = MersenneField(31)
    p = field.modulus
    raw = np.array([-1, -p, p, 2 * p + 5, 2**62], dtype=np.int64)
    assert field.reduce(raw).tolist() == [int(v) % p for v in raw]
    assert field.reduce(np.array([2**64 - 1], dtype=np.uint64)).tolist() == [(2**64 - 1) % p]
    assert field.reduce(np.array([2**70, -(2**70)], dtype=object)).tolist() == [
        2**70 % p,
        -(2**70) % p,
    ]
    a = _samples(field, 50, seed=12)
    b = _samples(field, 50, seed=13)
    b[b == 0] = 1
    assert (field.mul(field.div(a, b), b) == a).all()
    assert int(field.prod(b)) == math.prod(_ints(b)) % p
