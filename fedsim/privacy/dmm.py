"""The integer mechanism a DMM run implements, and its privacy.

docs/dmm-design.md. A factorization A = B C
(:mod:`fedsim.privacy.matrix`) of the workload becomes the public integer strategy matrix

    M = round(2^f C)        (C square, lower-triangular, banded: BandMF, banded Toeplitz), or
    M = C, f = 0            (C the 0/1 matrix of the binary tree / Honaker's online tree).

Its rows are released through the rounds (row i in round r_i, its last non-zero column) as
``y_i = sum_s M[i, s] X_s + z_i`` with X_s the sum of round s's rounded client updates and
z_i the sum of the fresh discrete Gaussian noise shares N_Z(0, s^2)^D of the clients whose shares
round r_i combined (:mod:`protocols.dmm`). **M is the mechanism**: every number here is for M,
never for the real C it approximates. Non-banded C (sqrt, dense, BLT) are refused: each
committee would have to carry the partial sums of up to n - 1 open rows, i.e. the whole history,
and a real-valued streaming buffer (BLT) has no exact integer form.

Decoding: the server applies x_hat = D y with D M = I (``M^{-1}`` by forward substitution for the
banded M; ``A^{-1} B`` for the tree, B the tree's own decoder, so Honaker's variance-optimal
estimates come for free): x_hat = X + D z, post-processing, no privacy spent.

Privacy (proof sketch, **zero-out** neighbours, :data:`RELATION`; :func:`zcdp_epsilon`):
one client's rounded updates are zeroed in the rounds of its pattern while every client's
noise, its own included, stays in the releases -- KLS21 Prop. 14's setting. It is not
add/remove: removing the client removes its noise too, and a row whose sum carries one client
(``min_clients = 1``) would then be noise-free on one side (epsilon infinite); the count n_i
below is the number of noise shares present *with* the client, never one fewer.

1. **View.** The server (and any t members of each committee, and other clients) sees the
   releases Y = M X + Z (m x D integers), ciphertexts, public keys and at most t shares of each
   packed sharing. Shares held by any t members of a packed sharing of degree t + k - 1 are
   uniform whatever the secrets (Franklin-Yung); each resharing deals fresh sharings; the AEAD
   ciphertexts reveal nothing without the keys. So the view is a post-processing of Y (plus
   independent uniform values). Clients follow the protocol with their own secret noise (as in
   KLS21); a client that reveals its noise removes its share from the count below.
2. **Shift on the lattice.** A neighbouring dataset adds one client's rounded vectors u_s in the
   rounds s of a pattern the participation schema allows. Y moves by sum_{s in pattern} M[:, s]
   u_s^T: an *integer* matrix, because M and the u_s are integer. The noise Z has the full
   lattice Z^{m x D} as support, so the shift lies on the noise's lattice (the rule: a lattice
   noise protects only shifts that lie on its lattice; :mod:`protocols.dmm`).
3. **Sensitivities.** ||shift||_F <= sens(M) * Delta_2 with sens(M) the matrix sensitivity of
   M under the schema (:func:`fedsim.privacy.matrix.sensitivity.sensitivity`, exact or an
   upper bound), and ||shift||_1 <= kappa * Delta_1 with kappa = participations x the largest
   column L1 norm of M; Delta_2, Delta_1 bound one client's rounded vector (KLS21 conditional
   rounding, :class:`protocols.encoding.DDGaussEncoder`; rounding is redrawn until the bound
   holds, so it holds with certainty).
4. **Sum of discrete Gaussians.** Each coordinate of row i carries the sum of n_i >= n_min
   independent N_Z(0, s^2). KLS21 Prop. 14 / Thm. 1 bound the Renyi divergence of such a sum
   coordinate by coordinate; per coordinate its terms grow as the count shrinks in the Delta
   parts (Delta / (sqrt(n) s)) and as the count grows in tau(s, n), so taking n_min in the
   Delta parts and tau(s, n_max) bounds every coordinate: the release through round T is
   1/2 eps^2-zCDP with eps = min(sqrt(e2^2 + 2 e1 tau + tau^2 d), e2 + tau sqrt(d)),
   e2 = sens(M_T) Delta_2 / (sqrt(n_min) s), e1 = kappa_T Delta_1 / (sqrt(n_min) s), d = D x the
   rows released through T, M_T = M's rows released through T, columns < T.
5. **Noise actually present.** n_i counts the clients whose shares the members combined for
   row i (never the planned cohort): a client that drops contributes neither update nor noise,
   and a release with fewer clients costs more epsilon.
6. **Composition.** The whole run is one mechanism on the joint release, accounted as
   1/2 eps_T^2-zCDP; the ledger records increments ``ZCDpEvent`` with rho =
   (eps_T^2 - eps_{T-1}^2) / 2, so the RDP composition of the recorded events is exactly the
   1/2 eps_T^2 curve and converts it to (epsilon, delta) (:func:`increment_event`).
7. **Finite field.** Everything is exact in F_p while |y_i| < p/2, checked before the run
   (:func:`worst_release`); a wrap would be a deterministic function of the integer release
   (post-processing): it costs accuracy, never privacy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import dp_accounting as dpa
import numpy as np
import scipy.linalg

from fedsim.privacy import ddgauss as ddgauss_privacy
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.sensitivity import Sensitivity, sensitivity
from fedsim.privacy.participation import Participation

MAX_FRACTIONAL_BITS = 40
RELATION = "zero_out"
"""The neighbouring relation the bound proves (module docstring): one client's updates zeroed,
its noise shares kept."""


def banded_kinds() -> tuple[str, ...]:
    """The kinds whose C is banded by construction (:attr:`Kind.banded
    <fedsim.privacy.matrix.kind.Kind.banded>`): M = round(2^f C), any band count."""
    from fedsim.privacy.matrix.kinds import named_with  # noqa: PLC0415  (loads every kind)

    return named_with("banded")


def tree_kinds() -> tuple[str, ...]:
    """The kinds whose C is a 0/1 matrix (:attr:`Kind.zero_one_encoder
    <fedsim.privacy.matrix.kind.Kind.zero_one_encoder>`, the tree's): M = C, f = 0."""
    from fedsim.privacy.matrix.kinds import named_with  # noqa: PLC0415  (loads every kind)

    return named_with("zero_one_encoder")


def kinds() -> tuple[str, ...]:
    """Every kind DMM runs: the banded ones, then the 0/1 ones."""
    return (*banded_kinds(), *tree_kinds())


def release_rounds(M: np.ndarray) -> np.ndarray:
    """r_i: the round in which row i is released -- its last non-zero column."""
    nonzero = np.asarray(M) != 0
    if not np.all(nonzero.any(axis=1)):
        raise ValueError("the strategy matrix has an all-zero row")
    return M.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)


