"""The prime-field arithmetic against Python integers on edge values and random ones, and
garbage against its input checks (port of ../shared/attacks/field_fuzz.py, which passed; this
keeps it passing)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from protocols.field import MersenneField
from protocols.limbs import limb_plan

F = MersenneField(61)
P = F.modulus
EDGES = np.array(
    [0, 1, 2, P - 1, P - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**60, 2**61 - 2]
    + [(P - 1) // 2, (P + 1) // 2, 2**31, 3],
    dtype=np.int64,
)


def test_mul_and_inv_match_python_integers():
    rng = np.random.default_rng(1)
    a = np.concatenate([EDGES, rng.integers(0, P, 200_000, dtype=np.int64)])
    b = np.concatenate([EDGES[::-1], rng.integers(0, P, 200_000, dtype=np.int64)])
    got = F.mul(a, b).tolist()
    assert got == [(x * y) % P for x, y in zip(a.tolist(), b.tolist())]
    grid_a, grid_b = (g.ravel() for g in np.meshgrid(EDGES, EDGES))
    got = F.mul(grid_a, grid_b).tolist()
    assert got == [(x * y) % P for x, y in zip(grid_a.tolist(), grid_b.tolist())]
    inverses = F.inv(EDGES[1:]).tolist()
    assert all((x * y) % P == 1 for x, y in zip(EDGES[1:].tolist(), inverses))


@pytest.mark.parametrize(
    "rows, inner, columns",
    [(3, 1, 4), (5, 7, 3), (2, 100_000, 3), (1, 300_000, 1), (40, 64, 17_000)],
)
@pytest.mark.parametrize("fill", ["max", "random"])
def test_matmul_matches_python_integers_at_every_limb_plan(rows, inner, columns, fill):
    rng = np.random.default_rng(rows * inner + columns)
    if fill == "max":
        left = np.full((rows, inner), P - 1, dtype=np.int64)
        right = np.full((inner, columns), P - 1, dtype=np.int64)
    else:
        left = rng.integers(0, P, (rows, inner), dtype=np.int64)
        right = rng.integers(0, P, (inner, columns), dtype=np.int64)
    got = F.matmul(left, right)
    if rows * inner * columns > 3e6:  # spot checks, the plan is the one of the whole product
        cells = [(0, 0), (rows - 1, columns - 1), (rows // 2, columns // 2)]
        for i, j in cells:
            assert (
                int(got[i, j])
                == sum(int(x) * int(y) for x, y in zip(left[i].tolist(), right[:, j].tolist())) % P
            ), limb_plan(61, inner, rows, columns)
    else:
        expected = (left.astype(object) @ right.astype(object)) % P
        assert np.array_equal(expected, got.astype(object)), limb_plan(61, inner, rows, columns)


def test_sums_and_signed_encodings_at_the_edges():
    assert int(F.sum(np.full(10**6, P - 1, dtype=np.int64))) == (10**6 * (P - 1)) % P
    signed = np.array([-(P - 1) // 2, (P - 1) // 2, -1, 0], dtype=np.int64)
    assert np.array_equal(F.decode_signed(F.encode_signed(signed)), signed)
    for bad in ([(P - 1) // 2 + 1], [-(2**63)], np.array([2**63], dtype=np.uint64)):
        with pytest.raises(ValueError):
            F.encode_signed(np.array(bad))
    with pytest.raises(ValueError, match="outside"):
        F.asarray(np.array([2**63 + 5], dtype=np.uint64))
    edge = np.array([2.0**60 / 2**12 - 0.5, -(2.0**60 / 2**12)])
    with pytest.raises(ValueError, match="fractional_bits=12 exceeds"):
        F.encode_fixed(edge, 12)
    inside = np.array([2.0**60 / 2**12 - 1, -(2.0**60 / 2**12) + 1])
    assert np.array_equal(F.decode_fixed(F.encode_fixed(inside, 12), 12), inside)


def test_solve_matches_brute_force_in_a_small_field():
    """Every solution set of random small systems over F_7, by enumeration."""
    field = MersenneField(3)
    rng = np.random.default_rng(5)
    for _ in range(300):
        rows, columns = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        matrix = field.random(rng, (rows, columns))
        rhs = field.random(rng, rows)
        candidates = np.array(np.meshgrid(*[range(7)] * columns)).reshape(columns, -1)
        solvable = (field.matmul(matrix, candidates) == rhs[:, None]).all(axis=0).any()
        solution = field.solve(matrix, rhs)
        assert (solution is not None) == solvable
        if solution is not None:
            assert (field.matmul(matrix, solution) == rhs).all()


GARBAGE = [
    "12",
    b"\x01\x02",
    1.5,
    np.array([1.0, 2.0]),
    np.array([1 + 2j]),
    np.array(["1"]),
    np.array([None, 3], dtype=object),
    np.array([3, "4"], dtype=object),
    np.array([2.0, 3], dtype=object),
    np.array([True, 2], dtype=object),
    np.array([P], dtype=np.int64),
    np.array([-1], dtype=np.int64),
    np.array([P + 7], dtype=object),
    np.array([2**64], dtype=object),
    np.array([2**64 - 1], dtype=np.uint64),
    [[1, 2], [3]],
    {"a": 1},
    None,
    np.datetime64("2026-01-01"),
]


def test_fuzzed_field_inputs_are_refused_with_value_errors(capsys):
    """Strings, bytes, floats, complex, objects, out-of-range integers (numpy and Python),
    ragged lists: asarray and every operation that takes elements refuse them with a
    ValueError naming the argument, and never turn them into field elements."""
    tally = Counter()
    rng = np.random.default_rng(9)
    candidates = GARBAGE + [rng.integers(-(2**62), 2**62, 5) for _ in range(10)]
    candidates += [rng.integers(0, P, 5) for _ in range(10)] + [list(EDGES)]
    for value in candidates:
        for name, call in (
            ("asarray", lambda v: F.asarray(v, "x")),
            ("add", lambda v: F.add(v, 1)),
            ("mul", lambda v: F.mul(1, v)),
            ("matmul", lambda v: F.matmul(np.ones((1, np.size(v)), dtype=np.int64), v)),
            ("vector", lambda v: F.vector(v, np.size(v), "x")),
        ):
            tally["tried"] += 1
            try:
                out = call(value)
            except ValueError:
                tally["refused"] += 1
                continue
            as_ints = np.asarray(value).ravel().tolist()  # accepted: genuine elements only
            assert all(type(v) is int and 0 <= v < P for v in as_ints), (name, value)
            assert out.dtype == np.int64
            tally["accepted"] += 1
    with capsys.disabled():
        print(f"\n[fuzz field inputs] {dict(tally)}")
    assert tally["refused"] > len(GARBAGE) * 4
