"""Dense multi-epoch matrix factorization (Denisov et al. 2022; Choquette-Choo et al. 2023,
"Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning").

Optimise the Gram matrix ``X = C^T C`` (symmetric positive definite) for
``L(X) = tr(A^T A X^{-1}) / n`` under fixed-epoch order with ``epochs`` passes of
``b = n / epochs`` rounds:

- participation mask: ``X_ij = 0`` for ``i != j`` with ``i = j (mod b)`` (a user's own rounds
  are orthogonal), so its sensitivity depends only on ``diag(X)``;
- normalisation: ``sum_{i in pi_r} X_ii = 1`` for every pattern ``pi_r = {r, r + b, ...}``, so
  the sensitivity is exactly 1.

Gradient ``dL/dX = -X^{-1} A^T A X^{-1} / n``, restricted to the free entries (affine
parameterisation; the diagonal moves with zero sum per pattern). ``C`` then comes from the
*reverse* Cholesky factorization: with J the reversal permutation and ``J X J = L L^T``,
``C = J L^T J`` is lower-triangular (streamable) and satisfies ``C^T C = X``, so
``||C[:, j]||^2 = X_jj``. (``cholesky(X)`` itself gives ``X = L L^T``: the row norms of L, not
its column norms, follow ``diag(X)``.)
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from fedsim.config import require
from fedsim.privacy.matrix.factorization import (
    Factorization,
    Progress,
    check_rounds,
    check_workload,
    from_square_encoder,
    lbfgs,
)


def participation_mask(n: int, epochs: int) -> np.ndarray:
    """``M_ij = 0`` where ``i != j`` and ``i = j (mod n / epochs)``, 1 elsewhere."""
    require(n % epochs == 0, "epochs", epochs, f"a divisor of the number of rounds n = {n}")
    b = n // epochs
    idx = np.arange(n)
    same = np.equal.outer(idx % b, idx % b)
    return ~same | np.eye(n, dtype=bool)


def reverse_cholesky(X: np.ndarray) -> np.ndarray:
    """Lower-triangular C with ``C^T C = X`` (X symmetric positive definite)."""
    L = np.linalg.cholesky(X[::-1, ::-1])
    return np.ascontiguousarray(L.T[::-1, ::-1])


def dense_loss_and_grad(X: np.ndarray, AtA: np.ndarray) -> tuple[float, np.ndarray] | None:
    """``tr(A^T A X^{-1})`` and ``-X^{-1} A^T A X^{-1}``; None if X is not positive definite."""
    try:
        factor = scipy.linalg.cho_factor(X, lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        return None
    H = scipy.linalg.cho_solve(factor, AtA, check_finite=False)  # X^{-1} A^T A
    loss = float(np.trace(H))
    G = -scipy.linalg.cho_solve(factor, H.T, check_finite=False)
    return loss, 0.5 * (G + G.T)


def dense(
    n: int,
    epochs: int = 1,
    workload: np.ndarray | None = None,
    max_iter: int = 1000,
    progress: Progress | None = None,
) -> Factorization:
    """Optimised dense lower-triangular C for ``epochs``-epoch fixed-order participation, with
    sensitivity 1 by construction (``epochs = 1``: single participation, all columns norm 1).
    """
    n = check_rounds(n)
    require(
        isinstance(epochs, (int, np.integer)) and epochs >= 1,
        "epochs",
        epochs,
        "an integer >= 1",
    )
    A = check_workload(workload, n)
    mask = participation_mask(n, int(epochs))
    b = n // int(epochs)
    upper = np.triu(mask, k=1)
    iu = np.nonzero(upper)
    AtA = A.T @ A
    cls = np.arange(n) % b

    def build(x: np.ndarray) -> np.ndarray:
        u = x[:n]
        centred = u - (np.bincount(cls, u, b) / epochs)[cls]
        X = np.zeros((n, n))
        X[iu] = x[n:]
        X = X + X.T
        X[np.diag_indices(n)] = 1.0 / epochs + centred
        return X

    state = {"last": None}

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        out = dense_loss_and_grad(build(x), AtA)
        if out is None:  # outside the PD cone: a value the line search backs off from
            return 1e3 * (state["last"] or 1.0) + 1e3, np.zeros_like(x)
        loss, G = out
        state["last"] = loss / n
        gd = np.diag(G)
        g_u = gd - (np.bincount(cls, gd, b) / epochs)[cls]
        return loss / n, np.concatenate([g_u, 2.0 * G[iu]]) / n

    x0 = np.zeros(n + iu[0].shape[0])
    X = build(lbfgs(fun, x0, max_iter, progress=progress))
    C = reverse_cholesky(X)
    return from_square_encoder("dense", C, A, {"epochs": int(epochs)})
