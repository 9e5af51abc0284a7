"""Vectorised arithmetic in a Mersenne prime field F_p, p = 2^e - 1, on numpy int64 arrays.

Elements are numpy ``int64`` arrays holding canonical representatives in ``[0, p)``.

Choice of modulus. The default field is F_p with p = 2^61 - 1 (a Mersenne prime):

* Headroom. Signed values are represented by centered representatives in
  ``[-(p-1)/2, (p-1)/2] = [-(2^60 - 1), 2^60 - 1]``: 60 bits of magnitude. A round of the
  distributed matrix mechanism releases ``2^f * U_t + w_t`` (dmm.md step 5), i.e. the sum of up to
  ``n = 10^3 .. 10^4`` client updates (10-14 bits), scaled by a fixed-point factor ``2^f``
  (8-16 bits) plus the factorisation's noise term, and each client's own quantised update needs
  12-20 bits (DDGauss uses 12-20 bits per coordinate). 2^31 - 1 leaves at most 30 bits for all of
  that; 2^61 - 1 leaves 60, so the whole sum never wraps with a comfortable margin. The vector
  length (10^6 coordinates) does not enter: sums are per coordinate.
* Exactness in int64 without 128-bit integers. Elements fit in int64 with two bits spare, so
  additions of two elements never overflow. Products are formed from 32-bit halves in uint64 and
  folded with ``2^61 = 1 (mod p)`` (see :meth:`MersenneField.mul`); multiplication by a power of
  two is a 61-bit rotation.
* Fast matrix products. :meth:`MersenneField.matmul` splits the right operand into w_b-bit
  limbs, multiplies the left one by each limb's weight 2^(w_b j) (a rotation) and splits that
  into w_a-bit limbs, and multiplies limbs with one float64 BLAS call, choosing w_a, w_b so that
  every sum of limb products stays below 2^53 and is therefore an exact integer (for sharing,
  31-bit limbs of the share matrix against 16-bit limbs of the inputs). Sharing 10^6 elements
  is then one dense float matrix product plus shifts and masks.

Smaller Mersenne exponents (2, 3, 5, 7, 13, 17, 19, 31) are supported with the same code so that
tests can enumerate whole fields exhaustively (e.g. every sharing of a secret in F_31).
"""

from __future__ import annotations

import math
import os

import numpy as np

from protocols.limbs import (
    MAX_EXACT_FLOAT,
    LimbPlan,
    MersenneSum,
    fold_mersenne,
    lagrange_small,
    limb_plan,
    rotate_into,
    split_limbs,
    subtract_once,
)

MERSENNE_EXPONENTS = (2, 3, 5, 7, 13, 17, 19, 31, 61)
"""Exponents e for which 2^e - 1 is prime and p < 2^62 (so elements fit in int64 with room)."""

_COLUMN_BLOCK = 4096
_SMALL_INVERSE = 64
"""Batches up to this size are inverted element by element in Python (:meth:`MersenneField.inv`)."""
_SMALL_LAGRANGE = 1024
"""Lagrange matrices of up to this many entries are computed in Python integers."""
_U32 = np.uint64(0xFFFFFFFF)