def bandwidth(C: np.ndarray) -> int:
    """b: the number of non-zero lower diagonals of a square lower-triangular C."""
    rows, cols = np.nonzero(np.abs(C) > 0)
    return int((rows - cols).max()) + 1 if rows.size else 0


@dataclass(frozen=True, eq=False)
class IntegerMechanism:
    """The integer strategy matrix M of a DMM run, its decoder and its sensitivities.

    ``factorization``: banded (square lower-triangular C of a banded kind, or with b < n bands)
    or the 0/1 tree;
    ``fractional_bits``: f in [1, 40] for banded C (M = round(2^f C)), 0 for the tree (M = C);
    ``participation``: the schema sens(M) is computed for.
    """

    factorization: Factorization
    fractional_bits: int
    participation: Participation = field(default_factory=Participation.single)

    def __post_init__(self) -> None:
        C, f, kind = self.factorization.encoder, self.fractional_bits, self.factorization.kind
        if isinstance(f, bool) or not isinstance(f, int | np.integer):
            raise ValueError(f"fractional_bits={f!r}; allowed: an integer")
        if self.is_tree:
            if f != 0:
                raise ValueError(
                    f"fractional_bits={f} for the {kind!r} factorization: its C is the 0/1 tree "
                    "matrix, which is already integer; allowed: 0 (M = C)"
                )
            return
        n = self.factorization.n
        square = C.shape == (n, n) and np.allclose(C, np.tril(C), rtol=0, atol=0)
        b = bandwidth(C) if square else n
        if not square or (b >= n and n > 1 and kind not in banded_kinds()):
            banded = " or ".join(repr(name) for name in banded_kinds())
            tree = " / ".join(repr(name) for name in tree_kinds())
            raise ValueError(
                f"factorization {kind!r} is not banded (bandwidth {b} of n = {n} rounds): DMM "
                "committees carry the partial sums of every open row of M = round(2^f C), i.e. "
                "the whole history for a non-banded C, and its noise must be added where the "
                f"query is integer (docs/dmm-design.md); use kind {banded} with bands < rounds, "
                f"or {tree}"
            )
        if not 1 <= f <= MAX_FRACTIONAL_BITS:
            raise ValueError(
                f"fractional_bits={f!r} for the banded {kind!r}; allowed: an integer in "
                f"[1, {MAX_FRACTIONAL_BITS}]"
            )
        if np.any(np.diag(self.integer_matrix) == 0):
            raise ValueError(
                f"fractional_bits={f} rounds a diagonal entry of C to 0: M = round(2^f C) is "
                "singular; raise fractional_bits"
            )

    @cached_property
    def is_tree(self) -> bool:
        """Whether C is a 0/1 tree matrix (several rows per round; M = C)."""
        C = self.factorization.encoder
        return self.factorization.kind in tree_kinds() and bool(np.all((C == 0) | (C == 1)))

    @property
    def n(self) -> int:
        """T, the rounds."""
        return self.factorization.n

    @cached_property
    def integer_matrix(self) -> np.ndarray:
        """M (m x T, int64)."""
        C = self.factorization.encoder
        if self.is_tree:
            return C.astype(np.int64)
        return np.rint(np.ldexp(C, self.fractional_bits)).astype(np.int64)

    @cached_property
    def rounds(self) -> np.ndarray:
        """r_i for every row of M."""
        return release_rounds(self.integer_matrix)

    def released_at(self, t: int) -> np.ndarray:
        return np.flatnonzero(self.rounds == t)

    @cached_property
    def decoding(self) -> np.ndarray | None:
        """D (T x m) with D M = I for the tree (A^{-1} B); None for the banded M (forward
        substitution in M)."""
        if not self.is_tree:
            return None
        fac = self.factorization
        return scipy.linalg.solve_triangular(fac.workload, fac.decoder, lower=True)

    def submatrix_through(self, rounds: int) -> np.ndarray:
        """M_T: the rows released in the first ``rounds`` rounds, columns < ``rounds``."""
        if not 1 <= rounds <= self.n:
            raise ValueError(f"rounds={rounds!r}; allowed: 1..{self.n}")
        return self.integer_matrix[self.rounds < rounds][:, :rounds]

    def sensitivity_through(self, rounds: int) -> Sensitivity:
        """sens(M_T) under the participation (restricted to those rounds)."""
        if rounds not in self._sens_cache:
            M = self.submatrix_through(rounds).astype(np.float64)
            self._sens_cache[rounds] = sensitivity(M, self.participation)
        return self._sens_cache[rounds]

    @cached_property
    def _sens_cache(self) -> dict[int, Sensitivity]:
        return {}

    @cached_property
    def sensitivity(self) -> Sensitivity:
        return self.sensitivity_through(self.n)

    def l1_growth_through(self, rounds: int) -> float:
        """kappa_T: participations x the largest column L1 norm of M_T."""
        M = self.submatrix_through(rounds)
        return self.participation.participations(rounds) * float(np.abs(M).sum(axis=0).max())

    @cached_property
    def max_row_l1(self) -> int:
        """max_i sum_s |M[i, s]|."""
        return int(np.abs(self.integer_matrix).sum(axis=1).max())


