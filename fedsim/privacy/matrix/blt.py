"""Buffered linear Toeplitz (BLT) strategies (Dvijotham, McMahan, Pillutla, Steinke &
Thakurta 2024, "Efficient and Near-Optimal Noise Generation for Streaming Differential
Privacy").

C is lower-triangular Toeplitz with ``c_0 = 1`` and ``c_j = sum_i w_i theta_i^(j - 1)`` for
``j >= 1``: a rational generating function with ``nbuf`` poles. ``y = C^{-1} z`` streams with
``nbuf`` buffers: ``y_t = z_t - sum_i w_i s_{i,t}`` and ``s_{i,t+1} = theta_i s_{i,t} + y_t``
(:class:`fedsim.privacy.matrix.streaming.BLTStream`).

The optimiser keeps ``w_i > 0``, ``sum_i w_i < 1`` and ``0 < theta_i < 1``, so the coefficients
are positive and non-increasing and the min-separation sensitivity is exact (arXiv 2405.13763,
Thm. 2).
"""

from __future__ import annotations

import numpy as np

from fedsim.config import require
from fedsim.privacy.matrix.factorization import (
    Factorization,
    Progress,
    check_rounds,
    check_workload,
    from_square_encoder,
    lbfgs,
)
from fedsim.privacy.matrix.structure import blt_coefficients as blt_coefficients
from fedsim.privacy.matrix.toeplitz import (
    toeplitz_loss_and_grad,
    toeplitz_matrix,
    toeplitz_participation,
)
from fedsim.privacy.participation import Participation


def inverse_blt(weights: np.ndarray, thetas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BLT parameters ``(w_hat, theta_hat)`` of ``C^{-1}``: ``C^{-1}``'s coefficients are
    ``1, sum_i w_hat_i theta_hat_i^(j - 1)``.

    Forward substitution ``y_t = z_t - w^T s_t``, ``s_{t+1} = M s_t + 1 z_t`` with
    ``M = diag(theta) - 1 w^T`` gives ``(C^{-1})_j = -w^T M^{j-1} 1``; diagonalising M yields the
    new poles (the roots of ``sum_i w_i / (theta_i - x) = 1``, real for ``w > 0``).
    """
    w = np.asarray(weights, dtype=np.float64)
    th = np.asarray(thetas, dtype=np.float64)
    M = np.diag(th) - np.outer(np.ones_like(w), w)
    poles, V = np.linalg.eig(M)
    left = w @ V
    right = np.linalg.solve(V, np.ones_like(w))
    w_hat = -left * right
    if np.allclose(poles.imag, 0.0) and np.allclose(w_hat.imag, 0.0):
        return w_hat.real, poles.real
    return w_hat, poles


def _unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nbuf = x.shape[0] // 2
    e = np.exp(x[:nbuf] - max(0.0, float(x[:nbuf].max())))
    w = e / (np.exp(-max(0.0, float(x[:nbuf].max()))) + e.sum())
    th = 1.0 / (1.0 + np.exp(-x[nbuf:]))
    return w, th


def blt(
    n: int,
    buffers: int = 3,
    participation: Participation | None = None,
    workload: np.ndarray | None = None,
    max_iter: int = 500,
    progress: Progress | None = None,
) -> Factorization:
    """Optimised BLT with ``buffers`` buffers, by L-BFGS on the Toeplitz loss of
    :func:`fedsim.privacy.matrix.toeplitz.toeplitz_loss_and_grad`.

    Parameters: ``w = softmax-like(a)`` (``w_i = e^{a_i} / (1 + sum e^a)``) and
    ``theta = sigmoid(t)``.
    """
    n = check_rounds(n)
    require(
        isinstance(buffers, (int, np.integer)) and 1 <= buffers <= 16,
        "buffers",
        buffers,
        "an integer in [1, 16]",
    )
    A = None if workload is None else check_workload(workload, n)
    sep, k = toeplitz_participation(participation, n, 1)
    powers = np.arange(max(n - 1, 0))

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        w, th = _unpack(x)
        coef = blt_coefficients(w, th, n)
        loss, g = toeplitz_loss_and_grad(coef, A, sep, k)
        g1 = g[1:]
        pw = th[None, :] ** powers[:, None]  # theta^(j-1)
        d_w = pw.T @ g1
        dpw = np.zeros_like(pw)
        dpw[1:] = powers[1:, None] * th[None, :] ** (powers[1:, None] - 1)
        d_th = (dpw.T @ g1) * w
        d_a = w * (d_w - np.dot(w, d_w))
        d_t = d_th * th * (1.0 - th)
        return loss, np.concatenate([d_a, d_t])

    # Poles spread on a log scale towards 1 (long memory), small equal weights.
    thetas0 = 1.0 - np.logspace(-0.3, -np.log10(max(n, 2)), buffers)
    weights0 = np.full(buffers, 0.5 / buffers)
    a0 = np.log(weights0 / (1.0 - weights0.sum()))
    t0 = np.log(thetas0 / (1.0 - thetas0))
    x = lbfgs(fun, np.concatenate([a0, t0]), max_iter, progress=progress)
    w, th = _unpack(x)
    coef = blt_coefficients(w, th, n)
    C = toeplitz_matrix(coef, n)
    return from_square_encoder(
        "blt", C, check_workload(workload, n), {"weights": w, "thetas": th, "coef": coef}
    )
