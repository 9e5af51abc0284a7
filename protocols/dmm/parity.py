"""The checks of a linear packed resharing (:mod:`protocols.dmm.resharing`, step 4, VERIFY):
Lagrange coefficients of the dealers, the parity checks of the generalised Reed-Solomon code
their shares must satisfy, opening the syndromes from the new members' check shares and
locating the dealers whose shares are wrong (syndrome decoding by Berlekamp-Welch,
:meth:`protocols.shamir.PackedShamir.decode`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocols.kit import NEW_ID_BASE, TamperingDetected
from protocols.shamir import PackedShamir, UncorrectableSharesError


def reshare_coefficients(scheme: PackedShamir, dealers: Sequence[int]) -> np.ndarray:
    """(k, t + k) Lagrange matrix: secret j = sum_i L[j, i] s_{dealers[i]} (dealers 0-based)."""
    nodes = scheme.share_points[np.asarray(dealers, dtype=np.int64)]
    return scheme.field.lagrange_coefficients(nodes, scheme.secret_points)


def parity_checks(scheme: PackedShamir, members: Sequence[int]) -> np.ndarray:
    """(m - t - k, m) rows h_a[i] = v_i x_i^a with v_i = 1 / prod_{l != i} (x_i - x_l): every
    vector of values at the members' points of a polynomial of degree < t + k satisfies
    h_a . s = 0 (the dual of a Reed-Solomon code)."""
    p = scheme.field.modulus
    points = [int(scheme.share_points[i]) for i in members]
    rows = len(points) - scheme.threshold
    if rows <= 0:
        return np.zeros((0, len(points)), dtype=np.int64)
    weights = []
    for i, x in enumerate(points):
        denominator = 1
        for j, y in enumerate(points):
            if j != i:
                denominator = denominator * (x - y) % p
        weights.append(pow(denominator, p - 2, p))
    return np.array(
        [[weights[i] * pow(x, a, p) % p for i, x in enumerate(points)] for a in range(rows)],
        dtype=np.int64,
    )


def open_syndromes(
    new: PackedShamir, rows: np.ndarray, holders: Sequence[int], round_: int
) -> tuple[np.ndarray, bool]:
    """VERIFY, at the server: the syndromes from the new members' check shares ``rows`` (one
    row per holder, one column per parity check) by :meth:`PackedShamir.decode`, and whether
    the opening was verified (more than t' + k holders). New members whose check shares were
    wrong are named in a :class:`TamperingDetected`; inconsistent shares beyond the radius
    raise it naming nobody."""
    try:
        decoding = new.decode(rows, holders, rows.shape[1] * new.k)
    except UncorrectableSharesError as error:
        raise TamperingDetected(
            f"resharing of round {round_}: new members' check shares are inconsistent ({error})"
        ) from error
    if decoding.corrected:
        raise TamperingDetected(
            f"resharing of round {round_}: new members {list(decoding.corrected)} sent wrong "
            "check shares",
            tuple(NEW_ID_BASE + j for j in decoding.corrected),
        )
    return decoding.values[:: new.k], decoding.verified


def locate_faulty_dealers(
    old: PackedShamir, dealers: Sequence[int], syndromes, round_: int
) -> tuple[int, ...]:
    """The old members whose wrong shares explain the ``syndromes`` (one per parity check of
    :func:`parity_checks`); () when they are all zero.

    Syndrome decoding of the Reed-Solomon code: w, supported on the last m - t - k dealers, is
    the solution of H w = syndromes (those columns of H form an invertible Vandermonde matrix
    times a diagonal); w minus its nearest codeword is the error vector, found by
    :meth:`PackedShamir.decode` (Berlekamp-Welch) within its sound radius. Beyond it
    :class:`TamperingDetected` names nobody.
    """
    syndromes = old.field.asarray(syndromes, "syndromes").ravel()
    if not np.any(syndromes):
        return ()
    checks = parity_checks(old, dealers)
    redundancy = checks.shape[0]
    word = np.zeros(len(dealers), dtype=np.int64)
    word[len(dealers) - redundancy :] = old.field.solve(checks[:, -redundancy:], syndromes)
    try:
        return old.decode(word[:, None], list(dealers), 0).corrected
    except UncorrectableSharesError as error:
        raise TamperingDetected(
            f"resharing of round {round_}: the shares of old members {list(dealers)} do not "
            f"lie on one polynomial of degree < t + k = {old.threshold} and the faulty members "
            f"cannot be singled out ({redundancy} parity checks)"
        ) from error


def verify_dealings(
    old: PackedShamir,
    new: PackedShamir,
    rows: np.ndarray,
    holders: Sequence[int],
    dealers: Sequence[int],
    round_: int,
) -> tuple[tuple[int, ...], bool]:
    """VERIFY: (the old members found wrong, whether the check was verified). Syndromes that
    could not be verified (t' + k holders) name nobody: non-zero ones raise
    :class:`TamperingDetected`, zero ones pass unverified."""
    syndromes, opened_verified = open_syndromes(new, rows, holders, round_)
    if not opened_verified and np.any(syndromes):
        raise TamperingDetected(
            f"resharing of round {round_}: the parity checks of old members {list(dealers)} "
            f"failed, but only t' + k = {new.threshold} new members opened them, so the faulty "
            "members cannot be singled out"
        )
    return locate_faulty_dealers(old, dealers, syndromes, round_), opened_verified


def open_parity_checks(
    old: PackedShamir,
    new: PackedShamir,
    rows: np.ndarray,
    holders: Sequence[int],
    dealers: Sequence[int],
    checks: np.ndarray,
    round_: int,
) -> int | None:
    """:func:`verify_dealings` for callers that remove one dealer per DEAL: None when the
    dealings pass, else the first old member found wrong (``checks``: the parity checks the
    rows combine, of which there must be one per column)."""
    if checks.shape[0] != np.shape(rows)[-1]:
        raise ValueError(f"{checks.shape[0]} parity checks for {np.shape(rows)[-1]} columns")
    culprits, _ = verify_dealings(old, new, rows, holders, dealers, round_)
    return culprits[0] if culprits else None


def naive_reshare_elements(n_old_dealers: int, n_new: int, secrets: int) -> int:
    """Field elements an unpacked (k = 1) linear resharing sends: every dealer, one element per
    secret per new member."""
    return n_old_dealers * n_new * secrets
