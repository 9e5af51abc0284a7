"""The matrix a DMM committee actually implements, and its privacy.

Integer noising (reference/dmm.md step 4). A factorization A = B C (``fedsim.privacy.matrix``)
adds the noise G z to the gradient stream, G = A^{-1} B (n rounds x m noise rows; C^{-1} for a
square C). Committees can only apply integer coefficients to secret-shared integers, so they
apply

    M = round(2^f G)           (entries with t - r_j >= L set to 0 for a window of L rounds)

where r_j is the round in which noise row j is drawn (row j of C completes: its last non-zero
column). The server divides by 2^f, so the noise that reaches the gradients is G' z with
G' = M / 2^f, and the released stream x + G' z is the post-processing G'(C' x + z) of the
mechanism C' x + z for any C' with G' C' = I. We take

    C' = C + pinv(G') (I - G' C)

(C' = G'^{-1} when G' is square and invertible), check G' C' = I, and compute the
sensitivity of C' -- not of C -- exactly where :func:`fedsim.privacy.matrix.sensitivity.
sensitivity` can. Through round T, rows <= T of x + G' z do not depend on x_{>T}, so they are a
post-processing of C'[:, :T] x_{<=T} + z and epsilon so far uses sens(C'[:, :T]).

Privacy of one run (Gaussian-mechanism view of reference/dmm.md with KLS21's distributed
discrete Gaussian): each noise row is the sum of the discrete Gaussians N_Z(0, s^2) (integer
units, per coordinate) of the clients whose shares were combined in the round it was drawn. With
Delta_2, Delta_1 the rounding-inflated L2/L1 bounds of one client's integer vector
(:class:`protocols.encoding.DDGaussEncoder`), the run through T is
1/2 eps^2-zCDP by KLS21 Theorem 1 (:func:`fedsim.privacy.ddgauss.zcdp_epsilon`) with
l2 = sens_T Delta_2, l1 = kappa_T Delta_1 (kappa_T bounds the L1 growth: participations times the
largest column L1 norm of C'[:, :T]), dimension D times the noise rows drawn, and **count = the
fewest clients whose noise is in any noise row drawn so far** (the noise actually present,
never the planned cohort). The shift C'(x - x') is not integer when C' is not; like the paper's
Gaussian-mechanism view, the accounting treats it as a shift of the same size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import dp_accounting as dpa
import numpy as np

from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.sensitivity import (
    Participation,
    Sensitivity,
    count_patterns,
    sensitivity,
)

MAX_FRACTIONAL_BITS = 40
ENUMERATE_LIMIT = 20_000


def noise_rounds(C: np.ndarray) -> np.ndarray:
    """r_j: the round in which noise row j is drawn -- the last non-zero column of row j of C."""
    C = np.asarray(C, dtype=np.float64)
    nonzero = np.abs(C) > 0
    if not np.all(nonzero.any(axis=1)):
        raise ValueError("C has an all-zero row; every noise row must enter some round")
    return C.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)


@dataclass(frozen=True, eq=False)
class IntegerNoising:
    """M = round(2^f G) for a factorization, with the implemented C' and its sensitivity.

    ``fractional_bits``: f in [1, 40]; ``window``: keep only coefficients of noise drawn fewer
    than ``window`` rounds ago (None: all); ``participation``: the schema sens(C') is for.
    """

    factorization: Factorization
    fractional_bits: int
    window: int | None = None
    participation: Participation = field(default_factory=Participation.single)

    def __post_init__(self) -> None:
        f = self.fractional_bits
        if not isinstance(f, int | np.integer) or not 1 <= f <= MAX_FRACTIONAL_BITS:
            raise ValueError(
                f"fractional_bits={f!r}; allowed: an integer in [1, {MAX_FRACTIONAL_BITS}]"
            )
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window={self.window!r}; allowed: None or an integer >= 1")
        G = self.factorization.noising_matrix()
        if np.any(np.abs(G[self.rounds[None, :] > np.arange(self.n)[:, None]]) > 1e-9):
            raise ValueError(
                f"factorization {self.factorization.kind!r} uses noise before it is drawn; "
                "its noising matrix is not causal"
            )
        check = self.implemented_noising @ self.implemented_encoder
        if not np.allclose(check, np.eye(self.n), atol=1e-8):
            raise ValueError(
                f"fractional_bits={f} (window={self.window}) makes the integer noising matrix "
                f"of {self.factorization.kind!r} lose rank (max |G'C' - I| = "
                f"{np.max(np.abs(check - np.eye(self.n))):.3g}); raise fractional_bits"
            )

    @property
    def n(self) -> int:
        return self.factorization.n

    @cached_property
    def rounds(self) -> np.ndarray:
        """r_j for every noise row j."""
        return noise_rounds(self.factorization.encoder)

    def rows_drawn_at(self, t: int) -> np.ndarray:
        """Indices of the noise rows drawn in round t (0-based)."""
        return np.flatnonzero(self.rounds == t)

    @cached_property
    def integer_matrix(self) -> np.ndarray:
        """M (n x m, int64): round(2^f G) inside the window, 0 outside."""
        G = self.factorization.noising_matrix()
        M = np.rint(G * 2.0**self.fractional_bits)
        if self.window is not None:
            age = np.arange(self.n)[:, None] - self.rounds[None, :]
            M[age >= self.window] = 0.0
        M[self.rounds[None, :] > np.arange(self.n)[:, None]] = 0.0
        return M.astype(np.int64)

    @cached_property
    def implemented_noising(self) -> np.ndarray:
        """G' = M / 2^f (float64, exact: |M| < 2^53)."""
        return self.integer_matrix / 2.0**self.fractional_bits

    @cached_property
    def implemented_encoder(self) -> np.ndarray:
        """C' with G' C' = I (C' = G'^{-1} for square G')."""
        Gp = self.implemented_noising
        C = self.factorization.encoder
        if Gp.shape[0] == Gp.shape[1]:
            return np.linalg.solve(Gp, np.eye(self.n))
        return C + np.linalg.pinv(Gp) @ (np.eye(self.n) - Gp @ C)

    def needed_after(self, t: int) -> np.ndarray:
        """Noise rows drawn by round t with a non-zero coefficient in some round > t: the state
        a committee hands on after round t."""
        used = np.any(self.integer_matrix[t + 1 :] != 0, axis=0)
        return np.flatnonzero(used & (self.rounds <= t))

    def sensitivity_through(self, rounds: int) -> Sensitivity:
        """sens(C'[:, :rounds]) under the participation (restricted to those rounds)."""
        if not 1 <= rounds <= self.n:
            raise ValueError(f"rounds={rounds!r}; allowed: 1..{self.n}")
        if rounds not in self._sens_cache:
            self._sens_cache[rounds] = _tightest(
                self.implemented_encoder[:, :rounds], self.participation
            )
        return self._sens_cache[rounds]

    @cached_property
    def _sens_cache(self) -> dict[int, Sensitivity]:
        return {}

    @cached_property
    def sensitivity(self) -> Sensitivity:
        return self.sensitivity_through(self.n)

    def l1_growth_through(self, rounds: int) -> float:
        """kappa_T: participations times the largest column L1 norm of C'[:, :rounds]."""
        part = self.participation.participations(rounds)
        return part * float(np.abs(self.implemented_encoder[:, :rounds]).sum(axis=0).max())

    def max_row_l1(self) -> int:
        """max_t sum_j |M[t, j]|: how far w_t can amplify the largest noise row."""
        return int(np.abs(self.integer_matrix).sum(axis=1).max())


def _tightest(C: np.ndarray, participation: Participation) -> Sensitivity:
    """:func:`sensitivity`, and where that is only an upper bound and the patterns are few,
    the smaller of it and max over patterns of sqrt(sum |X_ij|) (X = C^T C; also an upper
    bound, Choquette-Choo et al. 2023b Eq. 5)."""
    found = sensitivity(C, participation)
    if found.exact or participation.kind != "min_sep":
        return found
    n = C.shape[1]
    k = participation.participations(n)
    if count_patterns(n, int(participation.min_sep), k) > ENUMERATE_LIMIT:
        return found
    X = np.abs(C.T @ C)
    best = max(float(np.sqrt(X[np.ix_(p, p)].sum())) for p in participation.patterns(n) if len(p))
    if best < found.value:
        return Sensitivity(best, False, "abs_enumeration")
    return found


def run_zcdp_epsilon(
    noising: IntegerNoising,
    rounds: int,
    l2_bound: float,
    l1_bound: float,
    scaled_std: float,
    fewest_clients: int,
    dim: int,
) -> float:
    """eps with the run through ``rounds`` 1/2 eps^2-zCDP (module docstring; inf if a noise
    row holds nobody's noise)."""
    if fewest_clients <= 0:
        return math.inf
    rows = int(np.sum(noising.rounds < rounds))
    return ddgauss_privacy.zcdp_epsilon(
        noising.sensitivity_through(rounds).value * l2_bound,
        noising.l1_growth_through(rounds) * l1_bound,
        scaled_std,
        int(fewest_clients),
        dim * rows,
    )


def increment_event(previous_eps: float, current_eps: float) -> dpa.DpEvent:
    """The ledger event that lifts a 1/2 eps_prev^2-zCDP run to 1/2 eps_now^2: a Gaussian with
    1/z^2 = eps_now^2 - eps_prev^2 (Gaussian precisions add under composition)."""
    if math.isinf(current_eps):
        return dpa.NonPrivateDpEvent()
    growth = current_eps**2 - previous_eps**2
    if growth <= 1e-15 * max(current_eps**2, 1.0):
        return dpa.NoOpDpEvent()
    return dpa.GaussianDpEvent(1.0 / math.sqrt(growth))
