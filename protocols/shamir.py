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

Decoding. The shares of one block held by m members form a word of the Reed-Solomon code of
length m and dimension t + k (values at the members' points of the polynomials of degree
< t + k), whose minimum distance is d = m - t - k + 1. A word with at most the *radius*
floor((m - t - k) / 2) wrong entries has exactly one nearest codeword, which
:meth:`PackedShamir.decode` finds by Berlekamp-Welch decoding (Welch & Berlekamp, US patent
4,633,470, 1986) in polynomial time. Correcting is sound only against errors the radius
covers *including the adversary's*: tau colluding members can move the word to within
d - tau of another codeword (and so blame honest members there). With at most tau faulty
members, correcting e wrong shares is sound only when e + tau <= m - t - k, so ``decode``
corrects at most ``correctable = min(radius, m - t - k - tau)`` members (tau = ``max_faulty``,
by default the privacy threshold t: a larger coalition learns the secrets anyway; all t are
corrected once m >= 3t + k, the n >= 3t + 1 of robust reconstruction for k = 1) and
otherwise only detects: up to m - t - k - correctable wrong shares never pass unnoticed and
are never miscorrected. With m = t + k nothing can be checked (``verified`` is False).
Sharing is linear: the element-wise sum of two sharings is a sharing of the sum, and likewise
for public scalars.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property, lru_cache

import numpy as np

from protocols.field import DEFAULT_FIELD, MersenneField


class NotEnoughSharesError(ValueError):
    """Fewer than t + k shares: the secrets are information-theoretically hidden."""


class InconsistentSharesError(ValueError):
    """The given shares do not all lie on one polynomial of degree < t + k.

    ``blocks`` lists the block indices that disagree; ``suspects`` the member indices whose
    shares decoding found wrong (named only when the decoding is unique and sound, see
    :meth:`PackedShamir.decode`; empty otherwise).
    """

    def __init__(self, message: str, blocks: np.ndarray, suspects: tuple[int, ...]) -> None:
        super().__init__(message)
        self.blocks = blocks
        self.suspects = suspects


class UncorrectableSharesError(InconsistentSharesError):
    """The shares are inconsistent and correcting them would take more wrong members than the
    decoder may correct: detected, nobody named (``suspects == ()``)."""

    def __init__(self, message: str, blocks: np.ndarray) -> None:
        super().__init__(message, blocks, ())