def zcdp_epsilon(
    mechanism: IntegerMechanism,
    rounds: int,
    l2_bound: float,
    l1_bound: float,
    scaled_std: float,
    counts: Sequence[int],
    dim: int,
) -> float:
    """eps with the release through ``rounds`` 1/2 eps^2-zCDP (module docstring, step 4).

    ``counts``: for every row released so far, the clients whose noise it carries;
    ``scaled_std``: s, each client's discrete Gaussian parameter (integer units, >= 1/2);
    ``l2_bound``, ``l1_bound``: Delta_2, Delta_1 of one client's rounded vector; ``dim``: D.
    Returns inf when a released row carries nobody's noise.
    """
    counts = [int(c) for c in counts]
    released = int(np.sum(mechanism.rounds < rounds))
    if len(counts) != released:
        raise ValueError(f"counts has {len(counts)} entries for {released} released rows")
    if not (math.isfinite(scaled_std) and scaled_std >= 0.5):
        raise ValueError(
            f"scaled_std={scaled_std!r}: KLS21 needs a per-client discrete Gaussian parameter "
            ">= 1/2 in integer units"
        )
    for name, value in (("l2_bound", l2_bound), ("l1_bound", l1_bound)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r}; allowed: finite and >= 0")
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim={dim!r}; allowed: a positive integer")
    if min(counts, default=0) <= 0:
        return math.inf
    fewest, most = min(counts), max(counts)
    central = math.sqrt(fewest) * scaled_std
    e2 = mechanism.sensitivity_through(rounds).value * l2_bound / central
    e1 = mechanism.l1_growth_through(rounds) * l1_bound / central
    tau = ddgauss_privacy.tau(scaled_std, most)
    d = int(dim) * released
    return min(math.sqrt(e2**2 + 2 * e1 * tau + tau * tau * d), e2 + tau * math.sqrt(d))


