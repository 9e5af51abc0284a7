"""Lower-triangular Toeplitz strategies: the square-root closed form and optimised banded
Toeplitz coefficients, plus the Toeplitz loss and its gradient shared with :mod:`.blt`.

A lower-triangular Toeplitz C is given by its first column ``c`` (``C[t, s] = c[t - s]``);
its inverse is Toeplitz with the power-series inverse of c, and products are truncated
convolutions.
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
from fedsim.privacy.matrix.structure import toeplitz_matrix as toeplitz_matrix
from fedsim.privacy.participation import Participation


def inverse_coefficients(coef: np.ndarray, n: int) -> np.ndarray:
    """First column of ``T(coef)^{-1}``: ``d`` with ``c * d = e_0`` (truncated to n)."""
    c = np.zeros(n)
    coef = np.asarray(coef, dtype=np.float64)[:n]
    c[: coef.shape[0]] = coef
    require(c[0] != 0, "coef[0]", c[0], "a non-zero leading coefficient")
    e0 = np.zeros(n)
    e0[0] = 1.0
    return scipy.linalg.solve_triangular(toeplitz_matrix(c, n), e0, lower=True)


def sqrt_coefficients(n: int) -> np.ndarray:
    """``c_j = binom(2j, j) / 4^j = prod_{i<=j} (2i - 1) / (2i)``: the coefficients of
    ``(1 - x)^{-1/2}``, so that ``T(c) T(c) = tri(n)`` (Fichtenberger, Henzinger & Upadhyay
    2023, "Constant Matters")."""
    n = check_rounds(n)
    j = np.arange(1, n)
    return np.concatenate([[1.0], np.cumprod((2 * j - 1) / (2 * j))])


def separated_sum(coef: np.ndarray, min_sep: int, participations: int) -> np.ndarray:
    """``sum_{i<k} C[:, i * min_sep]`` for Toeplitz C: the worst-case participation vector
    image when c is non-negative and non-increasing (arXiv 2405.13763, Thm. 2)."""
    n = coef.shape[0]
    total = np.zeros(n)
    for i in range(participations):
        total[i * min_sep :] += coef[: n - i * min_sep]
    return total


def toeplitz_loss_and_grad(
    coef: np.ndarray,
    workload: np.ndarray | None,
    min_sep: int,
    participations: int,
) -> tuple[float, np.ndarray]:
    """``L(c) = ||A T(c)^{-1}||_F^2 * ||sum_{i<k} T(c)[:, i sep]||^2 / n`` and ``dL/dc``.

    ``coef`` has length n. ``workload`` None means prefix sums, for which
    ``A T(c)^{-1} = T(cumsum(d))`` with ``d = c^{-1}`` and ``||T(beta)||_F^2 =
    sum_j (n - j) beta_j^2`` (O(n) after the inversion). The derivative of the inverse is
    ``dd = -d * dc * d`` (convolutions), so ``dL/dc_i = -sum_j g_j (d * d)_{j - i}``.
    """
    n = coef.shape[0]
    d = inverse_coefficients(coef, n)
    if workload is None:
        beta = np.cumsum(d)
        weight = n - np.arange(n)
        err = float(np.sum(weight * beta**2))
        g_beta = 2.0 * weight * beta
        g_d = np.cumsum(g_beta[::-1])[::-1]
    else:
        M = workload @ toeplitz_matrix(d, n)
        err = float(np.sum(M**2))
        R = 2.0 * (workload.T @ M)
        # dE/dd_j = sum of the j-th subdiagonal of R.
        g_d = np.array([np.trace(R, offset=-j) for j in range(n)])
    dd = np.convolve(d, d)[:n]
    g_c_err = -np.correlate(g_d, dd, mode="full")[n - 1 :][:n]
    v = separated_sum(coef, min_sep, participations)
    sens2 = float(v @ v)
    g_sens = np.zeros(n)
    for i in range(participations):
        g_sens[: n - i * min_sep] += 2.0 * v[i * min_sep :]
    loss = err * sens2 / n
    grad = (g_c_err * sens2 + err * g_sens) / n
    return loss, grad


def toeplitz_participation(participation: Participation | None, n: int, bands: int) -> tuple:
    """``(min_sep, k)`` used in the Toeplitz objective for ``participation``."""
    p = participation or Participation.single()
    if p.kind == "single":
        return 1, 1
    if p.kind == "fixed_epoch":
        require(n % p.epochs == 0, "epochs", p.epochs, f"a divisor of the number of rounds n = {n}")
        return n // p.epochs, int(p.epochs)
    return int(p.min_sep), p.participations(n)


def sqrt_factorization(n: int, workload: np.ndarray | None = None) -> Factorization:
    """The square-root factorization ``C = T(c)``, c as in :func:`sqrt_coefficients`.

    For prefix sums ``B = C`` (``C C = tri(n)``); for another workload ``B = A C^{-1}``.
    """
    n = check_rounds(n)
    A = check_workload(workload, n)
    coef = sqrt_coefficients(n)
    C = toeplitz_matrix(coef, n)
    params = {"coef": coef}
    if workload is None:
        return Factorization("sqrt", A, C, C.copy(), params)
    return from_square_encoder("sqrt", C, A, params)


def banded_toeplitz(
    n: int,
    bands: int,
    participation: Participation | None = None,
    workload: np.ndarray | None = None,
    max_iter: int = 500,
    progress: Progress | None = None,
) -> Factorization:
    """Optimised banded Toeplitz C: coefficients ``c_0 = 1, c_1..c_{b-1}`` minimising
    :func:`toeplitz_loss_and_grad` with float64 L-BFGS (McKenna 2024, "Scaling up the Banded
    Matrix Factorization Mechanism" -- banded Toeplitz strategies).

    Under multiple participations the columns a user can share must be orthogonal, so
    ``bands`` may not exceed the separation (``min_sep``, or n / epochs for fixed-epoch order).
    """
    n = check_rounds(n)
    require(
        isinstance(bands, (int, np.integer)) and 1 <= bands <= n,
        "bands",
        bands,
        f"an integer in [1, n = {n}]",
    )
    A = None if workload is None else check_workload(workload, n)
    sep, k = toeplitz_participation(participation, n, bands)
    require(
        k == 1 or bands <= sep,
        "bands",
        bands,
        f"at most the participation separation {sep} (columns one user shares orthogonal)",
    )
    start = sqrt_coefficients(bands)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        coef = np.zeros(n)
        coef[0] = 1.0
        coef[1:bands] = x
        loss, grad = toeplitz_loss_and_grad(coef, A, sep, k)
        return loss, grad[1:bands]

    coef = np.zeros(n)
    coef[0] = 1.0
    if bands > 1:
        coef[1:bands] = lbfgs(fun, start[1:], max_iter, progress=progress)
    C = toeplitz_matrix(coef, n)
    return from_square_encoder(
        "banded_toeplitz",
        C,
        check_workload(workload, n),
        {"coef": coef[:bands].copy(), "bands": int(bands)},
    )
