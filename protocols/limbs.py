"""Limb plans for exact matrix products mod a Mersenne prime with float64 BLAS
(:meth:`protocols.field.MersenneField.matmul`): how to split the operands so that every sum of
limb products is an exact integer below 2^53, and the uint64 steps around the products."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

MAX_EXACT_FLOAT = 2**53
"""Every integer of magnitude up to 2^53 is exact in float64."""


class LimbPlan(NamedTuple):
    """How :meth:`MersenneField.matmul` splits its operands: the left one into ``left_limbs``
    limbs of ``left_bits`` bits, the right one into ``right_limbs`` of ``right_bits``, the inner
    dimension in chunks of ``chunk``; right_limbs * chunk * 2^(left_bits + right_bits) <= 2^53."""

    left_bits: int
    left_limbs: int
    right_bits: int
    right_limbs: int
    chunk: int


@lru_cache(maxsize=512)
def limb_plan(exponent: int, inner: int, rows: int = 1, columns: int = 1) -> LimbPlan:
    """The cheapest exact plan for a (rows, inner) @ (inner, columns) product, by a cost per
    output column: about 8 passes over rows * left_limbs words to rotate and fold, 3 over
    inner * right_limbs to split, and the float products; the left operand's preparation is
    spread over the columns."""
    inner = max(inner, 1)
    best, best_cost = None, math.inf
    for left_limbs in range(1, min(8, exponent) + 1):  # left_limbs * p < 2^64: the sum fits
        left_bits = -(-exponent // left_limbs)
        for right_limbs in range(1, min(8, exponent) + 1):
            right_bits = -(-exponent // right_limbs)
            if right_limbs * inner << (left_bits + right_bits) > MAX_EXACT_FLOAT:
                continue
            products = left_limbs * right_limbs * rows * inner
            cost = 8 * left_limbs * rows + 3 * right_limbs * inner + products / 16
            cost += 2 * products / max(columns, 1)
            if cost < best_cost:
                best = LimbPlan(left_bits, left_limbs, right_bits, right_limbs, inner)
                best_cost = cost
    if best is not None:
        return best
    limbs = -(-exponent // 8)
    return LimbPlan(8, limbs, 8, limbs, min(inner, MAX_EXACT_FLOAT // (limbs << 16)))


def rotate_into(
    values: np.ndarray, shift: int, exponent: int, modulus: np.uint64, scratch: np.ndarray
) -> None:
    """In place: values (each < p = 2^e - 1) times 2^shift mod p, as an e-bit rotation."""
    if shift == 0:
        return
    np.left_shift(values, np.uint64(shift), out=scratch)
    np.bitwise_and(scratch, modulus, out=scratch)
    np.right_shift(values, np.uint64(exponent - shift), out=values)
    np.bitwise_or(values, scratch, out=values)


def split_limbs(matrix: np.ndarray, plan: LimbPlan) -> np.ndarray:
    """The right operand's limbs (lowest first) of a non-negative int64 matrix, stacked as one
    (right_limbs * rows, columns) float64 matrix."""
    rows = matrix.shape[0]
    out = np.empty((plan.right_limbs * rows, matrix.shape[1]))
    limb = np.empty(matrix.shape, dtype=np.int64)
    mask = (1 << plan.right_bits) - 1
    for j in range(plan.right_limbs):
        np.right_shift(matrix, plan.right_bits * j, out=limb)
        np.bitwise_and(limb, mask, out=limb)
        out[j * rows : (j + 1) * rows] = limb
    return out


def fold_mersenne(
    values: np.ndarray, exponent: int, modulus: np.uint64, scratch: np.ndarray
) -> None:
    """In place: uint64 ``values`` v -> (v mod 2^e) + (v >> e), the same residue mod
    p = 2^e - 1 (2^e = 1 mod p) and at most p + (v >> e); ``scratch`` as ``values``."""
    np.right_shift(values, np.uint64(exponent), out=scratch)
    np.bitwise_and(values, modulus, out=values)
    values += scratch


def subtract_once(values: np.ndarray, modulus: np.uint64, scratch: np.ndarray) -> None:
    """In place: uint64 ``values`` below 2 * modulus reduced to [0, modulus), as
    min(v, v - modulus) (the difference wraps past every v < modulus); ``scratch`` is a
    uint64 array of the same shape."""
    np.subtract(values, modulus, out=scratch)
    np.minimum(values, scratch, out=values)


class MersenneSum:
    """The sum mod p = 2^e - 1 of uint64 arrays of one ``shape`` with entries in [0, p] (p
    standing for 0), added one by one: a bound on the running sum is tracked and the sum folded
    (:func:`fold_mersenne`) only when one more term could overflow uint64, so each term costs
    one addition and no term is kept."""

    def __init__(self, exponent: int, shape) -> None:
        self.exponent = int(exponent)
        self.modulus = (1 << self.exponent) - 1
        self._total = np.zeros(shape, dtype=np.uint64)
        self.shape = self._total.shape
        self._scratch = np.empty_like(self._total)
        self._bound = 0  # the running sum is at most this

    def add(self, term: np.ndarray) -> None:
        if self._bound + self.modulus > 2**64 - 1:
            self._fold()
        self._total += term
        self._bound += self.modulus

    def _fold(self) -> None:
        fold_mersenne(self._total, self.exponent, np.uint64(self.modulus), self._scratch)
        self._bound = self.modulus + (self._bound >> self.exponent)

    def value(self) -> np.ndarray:
        """The sum in [0, p) (uint64)."""
        while self._bound >= 2 * self.modulus:
            self._fold()
        subtract_once(self._total, np.uint64(self.modulus), self._scratch)
        self._bound = self.modulus - 1
        return self._total


def lagrange_small(nodes: list[int], targets: list[int], modulus: int) -> np.ndarray:
    """:meth:`protocols.field.MersenneField.lagrange_coefficients` for a small system, in
    exact Python integers (numpy's per-call overhead dominates a decoding's few points), by
    the same prefix and suffix products: L[i, j] = prod_{l != j} (z_i - x_l) / (x_j - x_l)."""
    p, count = modulus, len(nodes)
    inverse_weights = []
    for j, node in enumerate(nodes):
        weight = 1
        for other in nodes[:j] + nodes[j + 1 :]:
            weight = weight * (node - other) % p
        inverse_weights.append(pow(weight, -1, p))
    rows = []
    for target in targets:
        differences = [(target - node) % p for node in nodes]
        prefix = [1]
        for difference in differences[:-1]:
            prefix.append(prefix[-1] * difference % p)
        row, suffix = [0] * count, 1
        for j in range(count - 1, -1, -1):
            row[j] = prefix[j] * suffix % p * inverse_weights[j] % p
            suffix = suffix * differences[j] % p
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(len(targets), count)
