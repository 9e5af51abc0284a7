"""Is a factorization's noise the noise its sensitivity accounts for?

The matrix mechanism's privacy rests on the noise added being ``G z`` with G the noising
matrix of the C whose sensitivity is computed (``C^{-1}``; ``A^{-1} B`` for trees). The
streaming generator (:func:`fedsim.privacy.matrix.streaming.noise_stream`) is built from the
family's own parameters (BLT weights and thetas, tree alphas, bands), which a file stores
next to C: nothing ties them to it unless they are checked. :func:`stream_mismatch` checks,
per family, that the generator's parameters give exactly the C (and B) in the factorization:

- ``blt``: ``y_t = z_t - sum_i w_i s_i``, ``s_i <- theta_i s_i + y_t`` solves ``T(c) y = z``
  with ``c_0 = 1``, ``c_j = sum_i w_i theta_i^(j-1)`` (Dvijotham et al. 2024, Sec. 3), so C
  must be that Toeplitz matrix;
- ``tree``, ``honaker``: the node noise enters through the 0/1 node matrix and the online
  estimates weighted by ``alphas`` (:func:`fedsim.privacy.matrix.tree.tree_decoder`), so C
  must be the tree's node matrix and B the decoder the alphas give;
- ``banded``, ``banded_toeplitz``: forward substitution over ``bands`` diagonals, so C must be
  zero below them;
- every other (square) kind: forward substitution over C's own lower triangle, so C must be
  lower-triangular with a non-zero diagonal.

Each kind names its check (:mod:`fedsim.privacy.matrix.kinds`); these are the families'.

Tolerance (:data:`TOLERANCE`): ``max |rebuilt - stored| <= TOLERANCE * max(1, max |stored|)``
entrywise, on C for BLT and on B for trees; structure (zeros, the 0/1 node matrix) is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsim.privacy.matrix.structure import (
    blt_coefficients,
    toeplitz_matrix,
    tree_decoder,
    tree_encoder,
    tree_height,
)

#: relative entrywise tolerance between what the stream's parameters give and what is stored
TOLERANCE = 1e-9


def _relative(rebuilt: np.ndarray, stored: np.ndarray) -> float:
    scale = max(1.0, float(np.max(np.abs(stored))) if stored.size else 1.0)
    return float(np.max(np.abs(rebuilt - stored))) / scale if stored.size else 0.0


def _vector(f: Any, name: str) -> np.ndarray | str:
    """Parameter ``name`` as a finite 1-D float array, or what is wrong with it."""
    if name not in f.params:
        return f"no '{name}' parameter (the {f.kind} noise stream needs it)"
    value = np.asarray(f.params[name])
    if value.ndim != 1 or value.size == 0 or not np.issubdtype(value.dtype, np.number):
        return f"'{name}' of shape {value.shape} and type {value.dtype} (a 1-D numeric array)"
    value = value.astype(np.float64)
    if not np.all(np.isfinite(value)):
        return f"'{name}' holds NaN or infinite values"
    return value


def stream_mismatch(f: Any) -> str | None:
    """None when the noise stream built for the :class:`~.factorization.Factorization` ``f``
    generates ``G z`` for ``f``'s own C (within :data:`TOLERANCE`); else what differs, in
    words: the check of ``f``'s kind (:func:`fedsim.privacy.matrix.kinds.saved_kind`; a kind
    no family saves under: :func:`square_mismatch`)."""
    from fedsim.privacy.matrix.kinds import saved_kind  # noqa: PLC0415  (the families load this)

    for name, array in (("workload", f.workload), ("encoder", f.encoder), ("decoder", f.decoder)):
        if not np.all(np.isfinite(array)):
            return f"the {name} holds NaN or infinite values"
    kind = saved_kind(f.kind)
    return square_mismatch(f) if kind is None else kind.mismatch(f)


def tree_mismatch(f: Any) -> str | None:
    """A tree's: C the node matrix of the n-round tree, B the decoder its ``alphas`` give."""
    A, B, C, n = f.workload, f.decoder, f.encoder, f.n
    alphas = _vector(f, "alphas")
    if isinstance(alphas, str):
        return alphas
    height = tree_height(n)
    if alphas.shape != (height + 1,):
        return f"{alphas.shape[0]} alphas for a tree of height {height} ({height + 1} needed)"
    expected = tree_encoder(n)
    if C.shape != expected.shape or not np.array_equal(C, expected):
        return f"C (shape {C.shape}) is not the node matrix of the {n}-round tree"
    error = _relative(tree_decoder(n, alphas, A), B)
    if error > TOLERANCE:
        return f"B differs by {error:.3g} (relative) from the decoder the alphas give"
    return None


def square_mismatch(f: Any) -> str | None:
    """A square kind's (forward substitution over C's lower triangle): C n x n,
    lower-triangular, with a non-zero diagonal."""
    C, n = f.encoder, f.n
    if C.shape != (n, n):
        return f"C of shape {C.shape} (a {n} x {n} lower-triangular matrix for kind {f.kind})"
    if np.any(np.triu(C, k=1) != 0):
        return "C has non-zero entries above the diagonal (the stream reads rows <= t only)"
    if np.any(np.diag(C) == 0):
        return "C has a zero on its diagonal (not invertible)"
    return None


def blt_mismatch(f: Any) -> str | None:
    """BLT's: a square C equal to the Toeplitz matrix its ``weights`` and ``thetas`` give."""
    problem = square_mismatch(f)
    if problem is not None:
        return problem
    weights, thetas = _vector(f, "weights"), _vector(f, "thetas")
    for value in (weights, thetas):
        if isinstance(value, str):
            return value
    if weights.shape != thetas.shape:
        return f"{weights.shape[0]} weights and {thetas.shape[0]} thetas (one of each per buffer)"
    with np.errstate(over="ignore", invalid="ignore"):
        rebuilt = toeplitz_matrix(blt_coefficients(weights, thetas, f.n), f.n)
    error = _relative(rebuilt, f.encoder) if np.all(np.isfinite(rebuilt)) else np.inf
    if not error <= TOLERANCE:
        return (
            f"C differs by {error:.3g} (relative) from the Toeplitz matrix its weights and "
            "thetas generate"
        )
    return None


def banded_mismatch(f: Any) -> str | None:
    """A banded kind's: a square C zero below its ``bands`` diagonals."""
    problem = square_mismatch(f)
    if problem is not None:
        return problem
    bands, n = f.params.get("bands"), f.n
    if isinstance(bands, (bool, np.bool_)) or not isinstance(bands, (int, np.integer)):
        return f"bands = {bands!r} (an integer in [1, {n}])"
    if not 1 <= int(bands) <= n:
        return f"bands = {bands} (an integer in [1, {n}])"
    if np.any(np.tril(f.encoder, k=-int(bands)) != 0):
        return f"C has non-zero entries below its {int(bands)} bands (the stream ignores them)"
    return None