class MersenneField:
    """The prime field F_p with p = 2^e - 1, elements as int64 arrays in ``[0, p)``.

    Every operation is exact for every input in range; inputs outside ``[0, p)`` raise
    ``ValueError`` naming the argument.
    """

    def __init__(self, exponent: int = 61) -> None:
        if exponent not in MERSENNE_EXPONENTS:
            raise ValueError(
                f"exponent={exponent!r} does not give a supported Mersenne prime 2^e - 1; "
                f"allowed: {MERSENNE_EXPONENTS}"
            )
        self.exponent = exponent
        self.modulus = (1 << exponent) - 1
        self.max_signed = (self.modulus - 1) // 2
        self._p_u64 = np.uint64(self.modulus)

    def __repr__(self) -> str:
        return f"MersenneField(exponent={self.exponent})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MersenneField) and other.exponent == self.exponent

    def __hash__(self) -> int:
        return hash(("MersenneField", self.exponent))

    @property
    def bytes_per_element(self) -> int:
        """Bytes needed to send one element on the wire (little-endian, fixed width)."""
        return -(-self.exponent // 8)

    # ------------------------------------------------------------------ construction / checks
    def asarray(self, values, name: str = "values") -> np.ndarray:
        """``values`` as an int64 array after checking every entry lies in ``[0, p)``."""
        array = np.asarray(values)
        if array.dtype == object:
            if not all(
                isinstance(v, int | np.integer) and not isinstance(v, bool) for v in array.ravel()
            ):
                raise ValueError(
                    f"{name} must hold integers (field elements in [0, {self.modulus})), got "
                    f"objects of types {sorted({type(v).__name__ for v in array.ravel()})}"
                )
            array = np.array([int(v) for v in array.ravel()], dtype=object).reshape(array.shape)
            if array.size and (min(array.ravel()) < 0 or max(array.ravel()) >= self.modulus):
                raise ValueError(f"{name} has entries outside [0, p) with p = {self.modulus}")
            return array.astype(np.int64)
        if array.dtype.kind not in "iub":
            raise ValueError(
                f"{name} must hold integers (field elements in [0, {self.modulus})), "
                f"got dtype {array.dtype}"
            )
        if array.dtype.kind == "u" and array.size and int(array.max()) >= self.modulus:
            raise ValueError(
                f"{name} has entry {int(array.max())} outside [0, p) with p = {self.modulus}"
            )
        array = array.astype(np.int64, copy=False)
        # one pass: p < 2^62 and a negative entry read as uint64 is >= 2^63, so all lie in
        # [0, p) iff the uint64 maximum is below p
        if array.size and int(array.view(np.uint64).max()) >= self.modulus:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= self.modulus:
                bad = low if low < 0 else high
                raise ValueError(f"{name} has entry {bad} outside [0, p) with p = {self.modulus}")
        return array

    def vector(self, payload, width: int, name: str = "payload") -> np.ndarray:
        """``payload`` checked as a message field: a numpy array of ``width`` integers in
        ``[0, p)`` (any integer dtype), returned as int64; else ``ValueError`` naming ``name``."""
        if not isinstance(payload, np.ndarray) or payload.dtype.kind not in "iu":
            kind = payload.dtype if isinstance(payload, np.ndarray) else type(payload).__name__
            raise ValueError(f"{name} must be an integer array, got {kind}")
        if payload.shape != (width,):
            raise ValueError(f"{name} must hold {width} field elements, got shape {payload.shape}")
        return self.asarray(payload, name)

    def reduce(self, integers) -> np.ndarray:
        """Any int64 array (or Python ints) mapped to its residue in ``[0, p)``."""
        array = np.asarray(integers)
        if array.dtype == object:
            return np.array([int(v) % self.modulus for v in array.ravel()], dtype=np.int64).reshape(
                array.shape
            )
        if array.dtype.kind not in "iu":
            raise ValueError(f"integers must hold integers, got dtype {array.dtype}")
        if array.dtype == np.uint64:
            return (array % self._p_u64).astype(np.int64)
        return np.mod(array.astype(np.int64, copy=False), self.modulus)

    def zeros(self, shape) -> np.ndarray:
        return np.zeros(shape, dtype=np.int64)

    def random(self, rng: np.random.Generator, size) -> np.ndarray:
        """Uniform elements drawn from ``rng`` (simulation randomness, reproducible)."""
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        return rng.integers(0, self.modulus, size=size, dtype=np.int64)

    def random_secure(self, size) -> np.ndarray:
        """Uniform elements from the OS CSPRNG (``os.urandom``), by rejection of 2^e - 1.

        Cryptographic randomness: used for shares, masks and keys in secure mode.
        """
        shape = (size,) if isinstance(size, int) else tuple(size)
        count = math.prod(shape)
        out = np.empty(count, dtype=np.int64)
        filled = 0
        mask = np.uint64(self.modulus)
        while filled < count:
            need = count - filled
            draw = np.frombuffer(os.urandom(8 * (need + 8)), dtype=np.uint64) & mask
            draw = draw[draw != mask][:need]
            out[filled : filled + draw.size] = draw.astype(np.int64)
            filled += draw.size
        return out.reshape(shape)

    # ------------------------------------------------------------------ element-wise arithmetic
    def add(self, a, b) -> np.ndarray:
        """(a + b) mod p, broadcasting."""
        a = self.asarray(a, "a")
        b = self.asarray(b, "b")
        total = a + b
        return np.where(total >= self.modulus, total - self.modulus, total)

    def sub(self, a, b) -> np.ndarray:
        """(a - b) mod p, broadcasting."""
        a = self.asarray(a, "a")
        b = self.asarray(b, "b")
        diff = a - b
        return np.where(diff < 0, diff + self.modulus, diff)

    def neg(self, a) -> np.ndarray:
        """-a mod p."""
        a = self.asarray(a, "a")
        return np.where(a == 0, a, self.modulus - a)

    def sum(self, a, axis=None) -> np.ndarray:
        """Sum mod p along ``axis``, exact for any number of terms (pairwise tree)."""
        a = self.asarray(a, "a")
        if axis is None:
            a = a.ravel()
            axis = 0
        a = np.moveaxis(a, axis, 0)
        # each element < 2^61, so a pair sums below 2^62 in int64
        while a.shape[0] > 1:
            pad = (-a.shape[0]) % 2
            if pad:
                a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], dtype=np.int64)])
            pair = a[0::2] + a[1::2]
            a = np.where(pair >= self.modulus, pair - self.modulus, pair)
        if a.shape[0] == 0:
            return np.zeros(a.shape[1:], dtype=np.int64)
        return a[0]

    def sum_rows(self, rows, shape) -> np.ndarray:
        """Sum mod p of the field arrays ``rows`` (an iterable, each of ``shape``), one pass
        each into a :class:`protocols.limbs.MersenneSum`: what :meth:`sum` of their stack
        gives, without the stack; zeros for no rows."""
        total = MersenneSum(self.exponent, shape)
        for i, row in enumerate(rows):
            row = self.asarray(row, f"rows[{i}]")
            if row.shape != total.shape:
                raise ValueError(f"rows[{i}] has shape {row.shape}; allowed: {total.shape}")
            total.add(row.view(np.uint64))
        return total.value().view(np.int64)

    def mul(self, a, b) -> np.ndarray:
        """(a * b) mod p element-wise with broadcasting (scalars allowed), exact.

        For e = 61 the product of 61-bit numbers is assembled from 32-bit halves in uint64:
        a*b = hh*2^64 + mid*2^32 + lo with 2^64 = 8 and 2^61 = 1 (mod p).
        """
        a = self.asarray(a, "a")
        b = self.asarray(b, "b")
        return self._mul_unchecked(a, b)

    def _mul_unchecked(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.exponent <= 31:
            return (a * b) % self.modulus
        p = self._p_u64
        ua = a.astype(np.uint64)
        ub = b.astype(np.uint64)
        a_hi, a_lo = ua >> np.uint64(32), ua & _U32
        b_hi, b_lo = ub >> np.uint64(32), ub & _U32
        hh = a_hi * b_hi  # < 2^58
        mid = a_hi * b_lo + a_lo * b_hi  # < 2^62
        lo = a_lo * b_lo  # < 2^64
        total = hh << np.uint64(3)  # hh * 2^64 = hh * 8 (mod p), < 2^61
        # mid * 2^32 = (mid >> 29) * 2^61 + (mid mod 2^29) * 2^32 = (mid >> 29) + ... (mod p)
        total += mid >> np.uint64(29)
        total += (mid & np.uint64((1 << 29) - 1)) << np.uint64(32)
        total += lo & p
        total += lo >> np.uint64(61)
        # total < 3 * 2^61 + 2^34 < 2^63: fold once more, then one conditional subtraction
        total = (total & p) + (total >> np.uint64(61))
        total = total - p * (total >= p)  # no wrap-around, also for 0-d operands
        return total.astype(np.int64)

    def mul_pow2(self, a, shift: int) -> np.ndarray:
        """a * 2^shift mod p: a rotation of the e-bit representation (2^e = 1 mod p)."""
        a = self.asarray(a, "a")
        return self._rotate(a.astype(np.uint64), shift).astype(np.int64)

    def _rotate(self, ua: np.ndarray, shift: int) -> np.ndarray:
        shift %= self.exponent
        if shift == 0:
            return ua
        high = (ua << np.uint64(shift)) & self._p_u64
        return high | (ua >> np.uint64(self.exponent - shift))

    def pow(self, a, exponent: int) -> np.ndarray:
        """a^exponent mod p element-wise (exponent a non-negative Python int)."""
        if not isinstance(exponent, int | np.integer) or exponent < 0:
            raise ValueError(f"exponent must be a non-negative integer, got {exponent!r}")
        base = self.asarray(a, "a")
        result = np.ones_like(base)
        exponent = int(exponent)
        while exponent:
            if exponent & 1:
                result = self._mul_unchecked(result, base)
            exponent >>= 1
            if exponent:
                base = self._mul_unchecked(base, base)
        return result

    def inv(self, a) -> np.ndarray:
        """Element-wise inverse: a^(p-2) (Fermat) vectorised over a large batch; for a batch of
        at most :data:`_SMALL_INVERSE` elements (Lagrange weights, a few per interpolation)
        Python's exact modular inverse of each, the same values without e - 1 rounds of
        batch products."""
        a = self.asarray(a, "a")
        if np.any(a == 0):
            where = np.flatnonzero(np.ravel(a) == 0)[:5].tolist()
            raise ValueError(f"a has zero entries (flat positions {where}...): 0 has no inverse")
        if a.size <= _SMALL_INVERSE:
            inverses = [pow(int(x), -1, self.modulus) for x in a.ravel().tolist()]
            return np.array(inverses, dtype=np.int64).reshape(a.shape)
        return self.pow(a, self.modulus - 2)

    def div(self, a, b) -> np.ndarray:
        """a / b mod p element-wise."""
        return self._mul_unchecked(self.asarray(a, "a"), self.inv(b))

    def prod(self, a, axis: int = -1) -> np.ndarray:
        """Product mod p along ``axis``."""
        a = np.moveaxis(self.asarray(a, "a"), axis, 0)
        result = np.ones(a.shape[1:], dtype=np.int64)
        for row in a:
            result = self._mul_unchecked(result, row)
        return result

    # ------------------------------------------------------------------ linear algebra
    def matmul(self, left, right, out: np.ndarray | None = None) -> np.ndarray:
        """(left @ right) mod p for 2-D (or 1-D) operands, exact; 2-D products may be written
        into ``out`` (a C-contiguous int64 array of the product's shape).

        The right operand is split into w_b-bit limbs and the left one, times each limb's
        weight, into w_a-bit limbs, with ``w_a + w_b + log2(K * limbs) <= 53`` for the inner
        dimension K (:func:`limb_plan`); one float64 BLAS call gives every sum of limb
        products as an exact integer below 2^53, and those are rotated (multiplication by
        2^(w_a i) mod p) and added in uint64 (:meth:`_matmul_2d`).
        """
        left = self.asarray(left, "left")
        right = self.asarray(right, "right")
        left_vector = left.ndim == 1
        right_vector = right.ndim == 1
        if left_vector:
            left = left[None, :]
        if right_vector:
            right = right[:, None]
        if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
            raise ValueError(
                f"matmul shapes do not align: left {left.shape} @ right {right.shape}; "
                "allowed: (m, K) @ (K, N)"
            )
        if out is not None and (
            left_vector
            or right_vector
            or out.shape != (left.shape[0], right.shape[1])
            or out.dtype != np.int64
            or not out.flags.c_contiguous
        ):
            raise ValueError(
                f"out has shape {getattr(out, 'shape', None)}; allowed: a C-contiguous int64 "
                f"array of shape ({left.shape[0]}, {right.shape[1]}) for 2-D operands"
            )
        result = self._matmul_2d(left, right, out=out)
        if left_vector and right_vector:
            return result[0, 0]
        if left_vector:
            return result[0]
        if right_vector:
            return result[:, 0]
        return result

    def _matmul_2d(
        self,
        left: np.ndarray,
        right: np.ndarray,
        plan: LimbPlan | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """(left @ right) mod p for aligned 2-D field arrays, by limbs (:meth:`matmul`).

        With right = sum_j right_j 2^(w_b j) (w_b-bit limbs) and left_j = left 2^(w_b j) mod p
        (a rotation) split into w_a-bit limbs left_ji: left @ right = sum_i 2^(w_a i) T_i with
        T_i = sum_j left_ji @ right_j, one stacked float64 product whose entries stay below
        2^53 (:func:`limb_plan`, or ``plan``); each T_i is rotated by w_a i bits and the sum
        folded mod p.
        """
        rows, inner = left.shape
        columns = right.shape[1]
        plan = plan or limb_plan(self.exponent, inner, rows, columns)
        total = np.zeros((rows, columns), dtype=np.int64) if out is None else out
        if inner == 0:
            total[...] = 0
        unsigned = total.view(np.uint64)
        for start in range(0, inner, plan.chunk):
            stop = min(inner, start + plan.chunk)
            stacked = self._stacked_left(left[:, start:stop], plan)
            for first in range(0, columns, _COLUMN_BLOCK):
                last = min(columns, first + _COLUMN_BLOCK)
                right_stack = split_limbs(right[start:stop, first:last], plan)
                block = self._combine(stacked @ right_stack, plan, rows)
                part = unsigned[:, first:last]
                if start == 0:
                    part[...] = block
                else:
                    part += block
                    subtract_once(part, self._p_u64, np.empty_like(part))
        return total

    def _stacked_left(self, left: np.ndarray, plan: LimbPlan) -> np.ndarray:
        """(left_limbs * rows, right_limbs * width) float64: block (i, j) is limb i of
        left * 2^(right_bits * j) mod p."""
        rows, width = left.shape
        stacked = np.empty((plan.left_limbs * rows, plan.right_limbs * width))
        unsigned = left.astype(np.uint64)
        mask = np.uint64((1 << plan.left_bits) - 1)
        for j in range(plan.right_limbs):
            shifted = self._rotate(unsigned, plan.right_bits * j)
            for i in range(plan.left_limbs):
                limb = (shifted >> np.uint64(plan.left_bits * i)) & mask
                stacked[i * rows : (i + 1) * rows, j * width : (j + 1) * width] = limb
        return stacked

    def _combine(self, terms: np.ndarray, plan: LimbPlan, rows: int) -> np.ndarray:
        """sum_i T_i 2^(left_bits i) mod p from the stacked T_i (exact integers < 2^53)."""
        p = self._p_u64
        parts = terms.astype(np.uint64).reshape(plan.left_limbs, rows, -1)
        if self.modulus <= MAX_EXACT_FLOAT:
            np.remainder(parts, p, out=parts)
        block = parts[0]
        scratch = np.empty_like(block)
        for i in range(1, plan.left_limbs):
            # parts[i] < p: times 2^(left_bits i) mod p is a rotation; the sum stays < 2^64
            rotate_into(parts[i], (plan.left_bits * i) % self.exponent, self.exponent, p, scratch)
            block += parts[i]
        # fold 2^e = 1 and subtract once: block < left_limbs * p -> [0, p)
        fold_mersenne(block, self.exponent, p, scratch)
        subtract_once(block, p, scratch)
        return block

    def solve(self, matrix, rhs) -> np.ndarray | None:
        """One solution x of ``matrix @ x = rhs`` (mod p), or None when there is none.

        Gauss-Jordan elimination with one vectorised row operation per pivot; unknowns without
        a pivot (an underdetermined system) are set to 0. ``matrix`` (rows, columns), ``rhs``
        (rows,): field elements.
        """
        matrix = self.asarray(matrix, "matrix")
        rhs = self.asarray(rhs, "rhs").ravel()
        if matrix.ndim != 2 or matrix.shape[0] != rhs.size:
            raise ValueError(
                f"solve needs a (rows, columns) matrix and rows right-hand sides, got "
                f"{matrix.shape} and {rhs.shape}"
            )
        rows, columns = matrix.shape
        table = np.hstack([matrix, rhs[:, None]])
        pivots: list[int] = []
        for column in range(columns):
            row = len(pivots)
            if row == rows:
                break
            nonzero = np.flatnonzero(table[row:, column])
            if nonzero.size == 0:
                continue
            table[[row, row + nonzero[0]]] = table[[row + nonzero[0], row]]
            pivot_inverse = pow(int(table[row, column]), self.modulus - 2, self.modulus)
            table[row] = self._mul_unchecked(table[row], np.array([pivot_inverse]))
            factors = table[:, column].copy()
            factors[row] = 0
            table = self.sub(table, self._mul_unchecked(factors[:, None], table[row][None, :]))
            pivots.append(column)
        if np.any(table[len(pivots) :, -1]):
            return None
        solution = np.zeros(columns, dtype=np.int64)
        solution[pivots] = table[: len(pivots), -1]
        return solution

    def vandermonde(self, points, columns: int) -> np.ndarray:
        """V[i, j] = points[i]^j mod p, shape (len(points), columns)."""
        points = self.asarray(points, "points").ravel()
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        table = np.ones((points.size, columns), dtype=np.int64)
        for j in range(1, columns):
            table[:, j] = self._mul_unchecked(table[:, j - 1], points)
        return table

    def evaluate(self, coefficients, points) -> np.ndarray:
        """Polynomials evaluated at many points: ``coefficients`` (d+1,) or (d+1, B), lowest
        degree first; returns (len(points),) or (len(points), B)."""
        coefficients = self.asarray(coefficients, "coefficients")
        table = self.vandermonde(points, coefficients.shape[0])
        return self.matmul(table, coefficients)

    def lagrange_coefficients(self, nodes, targets) -> np.ndarray:
        """L[i, j] = l_j(targets[i]) for the Lagrange basis on distinct ``nodes``.

        For any polynomial f of degree < len(nodes): f(targets) = L @ f(nodes) (mod p).
        Products excluding one factor use prefix/suffix products, so a target equal to a node
        gives the exact unit row without special cases.
        """
        nodes = self.asarray(nodes, "nodes").ravel()
        targets = self.asarray(targets, "targets").ravel()
        if np.unique(nodes).size != nodes.size:
            raise ValueError(f"nodes must be distinct field elements, got {nodes.tolist()}")
        if nodes.size * targets.size <= _SMALL_LAGRANGE:
            return lagrange_small(nodes.tolist(), targets.tolist(), self.modulus)
        count = nodes.size
        # weights w_j = prod_{l != j} (x_j - x_l)
        node_diff = self.sub(nodes[:, None], nodes[None, :])
        np.fill_diagonal(node_diff, 1)
        inverse_weights = self.inv(self.prod(node_diff, axis=1))
        # numerators prod_{l != j} (z_i - x_l) via prefix and suffix products
        target_diff = self.sub(targets[:, None], nodes[None, :])
        prefix = np.ones((targets.size, count + 1), dtype=np.int64)
        suffix = np.ones((targets.size, count + 1), dtype=np.int64)
        for j in range(count):
            prefix[:, j + 1] = self._mul_unchecked(prefix[:, j], target_diff[:, j])
            back = count - 1 - j
            suffix[:, back] = self._mul_unchecked(suffix[:, back + 1], target_diff[:, back])
        numerators = self._mul_unchecked(prefix[:, :count], suffix[:, 1:])
        return self._mul_unchecked(numerators, inverse_weights[None, :])

    def interpolate(self, nodes, values, targets) -> np.ndarray:
        """Values at ``targets`` of the polynomial of degree < len(nodes) through
        (nodes, values); ``values`` has shape (len(nodes),) or (len(nodes), B)."""
        return self.matmul(self.lagrange_coefficients(nodes, targets), values)

    # ------------------------------------------------------------------ encodings
    def encode_signed(self, integers) -> np.ndarray:
        """Signed integers with |v| <= (p-1)/2 to their residues (centered representatives)."""
        array = np.asarray(integers)
        if array.dtype.kind not in "iu":
            raise ValueError(f"integers must hold integers, got dtype {array.dtype}")
        if array.dtype == np.uint64 and array.size and int(array.max()) > self.max_signed:
            raise ValueError(f"integers has entry {int(array.max())} > (p-1)/2 = {self.max_signed}")
        array = array.astype(np.int64, copy=False)
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < -self.max_signed or high > self.max_signed:
                bad = low if low < -self.max_signed else high
                raise ValueError(
                    f"integers has entry {bad} outside [-(p-1)/2, (p-1)/2] = "
                    f"[{-self.max_signed}, {self.max_signed}] (p = 2^{self.exponent} - 1)"
                )
        # |v| <= (p-1)/2: v mod p without a division; [()] keeps 0-d results scalars as np.mod
        return np.where(array < 0, array + self.modulus, array)[()]

    def decode_signed(self, elements) -> np.ndarray:
        """Field elements to their centered representative in [-(p-1)/2, (p-1)/2]."""
        elements = self.asarray(elements, "elements")
        return np.where(elements > self.max_signed, elements - self.modulus, elements)

    def encode_fixed(self, values, fractional_bits: int) -> np.ndarray:
        """Reals to field elements: round(values * 2^f) to the nearest integer, then centered.

        Raises if a value is not finite or |round(v * 2^f)| > (p-1)/2.
        """
        _check_fractional_bits(fractional_bits)
        values = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise ValueError("values must be finite (found NaN or inf)")
        scaled = np.rint(np.ldexp(values, fractional_bits))
        limit = float(2 ** (self.exponent - 1))  # |v| < 2^(e-1)  <=>  |v| <= (p-1)/2
        if scaled.size and float(np.max(np.abs(scaled))) >= limit:
            worst = float(values.ravel()[np.argmax(np.abs(scaled))])
            raise ValueError(
                f"values has entry {worst!r} whose fixed-point form with "
                f"fractional_bits={fractional_bits} exceeds (p-1)/2 = {self.max_signed}; "
                f"allowed |value| < 2^{self.exponent - 1 - fractional_bits}"
            )
        return np.mod(scaled.astype(np.int64), self.modulus)

    def decode_fixed(self, elements, fractional_bits: int) -> np.ndarray:
        """Field elements to reals: centered representative / 2^f (float64)."""
        _check_fractional_bits(fractional_bits)
        return np.ldexp(self.decode_signed(elements).astype(np.float64), -fractional_bits)

    def sum_headroom_bits(
        self, n_summands: int, magnitude_bound: float, noise_bound: float = 0.0
    ) -> float:
        """Bits to spare before a sum of integers wraps mod p.

        Worst case |sum| <= n_summands * magnitude_bound + noise_bound (all in integer units, i.e.
        after fixed-point scaling). The sum decodes correctly iff that is <= (p-1)/2; returns
        log2((p-1)/2 / worst case) >= 0, or raises ``ValueError`` naming the argument to shrink.
        """
        if not isinstance(n_summands, int | np.integer) or n_summands < 1:
            raise ValueError(f"n_summands must be a positive integer, got {n_summands!r}")
        for name, value in (("magnitude_bound", magnitude_bound), ("noise_bound", noise_bound)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        worst = int(n_summands) * magnitude_bound + noise_bound
        if worst == 0:
            return math.inf
        if worst > self.max_signed:
            room_per_summand = (self.max_signed - noise_bound) / n_summands
            raise ValueError(
                f"a sum of n_summands={n_summands} terms with magnitude_bound={magnitude_bound} "
                f"and noise_bound={noise_bound} can reach {worst:.6g} > (p-1)/2 = "
                f"{self.max_signed} (2^{math.log2(self.max_signed):.2f}) and would wrap mod p; "
                f"needs magnitude_bound <= {max(room_per_summand, 0.0):.6g} "
                f"({math.log2(worst / self.max_signed):.2f} bits too many)"
            )
        return math.log2(self.max_signed / worst)


def _check_fractional_bits(fractional_bits: int) -> None:
    if not isinstance(fractional_bits, int | np.integer) or not 0 <= fractional_bits <= 60:
        raise ValueError(f"fractional_bits must be an integer in [0, 60], got {fractional_bits!r}")


DEFAULT_FIELD = MersenneField(61)
"""F_p with p = 2^61 - 1: the field every protocol uses unless told otherwise."""