@dataclass(frozen=True)
class Decoding:
    """Outcome of :meth:`PackedShamir.decode` from m answers.

    ``values``: the ``length`` secrets (field elements, int64). ``corrected``: the members
    (0-based indices, ascending) whose shares were wrong in some block and were corrected;
    named only when the decoding is unique and sound (at most ``correctable`` of them).
    ``verified``: False iff m == t + k (nothing could be checked). ``radius``:
    floor((m - t - k) / 2), the unique-decoding radius. ``correctable``:
    max(0, min(radius, m - t - k - max_faulty)), the most wrong members this decoding corrects.
    """

    values: np.ndarray
    corrected: tuple[int, ...]
    verified: bool
    radius: int
    correctable: int


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
        return _share_matrix(int(self.n), int(self.t), int(self.k), self.field.exponent)

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
        ``check``, the rows are decoded (:meth:`decode`): wrong shares raise
        :class:`InconsistentSharesError` naming the blocks and the members found wrong (callers
        leave those out and reconstruct again), or :class:`UncorrectableSharesError` naming
        nobody when they cannot be corrected soundly. Without ``check`` the first t + k rows are
        interpolated and nothing is verified.
        """
        if not check:
            shares, members = self._validate(shares, members)
            self._check_length(length, shares.shape[1])
            return self._secrets(shares, members, length)
        decoding, bad = self._decode(shares, members, length, None)
        if decoding.corrected:
            raise InconsistentSharesError(
                f"{bad.size} blocks do not lie on a polynomial of degree < t + k = "
                f"{self.threshold} (first blocks {bad[:5].tolist()}); shares of members "
                f"{list(decoding.corrected)} are wrong",
                bad,
                decoding.corrected,
            )
        return decoding.values

    def decode(self, shares, members, length: int, *, max_faulty: int | None = None) -> Decoding:
        """The first ``length`` secrets from the shares of ``members``, correcting wrong shares
        within the decoding radius (Reed-Solomon decoding, Berlekamp-Welch 1986).

        With m = len(members) answers (m >= t + k, one row of ``shares`` per member): every
        block is checked at once (interpolate from t + k shares, compare the rest); only the
        blocks that disagree are decoded, one Berlekamp-Welch solve each, until leaving out the
        members found wrong makes every block consistent. At most
        ``correctable = min(floor((m - t - k) / 2), m - t - k - max_faulty)`` members are
        corrected (``max_faulty``: the most members assumed faulty or colluding, default t);
        beyond that, any inconsistency raises :class:`UncorrectableSharesError` (nobody is
        named). With m = t + k nothing is checked and ``verified`` is False.
        """
        return self._decode(shares, members, length, max_faulty)[0]

    def decode_agreeing(self, shares, members, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Many sharings over the same ``members`` at once: ``shares`` is (m, count, blocks),
        sharing s in ``shares[:, s]``. Returns the first ``length`` secrets of every sharing
        ((count, length)) and which sharings' m shares lie on one polynomial of degree < t + k
        ((count,) bool). For those, the values are what :meth:`decode` gives with no member
        corrected (any t + k of their shares interpolate the same polynomial, so the order of
        ``members`` does not matter); the others' values are meaningless and must go through
        :meth:`decode`, which corrects or refuses them."""
        shares = self.field.asarray(shares, "shares")
        if shares.ndim != 3:
            raise ValueError(f"shares has shape {shares.shape}; allowed (members, count, blocks)")
        rows, count, blocks = shares.shape
        stacked, members = self._validate(shares.reshape(rows, count * blocks), members)
        self._check_length(length, blocks)
        base = tuple(members[: self.threshold].tolist())
        agree = np.ones(count, dtype=bool)
        if members.size > self.threshold:
            others = tuple(members[self.threshold :].tolist())
            predicted = self.field.matmul(self._lagrange(base, others), stacked[: self.threshold])
            differs = (predicted != stacked[self.threshold :]).reshape(-1, count, blocks)
            agree = ~np.any(differs, axis=(0, 2))
        weights = self._lagrange(base, "secrets")
        values = self.field.matmul(weights, stacked[: self.threshold])  # (k, count * blocks)
        values = values.reshape(self.k, count, blocks).transpose(1, 2, 0)
        return values.reshape(count, blocks * self.k)[:, :length], agree

    def check_consistency(self, shares, members) -> ConsistencyReport:
        """Degree check of every block, with the wrong members when :meth:`decode` can name
        them (``suspects``; empty when the shares cannot be corrected soundly)."""
        try:
            decoding, bad = self._decode(shares, members, 0, None)
        except UncorrectableSharesError as error:
            return ConsistencyReport(consistent=False, blocks=error.blocks)
        return ConsistencyReport(consistent=bad.size == 0, blocks=bad, suspects=decoding.corrected)

    def _decode(
        self, shares, members, length: int, max_faulty: int | None
    ) -> tuple[Decoding, np.ndarray]:
        """:meth:`decode`, also returning the indices of the blocks that disagreed."""
        shares, members = self._validate(shares, members)
        self._check_length(length, shares.shape[1])
        redundancy = members.size - self.threshold
        radius = redundancy // 2
        bound = self._faulty_bound(max_faulty)
        correctable = max(0, min(radius, redundancy - bound))
        bad = self._inconsistent_blocks(shares, members)
        wrong = self._locate_errors(shares, members, bad, correctable, bound)
        keep = np.setdiff1d(np.arange(members.size), wrong)
        decoding = Decoding(
            values=self._secrets(shares[keep], members[keep], length),
            corrected=tuple(sorted(int(members[i]) for i in wrong)),
            verified=redundancy > 0,
            radius=radius,
            correctable=correctable,
        )
        return decoding, bad

    def _locate_errors(
        self,
        shares: np.ndarray,
        members: np.ndarray,
        bad: np.ndarray,
        correctable: int,
        bound: int,
    ) -> np.ndarray:
        """Positions (rows) of the wrong shares, at most ``correctable`` of them (``bound``:
        the faulty members assumed, for the error message).

        Each round decodes the first block still inconsistent without the rows found so far
        and adds the rows where it differs from its codeword; each round adds at least one row
        (else that block would be consistent), so at most ``correctable`` + 1 rounds run. Every
        block is then within ``correctable`` <= radius of a codeword: the decoding is unique.
        """
        wrong = np.zeros(0, dtype=np.int64)
        pending = bad
        for _ in range(correctable + 1):
            if pending.size == 0:
                return wrong
            if correctable == 0:
                break
            found = self._berlekamp_welch(shares[:, pending[0]], members, correctable)
            if found is None or np.union1d(wrong, found).size > correctable:
                break
            wrong = np.union1d(wrong, found)
            keep = np.setdiff1d(np.arange(members.size), wrong)
            still = self._inconsistent_blocks(shares[np.ix_(keep, pending)], members[keep])
            pending = pending[still]
        if pending.size == 0:
            return wrong
        raise UncorrectableSharesError(
            f"{bad.size} of {shares.shape[1]} blocks do not lie on a polynomial of degree < "
            f"t + k = {self.threshold} (first blocks {bad[:5].tolist()}); the faulty members "
            f"cannot be singled out: more than {correctable} of the {members.size} answers "
            f"would need correcting (radius {(members.size - self.threshold) // 2}, less the "
            f"room kept for {bound} faulty or colluding members)",
            bad,
        )

    def _berlekamp_welch(
        self, received: np.ndarray, members: np.ndarray, errors: int
    ) -> np.ndarray | None:
        """Positions where ``received`` (one block: one value per member) differs from the
        polynomial of degree < t + k within ``errors`` of it; None when there is none.

        Berlekamp-Welch: a monic error locator E of degree ``errors`` and Q of degree
        < errors + t + k with Q(x_i) = y_i E(x_i) at every member's point x_i (m linear
        equations in 2 errors + t + k unknowns, solved mod p); the codeword is f = Q / E,
        unique when m >= 2 errors + t + k. Any solution gives the same f, so a locator with
        spurious roots never names an honest member: positions come from f, not from E.
        """
        f = self.field
        points = self.share_points[members]
        width = errors + self.threshold
        powers = f.vandermonde(points, width)  # x_i^0 .. x_i^(width - 1); errors < width
        scaled = f.mul(received[:, None], powers[:, : errors + 1])  # y_i x_i^j, j <= errors
        system = np.hstack([powers, f.neg(scaled[:, :errors])])
        solution = f.solve(system, scaled[:, errors])
        if solution is None:
            return None
        locator = [int(c) for c in solution[width:]] + [1]
        quotient, remainder = _divide(f.modulus, [int(c) for c in solution[:width]], locator)
        if any(remainder):
            return None
        codeword = f.evaluate(np.array(quotient, dtype=np.int64), points)
        mismatch = np.flatnonzero(codeword != received)
        return mismatch if mismatch.size <= errors else None

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

    def _secrets(self, shares: np.ndarray, members: np.ndarray, length: int) -> np.ndarray:
        """The first ``length`` secrets interpolated from the first t + k rows (unchecked)."""
        needed = self.blocks_for(length)
        weights = self._lagrange(tuple(members[: self.threshold].tolist()), "secrets")
        blocks = self.field.matmul(weights, shares[: self.threshold, :needed])
        return blocks.T.ravel()[:length]

    def _check_length(self, length, blocks: int) -> None:
        if (
            not isinstance(length, int | np.integer)
            or isinstance(length, bool)
            or not 0 <= length <= blocks * self.k
        ):
            raise ValueError(
                f"length={length!r} does not fit {blocks} blocks of k={self.k}; "
                f"allowed: an integer in 0..{blocks * self.k}"
            )

    def _faulty_bound(self, max_faulty) -> int:
        if max_faulty is None:
            return self.t
        if (
            not isinstance(max_faulty, int | np.integer)
            or isinstance(max_faulty, bool)
            or not 0 <= max_faulty <= self.n
        ):
            raise ValueError(
                f"max_faulty={max_faulty!r} must be an integer in [0, n={self.n}] "
                "(the most members assumed faulty or colluding) or None for t"
            )
        return int(max_faulty)

    def _validate(self, shares, members) -> tuple[np.ndarray, np.ndarray]:
        members = _member_indices(members)
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


