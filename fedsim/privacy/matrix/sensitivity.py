"""L2 sensitivity of a strategy matrix C under a participation schema.

One user's gradients enter the rounds in a participation pattern pi (a set of round indices);
the mechanism releases ``C x + z``, and the sensitivity is the largest ``||C (x - x')||_F``
over neighbouring streams, each differing gradient having norm <= 1 (Choquette-Choo et al.
2023, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning", Sec. 2). With
``X = C^T C``:

- single participation: ``sens = max_j ||C[:, j]||`` (exact);
- patterns pi with entries ``X[pi, pi] >= 0``: ``sens^2 = max_pi sum_{i, j in pi} X_ij``
  (exact: all gradients aligned), and ``sum |X_ij|`` bounds it from above for any X
  (Choquette-Choo et al. 2023b, "(Amplified) Banded Matrix Factorization", Eq. 5).

Schemas (:class:`~fedsim.privacy.participation.Participation`, fedsim's one participation
type): ``single``; ``min_sep`` -- at most k participations, any two
at least ``min_sep`` rounds apart (b-min-separation); ``fixed_epoch`` -- n = epochs * b rounds,
the user takes part in rounds r, r + b, ..., r + (epochs - 1) b for one r < b.

:func:`sensitivity` picks the exact method that applies and falls back to the dynamic-programming
upper bound; the returned :class:`Sensitivity` says which (``exact``, ``method``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsim.config import require
from fedsim.privacy.participation import Participation, rounds_per_epoch

#: Zero tolerance for "X_ij is zero / non-negative" tests on float64 Gram matrices.
_TOL = 1e-12


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity value, whether it is exact or an upper bound, and how it was computed."""

    value: float
    exact: bool
    method: str

    def __float__(self) -> float:
        return float(self.value)


def _as_matrix(C: np.ndarray, name: str = "C") -> np.ndarray:
    C = np.asarray(C, dtype=np.float64)
    require(C.ndim == 2 and min(C.shape) >= 1, name, C.shape, "a non-empty 2-D array")
    require(bool(np.all(np.isfinite(C))), name, "non-finite entries", "finite entries")
    return C


def column_norms(C: np.ndarray) -> np.ndarray:
    """``||C[:, j]||_2`` for every column j."""
    return np.linalg.norm(_as_matrix(C), axis=0)


def single_participation(C: np.ndarray) -> float:
    """Sensitivity under single participation: the largest column norm of C (exact)."""
    return float(column_norms(C).max())


def max_separated_sum(x: np.ndarray, min_sep: int, max_participations: int) -> float:
    """``max_pi sum_{i in pi} x_i`` over sets pi of at most k indices, ``min_sep`` apart.

    Dynamic programme of Choquette-Choo et al. 2023b, "(Amplified) Banded Matrix
    Factorization", Alg. 3 (VecSens): ``F[i, k] = max(x_i + F[i + sep, k - 1], F[i + 1, k])``,
    O(n k) time. The empty set is allowed, so the result is >= 0.
    """
    x = np.asarray(x, dtype=np.float64)
    n, sep = x.shape[0], int(min_sep)
    f = np.zeros(n + sep)
    for _ in range(int(max_participations)):
        g = f.copy()
        g[:n] = x + f[sep : sep + n]
        f = np.maximum.accumulate(g[::-1])[::-1]
    return float(f[0])


def min_sep_upper_bound(C: np.ndarray, min_sep: int, max_participations: int | None) -> float:
    """An upper bound on the b-min-separation sensitivity of any C (exact for banded C).

    Choquette-Choo et al. 2023b, Alg. 4: ``v_i = max_pi sum_{j in pi} |X_ij|`` row by row,
    then ``sens^2 <= max_pi sum_{i in pi} v_i``; O(n^2 k).
    """
    C = _as_matrix(C)
    n = C.shape[1]
    k = Participation.separated(min_sep, max_participations).participations(n)
    X = np.abs(C.T @ C)
    rows = np.array([max_separated_sum(X[i], min_sep, k) for i in range(n)])
    return float(np.sqrt(max_separated_sum(rows, min_sep, k)))


def is_separated_orthogonal(C: np.ndarray, min_sep: int) -> bool:
    """Whether every pair of columns one user can both use (``|i - j| >= min_sep``) is
    orthogonal, so that only ``diag(C^T C)`` enters the sensitivity.

    A lower-triangular C with at most ``min_sep`` bands has this property.
    """
    C = _as_matrix(C)
    n = C.shape[1]
    X = C.T @ C
    far = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) >= int(min_sep)
    scale = max(float(np.max(np.abs(np.diag(X)))), 1.0)
    return bool(np.all(np.abs(X[far]) <= _TOL * scale))


def toeplitz_coefficients(C: np.ndarray) -> np.ndarray | None:
    """``C[:, 0]`` if C is lower-triangular Toeplitz (to 1e-12 relative), else None."""
    C = _as_matrix(C)
    n = C.shape[0]
    if C.shape != (n, n):
        return None
    coef = C[:, 0]
    idx = np.subtract.outer(np.arange(n), np.arange(n))
    expected = np.where(idx >= 0, coef[np.maximum(idx, 0)], 0.0)
    scale = max(float(np.max(np.abs(coef))), 1e-300)
    return coef.copy() if np.max(np.abs(C - expected)) <= 1e-12 * scale else None


