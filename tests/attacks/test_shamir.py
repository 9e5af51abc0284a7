"""Colluding members and garbage against packed Shamir decoding: framing an honest member,
choosing the secrets, a big committee with several wrong shares, random words against a
brute-force decoder, and fuzzed inputs. Reproduces ../shared/attacks/miscorrect.py and
shamir_mal.py; each test fails if the attack works."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.shamir import (
    InconsistentSharesError,
    PackedShamir,
    UncorrectableSharesError,
)


def framing_offsets(scheme: PackedShamir, members, colluders, framed) -> np.ndarray:
    """Offsets g(x) at the members' points of a degree < t + k polynomial g that vanishes at
    every member's point except the colluders' and the ``framed`` ones: added by the colluders,
    the word is as near to (codeword + g) as it is far from the truth (miscorrect.py)."""
    f = scheme.field
    points = scheme.share_points[np.asarray(members)]
    zeros = [points[i] for i, m in enumerate(members) if m not in colluders and m not in framed]
    assert len(zeros) <= scheme.threshold - 1
    g = np.ones(len(members), dtype=np.int64)
    for z in zeros:
        g = f.mul(g, f.sub(points, z))
    return f.mul(g, 1000)


def test_miscorrect_two_colluders_cannot_choose_the_release_or_blame_member_0():
    """../shared/attacks/miscorrect.py: n = 7, t = 3, k = 2, colluders 2 and 5 add g with
    g = 0 at members 1, 3, 4, 6. The word is one share away from a codeword with other secrets
    (wrong only at honest member 0); that used to be 'corrected', releasing the colluders'
    choice and naming member 0."""
    scheme = PackedShamir(7, 3, 2)
    secrets = DEFAULT_FIELD.encode_signed(np.array([10, 20, 30, 40]))
    shares = scheme.share(secrets, secure=True)
    g = framing_offsets(scheme, list(range(7)), {2, 5}, {0})
    rows = shares.copy()
    for m in (2, 5):
        rows[m] = scheme.field.add(rows[m], np.full(rows.shape[1], g[m]))
    for attempt in (scheme.decode, scheme.reconstruct):
        with pytest.raises(UncorrectableSharesError) as caught:
            attempt(rows, list(range(7)), 4)
        assert caught.value.suspects == ()
    report = scheme.check_consistency(rows, list(range(7)))
    assert not report.consistent and report.suspects == ()


@pytest.mark.parametrize("n, t, k", [(7, 2, 3), (8, 3, 2), (9, 3, 2), (11, 4, 2), (12, 5, 1)])
def test_no_coalition_of_t_can_frame_an_honest_member_or_move_the_secrets(n, t, k):
    """Coalitions of 1..t members (at most m - t - k: a larger one can move the word onto
    another codeword unseen, whatever the decoder) add the offsets that put the word as near
    as possible to a wrong codeword; for the largest ones that is within the unique-decoding
    radius (the old decoder took it). The outcome is the true secrets with exactly the
    colluders named, or detection naming nobody."""
    scheme = PackedShamir(n, t, k)
    rng = np.random.default_rng(n * 100 + t)
    secrets = scheme.field.random(rng, 2 * k)
    shares = scheme.share(secrets, rng=rng)
    members = list(range(n))
    radius = (n - scheme.threshold) // 2
    outcomes = Counter()
    for size in range(1, min(t, n - scheme.threshold) + 1):
        framed_count = n - scheme.threshold + 1 - size  # distance from the wrong codeword
        outcomes["framing within the radius"] += framed_count <= radius
        order = rng.permutation(n).tolist()
        colluders, framed = set(order[:size]), set(order[size : size + framed_count])
        g = framing_offsets(scheme, members, colluders, framed)
        rows = shares.copy()
        for m in colluders:
            rows[m] = scheme.field.add(rows[m], np.full(rows.shape[1], g[m]))
        try:
            decoding = scheme.decode(rows, members, secrets.size)
        except UncorrectableSharesError as error:
            assert error.suspects == ()
            outcomes["detected"] += 1
            continue
        assert (decoding.values == secrets).all()
        assert set(decoding.corrected) == colluders
        outcomes["corrected"] += 1
    assert outcomes["framing within the radius"] > 0


@pytest.mark.parametrize("wrong", [1, 2, 3])
def test_wrong_members_within_the_sound_radius_are_corrected_and_exactly_named(wrong):
    scheme = PackedShamir(12, 2, 3)  # 12 answers: radius 3, room for t = 2: corrects 3
    rng = np.random.default_rng(wrong)
    secrets = scheme.field.random(rng, 30)
    shares = scheme.share(secrets, rng=rng)
    culprits = sorted(rng.choice(12, wrong, replace=False).tolist())
    rows = shares.copy()
    rows[culprits] = scheme.field.add(rows[culprits], scheme.field.random(rng, (wrong, 10)) | 1)
    decoding = scheme.decode(rows, np.arange(12), 30)
    assert decoding.corrected == tuple(culprits) and (decoding.values == secrets).all()
    with pytest.raises(InconsistentSharesError) as caught:
        scheme.reconstruct(rows, np.arange(12), 30)
    assert caught.value.suspects == tuple(culprits)


def test_shamir_mal_cases():
    """../shared/attacks/shamir_mal.py: the exhaustive search gave up at n = 60 with 4 wrong
    shares (28 s, nobody named); decoding names exactly the 4 and returns the secrets."""
    scheme = PackedShamir(n=10, t=3, k=2)
    secrets = np.arange(1, 9, dtype=np.int64)
    shares = scheme.share(secrets, secure=True)

    def attempt(members, bad):
        rows = shares[members].copy()
        for b in bad:
            rows[members.index(b)] = scheme.field.add(rows[members.index(b)], 12345)
        return scheme.decode(rows, members, 8)

    unchecked = attempt([0, 1, 2, 3, 4], [2])
    assert not unchecked.verified and not (unchecked.values == secrets).all()
    for members, bad in (([0, 1, 2, 3, 4, 5], [2]), ([0, 1, 2, 3, 4, 5, 6], [2])):
        with pytest.raises(UncorrectableSharesError):  # 2 redundant: no room beside t = 3
            attempt(members, bad)
    for bad in ([2, 5], [0]):
        with pytest.raises(UncorrectableSharesError):
            attempt([0, 1, 2, 3, 4, 5, 6], bad)
    full = attempt(list(range(10)), [2, 5])
    assert full.corrected == (2, 5) and (full.values == secrets).all()
    with pytest.raises(ValueError, match="distinct"):
        scheme.decode(np.vstack([shares[[0, 1, 2, 3]], shares[[3]]]), [0, 1, 2, 3, 3], 8)
    big = PackedShamir(n=60, t=10, k=5)
    expected = np.arange(10, dtype=np.int64)
    rows = big.share(expected, secure=True)
    for b in (3, 17, 29, 44):
        rows[b] = big.field.add(rows[b], 1)
    decoding = big.decode(rows, list(range(60)), 10)
    assert decoding.corrected == (3, 17, 29, 44) and (decoding.values == expected).all()
    assert (decoding.radius, decoding.correctable) == (22, 22)


def _brute_force(scheme, points_rows, received, correctable):
    """The smallest set of rows (at most ``correctable``) whose removal leaves every block on
    one polynomial of degree < t + k, by trying every subset; None if there is none."""
    f, threshold = scheme.field, scheme.threshold
    m = received.shape[0]
    for size in range(correctable + 1):
        for removed in itertools.combinations(range(m), size):
            keep = [i for i in range(m) if i not in removed]
            nodes = points_rows[keep]
            if len(keep) > threshold:
                lagrange = f.lagrange_coefficients(nodes[:threshold], nodes[threshold:])
                predicted = f.matmul(lagrange, received[keep][:threshold])
                if not np.array_equal(predicted, received[keep][threshold:]):
                    continue
            return removed
    return None


def test_decoding_matches_a_brute_force_decoder_on_random_words(capsys):
    field = MersenneField(13)
    rng = np.random.default_rng(17)
    tally = Counter()
    for _ in range(400):
        n = int(rng.integers(3, 9))
        t = int(rng.integers(1, n))
        k = int(rng.integers(1, n - t + 1))
        scheme = PackedShamir(n, t, k, field)
        members = np.sort(rng.choice(n, int(rng.integers(t + k, n + 1)), replace=False))
        m, blocks = members.size, int(rng.integers(1, 4))
        rows = scheme.share(field.random(rng, blocks * k), rng=rng)[members]
        for row in rng.choice(m, int(rng.integers(0, m + 1)), replace=False):
            hit = rng.random(blocks) < 0.7
            rows[row, hit] = field.add(rows[row, hit], field.random(rng, int(hit.sum())) | 1)
        bound = None if rng.random() < 0.5 else int(rng.integers(0, n + 1))
        redundancy = m - t - k
        correctable = max(0, min(redundancy // 2, redundancy - (t if bound is None else bound)))
        expected = _brute_force(scheme, scheme.share_points[members], rows, correctable)
        try:
            decoding = scheme.decode(rows, members, blocks * k, max_faulty=bound)
        except UncorrectableSharesError:
            assert expected is None
            tally["detected"] += 1
            continue
        assert expected is not None
        assert decoding.corrected == tuple(int(members[i]) for i in expected)
        keep = [i for i in range(m) if i not in expected]
        again = scheme.decode(rows[keep], members[keep], blocks * k, max_faulty=bound)
        assert again.corrected == () and (again.values == decoding.values).all()
        tally["decoded"] += 1
    with capsys.disabled():
        print(f"\n[shamir decode vs brute force, 400 random words] {dict(tally)}")
    assert tally["detected"] > 50 and tally["decoded"] > 50


SHARE_MUTATIONS = [
    lambda s, rng, p: s.astype(np.float64),
    lambda s, rng, p: np.where(s == s.max(), p + int(rng.integers(0, 5)), s),
    lambda s, rng, p: -s - 1,
    lambda s, rng, p: np.full(s.shape, "x", dtype=object),
    lambda s, rng, p: s[..., None],
    lambda s, rng, p: rng.bytes(int(rng.integers(0, 40))),
    lambda s, rng, p: s[:-1],
    lambda s, rng, p: s.astype(np.uint64) + np.uint64(2**63),
]
MEMBER_MUTATIONS = [
    lambda m, rng: np.asarray(m, dtype=np.float64) + 0.5,
    lambda m, rng: [str(v) for v in m],
    lambda m, rng: np.r_[m[:-1], m[:1]],
    lambda m, rng: np.r_[m[:-1], int(rng.choice([-1, 99]))],
    lambda m, rng: m[: int(rng.integers(0, 4))],
    lambda m, rng: m.astype(np.uint64) + np.uint64(2**63),
]
BAD_LENGTHS = [-1, 10**6, 2.5, None, True, "4"]


def _fuzzed(rng, scheme):
    """(shares, members, length): a random word from a random set of members (well-formed),
    then, each with probability 0.3, a malformed share array, member list or length."""
    members = rng.permutation(scheme.n)[: int(rng.integers(scheme.threshold, scheme.n + 1))]
    blocks = int(rng.integers(1, 4))
    shares = scheme.share(scheme.field.random(rng, blocks * scheme.k), rng=rng)[members]
    if rng.random() < 0.5:  # random wrong shares in random places
        hit = rng.random(shares.shape) < 0.2
        shares[hit] = scheme.field.random(rng, int(hit.sum()))
    length = blocks * scheme.k
    if rng.random() < 0.3:
        mutate = SHARE_MUTATIONS[int(rng.integers(len(SHARE_MUTATIONS)))]
        shares = mutate(shares, rng, scheme.field.modulus)
    if rng.random() < 0.3:
        members = MEMBER_MUTATIONS[int(rng.integers(len(MEMBER_MUTATIONS)))](members, rng)
    if rng.random() < 0.3:
        length = BAD_LENGTHS[int(rng.integers(len(BAD_LENGTHS)))]
    return shares, members, length


def test_fuzzed_decoder_inputs_are_refused_cleanly(capsys):
    """Random words, shapes, dtypes, out-of-field values, non-integer, duplicate or unknown
    members and bad lengths: each ends in a ValueError (or a documented subclass) or in a
    result that decoding again from the members it kept confirms; nothing else."""
    scheme = PackedShamir(7, 2, 2)
    rng = np.random.default_rng(23)
    tally = Counter()
    for _ in range(1500):
        shares, members, length = _fuzzed(rng, scheme)
        tally["tried"] += 1
        try:
            decoding = scheme.decode(shares, members, length)
        except ValueError as error:
            tally["refused"] += 1
            tally[f"refused: {type(error).__name__}"] += 1
            with pytest.raises(type(error)):  # the other entry point refuses alike
                scheme.reconstruct(shares, members, length)
            continue
        kept = [i for i, m in enumerate(members) if m not in decoding.corrected]
        again = scheme.decode(np.asarray(shares)[kept], np.asarray(members)[kept], length)
        assert again.corrected == () and (again.values == decoding.values).all()
        if not decoding.corrected:
            assert (scheme.reconstruct(shares, members, length) == decoding.values).all()
        tally["decoded"] += 1
    with capsys.disabled():
        print(f"\n[fuzz shamir decode/reconstruct] {dict(tally)}")
    assert tally["tried"] == tally["refused"] + tally["decoded"]
    assert tally["refused"] > 300 and tally["decoded"] > 300
