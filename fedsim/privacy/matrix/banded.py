"""Banded matrix factorization, BandMF (Choquette-Choo et al. 2023b, "(Amplified) Banded
Matrix Factorization"; McKenna 2024, "Scaling up the Banded Matrix Factorization Mechanism").

C is lower-triangular with ``bands`` non-zero diagonals (``C[t, s] = 0`` unless
``0 <= t - s < bands``) and every column normalised to norm 1. Columns more than ``bands - 1``
apart are then orthogonal, so under b-min-separation with ``min_sep >= bands`` the sensitivity
is exactly ``sqrt(k)``. Noise ``C^{-1} z`` streams by forward substitution with ``bands - 1``
buffers.

Optimisation: L-BFGS directly on the band of an unnormalised V, held in LAPACK lower band
storage ``ab[d, j] = V[j + d, j]`` (``bands x n``), with ``C = V diag(1 / ||V[:, j]||)``,
minimising ``||A C^{-1}||_F^2``. With ``B = A C^{-1}`` and ``W = B C^{-T}``,
``dL/dC[j + d, j] = -2 sum_t B[t, j + d] W[t, j]`` (from ``dL/dC = -2 B^T B C^{-T}``), and for a
column ``c = v / ||v||``, ``dL/dv = (I - c c^T) dL/dc / ||v||``. Banded triangular solves
(LAPACK ``tbtrs``) and block products keep one evaluation at ``O(n^2 bands)`` plus ``A C^{-1}``.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.linalg.lapack

from fedsim.config import require
from fedsim.privacy.matrix.factorization import (
    Factorization,
    Progress,
    check_rounds,
    check_workload,
    from_square_encoder,
    lbfgs,
)
from fedsim.privacy.matrix.toeplitz import sqrt_coefficients


def band_mask(n: int, bands: int) -> np.ndarray:
    """Boolean n x n mask of the ``bands`` lower diagonals (main diagonal included)."""
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    return (lag >= 0) & (lag < bands)


def band_storage_mask(n: int, bands: int) -> np.ndarray:
    """Which entries of a ``bands x n`` band storage lie inside the matrix (``j + d < n``)."""
    return (np.arange(bands)[:, None] + np.arange(n)[None, :]) < n


def from_band_storage(ab: np.ndarray) -> np.ndarray:
    """The n x n lower-triangular matrix with ``C[j + d, j] = ab[d, j]``."""
    bands, n = ab.shape
    C = np.zeros((n, n))
    for d in range(bands):
        idx = np.arange(n - d)
        C[idx + d, idx] = ab[d, : n - d]
    return C


def to_band_storage(C: np.ndarray, bands: int) -> np.ndarray:
    """``ab[d, j] = C[j + d, j]`` for ``d < bands`` (0 past the matrix)."""
    n = C.shape[0]
    ab = np.zeros((bands, n))
    for d in range(bands):
        ab[d, : n - d] = np.diagonal(C, offset=-d)
    return ab


def normalize_columns(V: np.ndarray) -> np.ndarray:
    """``V`` with every column scaled to L2 norm 1."""
    norms = np.linalg.norm(V, axis=0)
    require(bool(np.all(norms > 0)), "C", "a zero column", "columns with non-zero norm")
    return V / norms


def band_loss_and_grad(ab: np.ndarray, A: np.ndarray | None) -> tuple[float, np.ndarray]:
    """``||A C^{-1}||_F^2`` with C the column-normalised banded matrix of band storage ``ab``,
    and its gradient in ``ab``; ``A`` None means prefix sums. A singular C gives ``inf``."""
    bands, n = ab.shape
    valid = band_storage_mask(n, bands)
    ab = np.where(valid, ab, 0.0)
    norms = np.sqrt(np.sum(ab**2, axis=0))
    cb = ab / norms
    c_inv, info = scipy.linalg.lapack.dtbtrs(cb, np.eye(n), uplo="L")
    if info != 0 or not np.all(np.isfinite(c_inv)):
        return float("inf"), np.zeros_like(ab)
    B = np.cumsum(c_inv, axis=0) if A is None else A @ c_inv
    loss = float(np.sum(B**2))
    Wt, _ = scipy.linalg.lapack.dtbtrs(cb, np.ascontiguousarray(B.T), uplo="L")
    W = Wt.T
    G = np.zeros((bands, n))
    block = max(bands, 64)
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        M = B[:, lo : min(hi + bands - 1, n)].T @ W[:, lo:hi]  # M[r, c] = <B[:, lo+r], W[:, lo+c]>
        for d in range(bands):
            diag = np.diagonal(M, offset=-d)
            G[d, lo : lo + diag.shape[0]] = diag
    G *= -2.0
    G = (G - cb * np.sum(cb * G, axis=0)) / norms
    return loss, np.where(valid, G, 0.0)


def banded(
    n: int,
    bands: int,
    workload: np.ndarray | None = None,
    max_iter: int = 500,
    progress: Progress | None = None,
) -> Factorization:
    """Optimised column-normalised ``bands``-banded C (BandMF); start: the square-root
    Toeplitz coefficients cut to ``bands`` diagonals, column normalised.

    The loss ``||A C^{-1}||_F^2 / n`` does not depend on the participation: under
    b-min-separation with ``min_sep >= bands`` (or fixed-epoch order with
    ``n / epochs >= bands``) every such C has the same sensitivity ``sqrt(k)``.
    """
    n = check_rounds(n)
    require(
        isinstance(bands, (int, np.integer)) and 1 <= bands <= n,
        "bands",
        bands,
        f"an integer in [1, n = {n}]",
    )
    A = check_workload(workload, n)
    valid = band_storage_mask(n, bands)
    start = np.where(valid, sqrt_coefficients(bands)[:, None], 0.0)
    fast_a = None if workload is None else A

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        ab = np.zeros((bands, n))
        ab[valid] = x
        loss, G = band_loss_and_grad(ab, fast_a)
        if not np.isfinite(loss):  # singular C: a value the line search backs off from
            return 1e300, np.zeros(x.shape)
        return loss / n, G[valid] / n

    ab = start
    if bands > 1:
        ab = np.zeros((bands, n))
        ab[valid] = lbfgs(fun, start[valid], max_iter, progress=progress)
    C = normalize_columns(from_band_storage(ab))
    return from_square_encoder("banded", C, A, {"bands": int(bands)})
