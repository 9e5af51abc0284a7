"""Banded matrix factorization, BandMF (Choquette-Choo et al. 2023b, "(Amplified) Banded
Matrix Factorization"; McKenna 2024, "Scaling up the Banded Matrix Factorization Mechanism").

C is lower-triangular with ``bands`` non-zero diagonals (``C[t, s] = 0`` unless
``0 <= t - s < bands``) and every column normalised to norm 1. Columns more than ``bands - 1``
apart are then orthogonal, so under b-min-separation with ``min_sep >= bands`` the sensitivity
is exactly ``sqrt(k)``. Noise ``C^{-1} z`` streams by forward substitution with ``bands - 1``
buffers.

Optimisation: L-BFGS directly on the band entries of an unnormalised V, with
``C = V diag(1 / ||V[:, j]||)``, minimising ``||A C^{-1}||_F^2``. With ``B = A C^{-1}``,
``dL/dC = -2 B^T B C^{-T}``, and for column ``c = v / ||v||``,
``dL/dv = (I - c c^T) dL/dc / ||v||``.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from fedsim.config import require
from fedsim.privacy.matrix.factorization import (
    Factorization,
    check_rounds,
    check_workload,
    from_square_encoder,
    lbfgs,
)
from fedsim.privacy.matrix.toeplitz import sqrt_coefficients, toeplitz_matrix


def band_mask(n: int, bands: int) -> np.ndarray:
    """Boolean n x n mask of the ``bands`` lower diagonals (main diagonal included)."""
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    return (lag >= 0) & (lag < bands)


def normalize_columns(V: np.ndarray) -> np.ndarray:
    """``V`` with every column scaled to L2 norm 1."""
    norms = np.linalg.norm(V, axis=0)
    require(bool(np.all(norms > 0)), "C", "a zero column", "columns with non-zero norm")
    return V / norms


def band_loss_and_grad(V: np.ndarray, A: np.ndarray) -> tuple[float, np.ndarray]:
    """``||A C^{-1}||_F^2`` with ``C = normalize_columns(V)``, and its gradient in V."""
    norms = np.linalg.norm(V, axis=0)
    C = V / norms
    Bt = scipy.linalg.solve_triangular(C, A.T, lower=True, trans="T")  # (A C^{-1})^T
    loss = float(np.sum(Bt**2))
    M = Bt @ Bt.T  # B^T B
    G = -2.0 * scipy.linalg.solve_triangular(C, M, lower=True).T  # -2 B^T B C^{-T}
    G = (G - C * np.sum(C * G, axis=0)) / norms
    return loss, G


def banded(
    n: int,
    bands: int,
    workload: np.ndarray | None = None,
    max_iter: int = 500,
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
    mask = band_mask(n, bands)
    V0 = toeplitz_matrix(sqrt_coefficients(bands), n)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        V = np.zeros((n, n))
        V[mask] = x
        loss, G = band_loss_and_grad(V, A)
        return loss / n, G[mask] / n

    V = np.zeros((n, n))
    if bands > 1:
        V[mask] = lbfgs(fun, V0[mask], max_iter)
    else:
        V = np.eye(n)
    C = normalize_columns(V)
    C[~mask] = 0.0
    return from_square_encoder("banded", C, A, {"bands": int(bands)})