def toeplitz_min_sep(coef: np.ndarray, min_sep: int, max_participations: int | None) -> float:
    """Exact b-min-sep sensitivity of a lower-triangular Toeplitz C with coefficients ``coef``
    that are non-negative and non-increasing.

    The worst pattern is k participations exactly ``min_sep`` apart from round 0, so
    ``sens = ||sum_{i<k} C[:, i * min_sep]||`` (arXiv 2405.13763, Thm. 2); O(n) work.
    """
    c = np.asarray(coef, dtype=np.float64)
    require(bool(np.all(c >= -_TOL)), "coef", float(c.min()), "non-negative coefficients")
    require(
        bool(np.all(np.diff(c) <= _TOL * max(c[0], 1.0))),
        "coef",
        "an increase",
        "non-increasing coefficients",
    )
    n, sep = c.shape[0], int(min_sep)
    k = Participation.separated(sep, max_participations).participations(n)
    total = np.zeros(n)
    for i in range(k):
        total[i * sep :] += c[: n - i * sep]
    return float(np.linalg.norm(total))


def fixed_epoch(C: np.ndarray, epochs: int) -> Sensitivity:
    """Sensitivity under fixed-epoch order: ``max_r sqrt(sum_{i, j in pi_r} |X_ij|)``.

    ``pi_r = {r, r + b, ..., r + (epochs - 1) b}``, ``b = n / epochs``. Exact when every
    ``X[pi_r, pi_r]`` is non-negative or diagonal (Choquette-Choo et al. 2023, Sec. 2 and
    Eq. 5 of 2023b); an upper bound otherwise.
    """
    C = _as_matrix(C)
    n = C.shape[1]
    b = rounds_per_epoch(n, epochs)
    X = C.T @ C
    best, exact = 0.0, True
    for r in range(b):
        sub = X[r::b, r::b]
        off = sub - np.diag(np.diag(sub))
        scale = max(float(np.max(np.abs(np.diag(sub)))), 1.0)
        if np.any(off < -_TOL * scale):
            exact = False
        best = max(best, float(np.abs(sub).sum()))
    return Sensitivity(float(np.sqrt(best)), exact, "fixed_epoch")


def brute_force(C: np.ndarray, participation: Participation) -> float:
    """``max_pi sqrt(sum_{i, j in pi} X_ij)`` by enumerating every pattern (small n only).

    This is the sensitivity when ``X = C^T C`` is non-negative on every pattern; it refuses
    other C (their exact value is not a maximum over patterns alone).
    """
    C = _as_matrix(C)
    X = C.T @ C
    scale = max(float(np.max(np.abs(X))), 1.0)
    require(
        bool(np.all(X >= -_TOL * scale)),
        "C",
        "C^T C has negative entries",
        "a C with C^T C >= 0 elementwise for brute force",
    )
    best = max(float(X[np.ix_(p, p)].sum()) for p in participation.patterns(C.shape[1]))
    return float(np.sqrt(best))


def count_patterns(n: int, min_sep: int, max_participations: int) -> int:
    """Number of non-empty patterns of at most k rounds out of n, ``min_sep`` apart."""
    # ways[i][j]: patterns of size j whose first round is >= i.
    sep, k = int(min_sep), int(max_participations)
    ways = np.zeros((n + sep + 1, k + 1), dtype=object)
    ways[:, 0] = 1
    for i in range(n - 1, -1, -1):
        for j in range(1, k + 1):
            ways[i, j] = ways[i + 1, j] + ways[i + sep, j - 1]
    return int(sum(ways[0, 1:]))


def sensitivity(
    C: np.ndarray, participation: Participation, enumerate_limit: int = 20_000
) -> Sensitivity:
    """The sensitivity of C under ``participation``, exact where a method applies.

    Order of methods: single participation (max column norm); fixed-epoch order (exact when the
    pattern submatrices of X are non-negative or diagonal); for b-min-separation: columns a
    user can share orthogonal (banded C, ``min_sep >= bands``) -> the diagonal DP, exact;
    lower-triangular Toeplitz with non-negative non-increasing coefficients -> Thm. 2 of
    arXiv 2405.13763, exact; X >= 0 with at most ``enumerate_limit`` patterns -> enumeration,
    exact; otherwise the O(n^2 k) DP upper bound (``exact=False``).
    """
    C = _as_matrix(C)
    n = C.shape[1]
    if participation.kind == "single":
        return Sensitivity(single_participation(C), True, "max_column_norm")
    if participation.kind == "fixed_epoch":
        return fixed_epoch(C, participation.epochs)
    sep, k = int(participation.min_sep), participation.participations(n)
    if k == 1:
        return Sensitivity(single_participation(C), True, "max_column_norm")
    if is_separated_orthogonal(C, sep):
        d = np.sum(C * C, axis=0)
        return Sensitivity(float(np.sqrt(max_separated_sum(d, sep, k))), True, "banded_diag_dp")
    coef = toeplitz_coefficients(C)
    if (
        coef is not None
        and np.all(coef >= -_TOL)
        and np.all(np.diff(coef) <= _TOL * max(coef[0], 1.0))
    ):
        return Sensitivity(toeplitz_min_sep(coef, sep, k), True, "toeplitz_theorem")
    X = C.T @ C
    nonneg = bool(np.all(X >= -_TOL * max(float(np.max(np.abs(X))), 1.0)))
    if nonneg and count_patterns(n, sep, k) <= enumerate_limit:
        return Sensitivity(brute_force(C, participation), True, "enumeration")
    return Sensitivity(min_sep_upper_bound(C, sep, k), False, "dp_upper_bound")