@lru_cache(maxsize=64)
def _share_matrix(n: int, t: int, k: int, exponent: int) -> np.ndarray:
    """:attr:`PackedShamir.share_matrix`, computed once per (n, t, k, field) and read-only:
    every round's scheme of the same shape shares it."""
    field_ = MersenneField(exponent)
    secret_points = np.mod(-np.arange(k, dtype=np.int64), field_.modulus)
    share_points = np.arange(1, n + 1, dtype=np.int64)
    nodes = np.concatenate([secret_points, share_points[:t]])
    matrix = field_.lagrange_coefficients(nodes, share_points)
    matrix.flags.writeable = False
    return matrix


def _member_indices(members) -> np.ndarray:
    """``members`` as a flat int64 array, refusing anything that is not an integer index."""
    array = np.asarray(members)
    if array.dtype == object:
        if not all(
            isinstance(m, int | np.integer) and not isinstance(m, bool) for m in array.ravel()
        ):
            raise ValueError(f"members must be integer indices, got {members!r}")
        if any(not -(2**63) <= int(m) < 2**63 for m in array.ravel()):
            raise ValueError(f"members={members!r} must be indices in [0, n)")
    elif array.size and array.dtype.kind not in "iu":
        raise ValueError(f"members must be integer indices, got dtype {array.dtype}")
    elif array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
        raise ValueError(f"members={array.tolist()} must be indices in [0, n)")
    return array.astype(np.int64).ravel()


def _divide(p: int, numerator: list[int], denominator: list[int]) -> tuple[list[int], list[int]]:
    """Quotient and remainder of polynomials over F_p (coefficients lowest degree first;
    ``denominator`` monic), by schoolbook long division on Python integers."""
    remainder = list(numerator)
    degree = len(denominator) - 1
    quotient = [0] * max(len(remainder) - degree, 1)
    for shift in range(len(remainder) - 1 - degree, -1, -1):
        coefficient = remainder[shift + degree] % p
        quotient[shift] = coefficient
        if coefficient:
            for i, d in enumerate(denominator):
                remainder[shift + i] = (remainder[shift + i] - coefficient * d) % p
    return quotient, [c % p for c in remainder[:degree]]


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