def increment_event(previous_eps: float, current_eps: float) -> dpa.DpEvent:
    """The ledger event that lifts a 1/2 eps_prev^2-zCDP run to 1/2 eps_now^2: a
    ``ZCDpEvent`` with rho = (eps_now^2 - eps_prev^2) / 2 (zCDP's rho adds under
    composition, Bun & Steinke 2016, Lemma 2.3)."""
    if math.isinf(current_eps):
        return dpa.NonPrivateDpEvent()
    growth = current_eps**2 - previous_eps**2
    if growth <= 1e-15 * max(current_eps**2, 1.0):
        return dpa.NoOpDpEvent()
    return dpa.ZCDpEvent(growth / 2)


def worst_release(
    mechanism: IntegerMechanism,
    clients: int,
    l2_bound: float,
    scaled_std: float,
    dim: int,
    failure_probability: float,
) -> float:
    """The largest |y_i| any coordinate of any released row can take (integer units), except
    with probability ``failure_probability`` per run: max_i ||M[i]||_1 * clients * Delta_2 (each
    client's rounded coordinate is at most Delta_2) plus the tail bound of the sum of ``clients``
    noise shares, sub-Gaussian with variance proxy clients * s^2 (Canonne, Kamath & Steinke
    2020, Cor. 9), union-bounded over every released coordinate."""
    if not 0 < failure_probability < 1:
        raise ValueError(f"failure_probability={failure_probability!r}; allowed: in (0, 1)")
    coordinates = int(dim) * mechanism.integer_matrix.shape[0]
    tail = scaled_std * math.sqrt(clients) * math.sqrt(
        2 * math.log(2 * coordinates / failure_probability)
    )
    return mechanism.max_row_l1 * clients * l2_bound + tail
