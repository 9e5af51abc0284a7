"""Shamir and packed Shamir secret sharing over a Mersenne prime field, vectorised over blocks.

Packed sharing (Franklin & Yung, STOC 1992): a block of k secrets s_0..s_{k-1} is hidden in a
random polynomial f of degree at most t + k - 1 with f(-i) = s_i (the secret points 0, -1, ..,
-(k-1) mod p); member j (0-based) holds the share f(j + 1). Any t shares are uniformly
distributed whatever the secrets; any t + k shares determine f and hence the block. k = 1 is
Shamir's scheme (Shamir, CACM 1979) with the secret at 0.

A vector of L secrets is cut into ceil(L / k) blocks (zero-padded). The polynomial of a block is
fixed by its values at the k secret points and at the first t share points, the latter drawn
uniformly; all n shares are then one product of the precomputed (n, t + k) *share matrix* with
the (t + k, blocks) matrix of secrets and random values. Reconstruction is one product of a
(k, t + k) Lagrange matrix with t + k rows of shares.

With more than t + k shares the scheme also checks that all of them lie on one polynomial of
degree < t + k (the codewords of a Reed-Solomon code) and, when enough shares are present
(m >= t + k + 2e), names the e members whose shares disagree. Sharing is linear: the
element-wise sum of two sharings is a sharing of the sum, and likewise for public scalars.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property

import numpy as np

from protocols.field import DEFAULT_FIELD, MersenneField

MAX_SUSPECT_SEARCH = 5000
"""How many candidate sets of faulty members the error search may try before giving up."""


class NotEnoughSharesError(ValueError):
    """Fewer than t + k shares: the secrets are information-theoretically hidden."""


class InconsistentSharesError(ValueError):
    """The given shares do not all lie on one polynomial of degree < t + k.

    ``blocks`` lists the block indices that disagree; ``suspects`` the member indices whose
    removal makes every block consistent (empty when they cannot be singled out uniquely).
    """

    def __init__(self, message: str, blocks: np.ndarray, suspects: tuple[int, ...]) -> None:
        super().__init__(message)
        self.blocks = blocks
        self.suspects = suspects


@dataclass(frozen=True)
class ConsistencyReport:
    """Outcome of a degree check over m > t + k shares."""

    consistent: bool
    blocks: np.ndarray = dataclass_field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    suspects: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class PackedShamir:
    """Packed Shamir sharing with n members, privacy threshold t and k secrets per polynomial.

    ``n``: members (shares at points 1..n); ``t``: any t shares reveal nothing; ``k``: secrets
    per block. Reconstruction needs t + k shares, so up to n - t - k members may drop out.
    """

    n: int
    t: int
    k: int = 1
    field: MersenneField = DEFAULT_FIELD

    def __post_init__(self) -> None:
        for name, value, low in (("n", self.n, 1), ("t", self.t, 1), ("k", self.k, 1)):
            if not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.t + self.k > self.n:
            raise ValueError(
                f"t + k = {self.t} + {self.k} exceeds n = {self.n}: the n members could never "
                "reconstruct; allowed: t + k <= n"
            )
        if self.n + self.k > self.field.modulus:
            raise ValueError(
                f"n + k = {self.n + self.k} distinct evaluation points do not fit in "
                f"F_{self.field.modulus}; use a larger field"
            )

    @property
    def threshold(self) -> int:
        """Shares needed to reconstruct: t + k."""
        return self.t + self.k

    @cached_property
    def secret_points(self) -> np.ndarray:
        """The k points 0, -1, .., -(k-1) mod p where a block's secrets sit."""
        return np.mod(-np.arange(self.k, dtype=np.int64), self.field.modulus)

    @cached_property
    def share_points(self) -> np.ndarray:
        """Member j's evaluation point j + 1, for j = 0..n-1."""
        return np.arange(1, self.n + 1, dtype=np.int64)

    @cached_property
    def share_matrix(self) -> np.ndarray:
        """(n, t + k): shares = share_matrix @ [secrets (k rows); random values (t rows)].

        Column i < k is the Lagrange basis of secret point i, column k + j that of member j's
        point, on the nodes (secret points, first t share points), evaluated at all n points.
        """
        nodes = np.concatenate([self.secret_points, self.share_points[: self.t]])
        return self.field.lagrange_coefficients(nodes, self.share_points)

    def blocks_for(self, length: int) -> int:
        """Number of k-blocks a vector of ``length`` secrets occupies."""
        return -(-length // self.k)

    def share(
        self,
        secrets,
        *,
        rng: np.random.Generator | None = None,
        secure: bool = False,
    ) -> np.ndarray:
        """Shares of a vector of field elements: array (n, blocks); row j goes to member j.

        Randomness: ``rng`` (simulation, reproducible) or ``secure=True`` (OS CSPRNG), exactly
        one of the two.
        """
        secrets = self.field.asarray(secrets, "secrets").ravel()
        if secure == (rng is not None):
            raise ValueError(
                "pass exactly one source of randomness: rng=numpy.random.Generator for "
                f"simulation or secure=True for OS randomness (got rng={rng!r}, secure={secure})"
            )
        blocks = self.blocks_for(secrets.size)
        padded = np.zeros(blocks * self.k, dtype=np.int64)
        padded[: secrets.size] = secrets
        if secure:
            randomness = self.field.random_secure((self.t, blocks))
        else:
            randomness = self.field.random(rng, (self.t, blocks))
        inputs = np.vstack([padded.reshape(blocks, self.k).T, randomness])
        return self.field.matmul(self.share_matrix, inputs)

    def reconstruct(self, shares, members, length: int, *, check: bool = True) -> np.ndarray:
        """Secrets (first ``length``) from the shares of ``members`` (0-based indices).

        ``shares`` has one row per entry of ``members``. With more than t + k rows and
        ``check``, every row is verified to lie on the interpolated polynomials; a mismatch
        raises :class:`InconsistentSharesError` naming blocks and, if identifiable, members.
        """
        shares, members = self._validate(shares, members)
        if length < 0 or length > shares.shape[1] * self.k:
            raise ValueError(
                f"length={length} does not fit {shares.shape[1]} blocks of k={self.k}; "
                f"allowed: 0..{shares.shape[1] * self.k}"
            )
        if check and members.size > self.threshold:
            report = self.check_consistency(shares, members)
            if not report.consistent:
                who = (
                    f"shares of members {list(report.suspects)} are wrong"
                    if report.suspects
                    else "the faulty members cannot be singled out with these shares"
                )
                raise InconsistentSharesError(
                    f"{report.blocks.size} of {shares.shape[1]} blocks do not lie on a polynomial "
                    f"of degree < t + k = {self.threshold} (first blocks "
                    f"{report.blocks[:5].tolist()}); {who}",
                    report.blocks,
                    report.suspects,
                )
        used = members[: self.threshold]
        weights = self._lagrange(tuple(used.tolist()), "secrets")
        blocks = self.field.matmul(weights, shares[: self.threshold])
        return blocks.T.ravel()[:length]

    def check_consistency(self, shares, members) -> ConsistencyReport:
        """Degree check: interpolate from the first t + k shares, compare the rest.

        If blocks disagree, search the smallest set E of members (|E| <= (m - t - k) / 2, the
        unique-decoding radius) whose removal leaves every block consistent; report it when it
        is the only such set of its size.
        """
        shares, members = self._validate(shares, members)
        bad = self._inconsistent_blocks(shares, members)
        if bad.size == 0:
            return ConsistencyReport(consistent=True)
        bad_shares = shares[:, bad]
        suspects: tuple[int, ...] = ()
        max_errors = (members.size - self.threshold) // 2
        tried = 0
        for size in range(1, max_errors + 1):
            found = []
            for removed in itertools.combinations(range(members.size), size):
                tried += 1
                if tried > MAX_SUSPECT_SEARCH:
                    break
                keep = np.setdiff1d(np.arange(members.size), removed)
                if self._inconsistent_blocks(bad_shares[keep], members[keep]).size == 0:
                    found.append(tuple(int(members[i]) for i in removed))
            if found or tried > MAX_SUSPECT_SEARCH:
                if len(found) == 1:
                    suspects = found[0]
                break
        return ConsistencyReport(consistent=False, blocks=bad, suspects=suspects)

    def _inconsistent_blocks(self, shares: np.ndarray, members: np.ndarray) -> np.ndarray:
        if members.size <= self.threshold:
            return np.zeros(0, dtype=np.int64)
        base = tuple(members[: self.threshold].tolist())
        others = tuple(members[self.threshold :].tolist())
        predicted = self.field.matmul(self._lagrange(base, others), shares[: self.threshold])
        return np.flatnonzero(np.any(predicted != shares[self.threshold :], axis=0))

    def _lagrange(self, members: tuple[int, ...], targets) -> np.ndarray:
        """Cached Lagrange matrix from the given members' points to the secret points
        (``targets == "secrets"``) or to other members' points."""
        key = (members, targets)
        cache = self.__dict__.setdefault("_lagrange_cache", {})
        if key not in cache:
            nodes = self.share_points[list(members)]
            if targets == "secrets":
                points = self.secret_points
            else:
                points = self.share_points[list(targets)]
            if len(cache) > 256:
                cache.clear()
            cache[key] = self.field.lagrange_coefficients(nodes, points)
        return cache[key]

    def _validate(self, shares, members) -> tuple[np.ndarray, np.ndarray]:
        members = np.asarray(members, dtype=np.int64).ravel()
        shares = self.field.asarray(shares, "shares")
        if shares.ndim == 1:
            shares = shares[:, None]
        if shares.ndim != 2 or shares.shape[0] != members.size:
            raise ValueError(
                f"shares must have one row per member: shape {shares.shape} for "
                f"{members.size} members"
            )
        if members.size and (members.min() < 0 or members.max() >= self.n):
            raise ValueError(f"members={members.tolist()} must be indices in [0, n={self.n})")
        if np.unique(members).size != members.size:
            raise ValueError(f"members={members.tolist()} must be distinct")
        if members.size < self.threshold:
            raise NotEnoughSharesError(
                f"reconstruction needs t + k = {self.threshold} shares, got {members.size} "
                f"(members {members.tolist()})"
            )
        return shares, members


def linear_combination(field_: MersenneField, coefficients, sharings) -> np.ndarray:
    """sum_i coefficients[i] * sharings[i] (mod p): shares of the same combination of secrets.

    ``sharings`` is a sequence (or stacked array) of equally shaped share arrays held by the
    same members; ``coefficients`` are public field elements.
    """
    stacked = field_.asarray(np.asarray(sharings), "sharings")
    coefficients = field_.asarray(coefficients, "coefficients").ravel()
    if stacked.shape[0] != coefficients.size:
        raise ValueError(
            f"coefficients has {coefficients.size} entries for {stacked.shape[0]} sharings"
        )
    flat = stacked.reshape(stacked.shape[0], -1)
    return field_.matmul(coefficients[None, :], flat).reshape(stacked.shape[1:])
