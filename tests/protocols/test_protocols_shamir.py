"""protocols.shamir: secrecy of every t-subset, reconstruction from every subset of size >= t+k,
tampered and too-few cases, Reed-Solomon decoding within its radius (closed forms), linearity,
and a 10^6-element run with its timing printed."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import numpy as np
import pytest

from protocols.field import DEFAULT_FIELD, MersenneField
from protocols.shamir import (
    Decoding,
    InconsistentSharesError,
    NotEnoughSharesError,
    PackedShamir,
    UncorrectableSharesError,
    linear_combination,
)


def _all_sharings(scheme: PackedShamir, block: list[int]) -> np.ndarray:
    """Every sharing of one block: one column per choice of the t random values."""
    p = scheme.field.modulus
    randomness = np.array(list(itertools.product(range(p), repeat=scheme.t)), dtype=np.int64).T
    secrets = np.repeat(np.array(block, dtype=np.int64)[:, None], randomness.shape[1], axis=1)
    return scheme.field.matmul(scheme.share_matrix, np.vstack([secrets, randomness]))


@pytest.mark.parametrize("n, t, k", [(5, 2, 2), (4, 2, 1), (6, 1, 3)])
def test_every_t_subset_is_identically_distributed(n, t, k):
    """Over all randomness, any t shares of two different blocks have the same distribution
    (each tuple of t field elements exactly once: uniform)."""
    scheme = PackedShamir(n=n, t=t, k=k, field=MersenneField(5))
    first = _all_sharings(scheme, [0] * k)
    second = _all_sharings(scheme, [30, 7, 1][:k])
    for subset in itertools.combinations(range(n), t):
        rows = list(subset)
        seen_first = Counter(map(tuple, first[rows].T.tolist()))
        seen_second = Counter(map(tuple, second[rows].T.tolist()))
        assert seen_first == seen_second
        assert set(seen_first.values()) == {1}


def test_t_plus_one_shares_do_depend_on_the_secret():
    """Sanity check of the secrecy test itself: with k = 1, t + 1 shares determine the secret."""
    scheme = PackedShamir(n=4, t=2, k=1, field=MersenneField(5))
    rows = [0, 1, 2]
    first = Counter(map(tuple, _all_sharings(scheme, [0])[rows].T.tolist()))
    second = Counter(map(tuple, _all_sharings(scheme, [9])[rows].T.tolist()))
    assert first != second


@pytest.mark.parametrize("n, t, k", [(7, 2, 2), (6, 3, 1), (8, 1, 4)])
def test_reconstruct_from_every_subset_of_size_at_least_t_plus_k(n, t, k):
    scheme = PackedShamir(n=n, t=t, k=k)
    rng = np.random.default_rng(n * 100 + t * 10 + k)
    p = scheme.field.modulus
    secrets = scheme.field.random(rng, 23)
    secrets[:3] = [0, p - 1, 1]
    shares = scheme.share(secrets, rng=rng)
    assert shares.shape == (n, scheme.blocks_for(23))
    for size in range(t + k, n + 1):
        for subset in itertools.combinations(range(n), size):
            order = rng.permutation(list(subset))
            recovered = scheme.reconstruct(shares[order], order, secrets.size)
            assert (recovered == secrets).all(), (size, subset)


@pytest.mark.parametrize("missing", [1, 2])
def test_too_few_shares_fail_loudly(missing):
    scheme = PackedShamir(n=7, t=2, k=3)
    shares = scheme.share(np.arange(9), rng=np.random.default_rng(0))
    members = list(range(scheme.threshold - missing))
    with pytest.raises(NotEnoughSharesError, match=r"needs t \+ k = 5 shares, got"):
        scheme.reconstruct(shares[members], members, 9)


def test_single_corrupted_share_is_detected_and_named_at_every_position():
    scheme = PackedShamir(n=9, t=2, k=3)
    rng = np.random.default_rng(5)
    secrets = scheme.field.random(rng, 30)
    shares = scheme.share(secrets, rng=rng)
    for member in range(scheme.n):
        for block in (0, 9):
            tampered = shares.copy()
            tampered[member, block] = (tampered[member, block] + 1) % scheme.field.modulus
            with pytest.raises(InconsistentSharesError) as caught:
                scheme.reconstruct(tampered, np.arange(scheme.n), secrets.size)
            assert caught.value.blocks.tolist() == [block]
            assert caught.value.suspects == (member,)


def test_corruption_with_one_spare_share_is_detected_but_not_attributed():
    scheme = PackedShamir(n=6, t=2, k=3)
    secrets = np.arange(12)
    shares = scheme.share(secrets, rng=np.random.default_rng(6))
    shares[2, 1] = (shares[2, 1] + 5) % scheme.field.modulus
    with pytest.raises(InconsistentSharesError, match="cannot be singled out") as caught:
        scheme.reconstruct(shares, np.arange(6), secrets.size)
    assert caught.value.suspects == ()
    # with exactly t + k shares nothing can be checked: a wrong share gives a wrong answer,
    # which is why callers pass more than t + k shares whenever they have them
    recovered = scheme.reconstruct(shares[:5], np.arange(5), secrets.size)
    assert not (recovered == secrets).all()


def test_two_corrupted_members_are_named():
    scheme = PackedShamir(n=10, t=2, k=2)
    secrets = np.arange(40)
    shares = scheme.share(secrets, rng=np.random.default_rng(7))
    shares[1, 3] = (shares[1, 3] + 1) % scheme.field.modulus
    shares[8, 5] = (shares[8, 5] + 2) % scheme.field.modulus
    report = scheme.check_consistency(shares, np.arange(10))
    assert not report.consistent
    assert report.blocks.tolist() == [3, 5]
    assert report.suspects == (1, 8)


def test_berlekamp_welch_corrects_a_line_by_hand():
    """t = k = 1 over F_31: f(x) = 3 + 2x at points 1..5 is (5, 7, 9, 11, 13); member 2's share
    replaced by 0 leaves one error, radius floor((5 - 2) / 2) = 1 and room for t = 1 faulty
    member (1 + 1 <= 3): decoding returns f(0) = 3 and names member 2 alone."""
    scheme = PackedShamir(n=5, t=1, k=1, field=MersenneField(5))
    received = np.array([5, 7, 0, 11, 13])
    decoding = scheme.decode(received, [0, 1, 2, 3, 4], 1)
    assert decoding == Decoding(
        values=decoding.values, corrected=(2,), verified=True, radius=1, correctable=1
    )
    assert decoding.values.tolist() == [3]
    # from four members (radius 1, 1 + t <= 2) still corrected; from three, radius 0: detected
    assert scheme.decode(received[:4], [0, 1, 2, 3], 1).corrected == (2,)
    with pytest.raises(UncorrectableSharesError, match="cannot be singled out") as caught:
        scheme.decode(received[:3], [0, 1, 2], 1)
    assert caught.value.suspects == () and caught.value.blocks.tolist() == [0]


def test_decoding_fields_from_t_plus_k_to_n_answers():
    scheme = PackedShamir(n=11, t=2, k=2)
    rng = np.random.default_rng(11)
    secrets = scheme.field.random(rng, 8)
    shares = scheme.share(secrets, rng=rng)
    for m in range(scheme.threshold, scheme.n + 1):
        members = rng.permutation(scheme.n)[:m]
        decoding = scheme.decode(shares[members], members, 8)
        redundancy = m - scheme.threshold
        assert (decoding.values == secrets).all() and decoding.corrected == ()
        assert decoding.verified == (m > scheme.threshold)
        assert decoding.radius == redundancy // 2
        assert decoding.correctable == max(0, min(redundancy // 2, redundancy - scheme.t))


def test_errors_in_different_blocks_are_corrected_together():
    """Members wrong in different blocks count together: 3 wrong members among 11 answers
    (radius 3, t = 2 leaves room for 3) are all corrected; a 4th is beyond and names nobody."""
    scheme = PackedShamir(n=11, t=2, k=2)
    rng = np.random.default_rng(12)
    secrets = scheme.field.random(rng, 40)
    shares = scheme.share(secrets, rng=rng)
    wrong = shares.copy()
    for member, block in ((1, 0), (6, 4), (9, 4), (6, 13)):
        wrong[member, block] = scheme.field.add(wrong[member, block], 1 + member)
    decoding = scheme.decode(wrong, np.arange(11), 40)
    assert decoding.corrected == (1, 6, 9) and (decoding.values == secrets).all()
    wrong[3, 19] = scheme.field.add(wrong[3, 19], 5)
    with pytest.raises(UncorrectableSharesError) as caught:
        scheme.decode(wrong, np.arange(11), 40)
    assert caught.value.suspects == () and caught.value.blocks.tolist() == [0, 4, 13, 19]


def test_max_faulty_trades_correction_for_detection():
    scheme = PackedShamir(n=9, t=3, k=2)  # 9 answers: 4 redundant, radius 2
    rng = np.random.default_rng(13)
    secrets = scheme.field.random(rng, 6)
    shares = scheme.share(secrets, rng=rng)
    shares[[2, 7], 1] = scheme.field.add(shares[[2, 7], 1], 99)
    members = np.arange(9)
    with pytest.raises(UncorrectableSharesError):  # t = 3 colluders: room to correct 1 only
        scheme.decode(shares, members, 6)
    decoding = scheme.decode(shares, members, 6, max_faulty=2)  # 2 + 2 <= 4
    assert decoding.corrected == (2, 7) and decoding.correctable == 2
    assert (decoding.values == secrets).all()
    for bad in (-1, 10, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_faulty"):
            scheme.decode(shares, members, 6, max_faulty=bad)


def test_t_plus_k_answers_are_returned_unverified():
    scheme = PackedShamir(n=6, t=2, k=2)
    shares = scheme.share(np.arange(4), rng=np.random.default_rng(14))
    shares[1, 0] = scheme.field.add(shares[1, 0], 1)
    decoding = scheme.decode(shares[:4], np.arange(4), 4)
    assert not decoding.verified and decoding.radius == 0 and decoding.corrected == ()
    assert not (decoding.values == np.arange(4)).all()  # nothing could be checked


@pytest.mark.parametrize(
    "members, length, match",
    [
        ([0.0, 1.0, 2.0, 3.0, 4.0], 4, "integer indices"),
        (["0", "1", "2", "3", "4"], 4, "integer indices"),
        ([0, 1, 2, 3, 4], 4.0, "length"),
        ([0, 1, 2, 3, 4], 7, "length"),
        ([0, 1, 2, 3, 4], True, "length"),
    ],
)
def test_decode_refuses_non_integer_members_and_lengths(members, length, match):
    scheme = PackedShamir(n=6, t=2, k=2)
    shares = scheme.share(np.arange(4), rng=np.random.default_rng(15))
    with pytest.raises(ValueError, match=match):
        scheme.decode(shares[:5], members, length)


@pytest.mark.parametrize(("n", "t", "k", "answers"), [(9, 3, 2, 8), (9, 3, 2, 5), (16, 7, 1, 12)])
def test_decode_agreeing_is_decode_of_each_sharing_and_flags_every_wrong_one(n, t, k, answers):
    """Sharings over one member set, batched: each agreeing sharing decodes as decode alone
    does (members in any order, edge values included); a sharing with one wrong share
    anywhere is flagged whenever there is a spare answer to catch it."""
    scheme = PackedShamir(n=n, t=t, k=k)
    field, rng = scheme.field, np.random.default_rng(21)
    length, count = 2 * k + 1, 9
    secrets = field.random(rng, (count, length))
    secrets[0, :2] = [0, field.modulus - 1]
    members = rng.permutation(n)[:answers]
    shares = np.stack([scheme.share(s, rng=rng)[members] for s in secrets], axis=1)
    wrong = {3: (0, 0), 7: (answers - 1, scheme.blocks_for(length) - 1)}
    for sharing, (row, block) in wrong.items():
        shares[row, sharing, block] = (shares[row, sharing, block] + 1) % field.modulus
    values, agree = scheme.decode_agreeing(shares, members, length)
    spare = answers > scheme.threshold
    assert agree.tolist() == [not (spare and s in wrong) for s in range(count)]
    for s in range(count):
        if s not in wrong:
            assert (values[s] == secrets[s]).all()
            assert (values[s] == scheme.decode(shares[:, s], members, length).values).all()
    with pytest.raises(ValueError, match=r"allowed \(members, count, blocks\)"):
        scheme.decode_agreeing(shares[:, 0], members, length)
    with pytest.raises(NotEnoughSharesError):
        scheme.decode_agreeing(shares[: scheme.threshold - 1], members[: scheme.threshold - 1], 1)


def test_sharing_is_linear():
    field = DEFAULT_FIELD
    scheme = PackedShamir(n=8, t=3, k=2)
    rng = np.random.default_rng(8)
    a = field.random(rng, 15)
    b = field.random(rng, 15)
    shares_a = scheme.share(a, rng=rng)
    shares_b = scheme.share(b, rng=rng)
    members = np.array([7, 0, 3, 5, 2])
    total = field.add(shares_a, shares_b)[members]
    assert (scheme.reconstruct(total, members, 15) == field.add(a, b)).all()
    scaled = field.mul(shares_a, field.modulus - 3)[members]
    assert (scheme.reconstruct(scaled, members, 15) == field.mul(a, field.modulus - 3)).all()
    combined = linear_combination(field, [2, 5], [shares_a, shares_b])
    expected = field.add(field.mul(a, 2), field.mul(b, 5))
    assert (scheme.reconstruct(combined, np.arange(8), 15) == expected).all()


def test_shamir_k1_and_secure_randomness():
    scheme = PackedShamir(n=5, t=2)
    secret = np.array([DEFAULT_FIELD.modulus - 1])
    shares = scheme.share(secret, secure=True)
    assert (scheme.reconstruct(shares[[4, 1, 2]], [4, 1, 2], 1) == secret).all()
    again = scheme.share(secret, secure=True)
    assert not (again == shares).all()


def test_same_seed_same_shares():
    scheme = PackedShamir(n=6, t=2, k=2)
    first = scheme.share(np.arange(10), rng=np.random.default_rng(3))
    second = scheme.share(np.arange(10), rng=np.random.default_rng(3))
    assert (first == second).all()


def test_invalid_parameters_and_arguments_are_named():
    with pytest.raises(ValueError, match=r"t \+ k = 4 \+ 3 exceeds n = 6"):
        PackedShamir(n=6, t=4, k=3)
    with pytest.raises(ValueError, match="t must be an integer >= 1"):
        PackedShamir(n=6, t=0)
    with pytest.raises(ValueError, match="do not fit in F_31"):
        PackedShamir(n=30, t=2, k=3, field=MersenneField(5))
    scheme = PackedShamir(n=5, t=2)
    with pytest.raises(ValueError, match="exactly one source of randomness"):
        scheme.share([1, 2])
    with pytest.raises(ValueError, match="exactly one source of randomness"):
        scheme.share([1, 2], rng=np.random.default_rng(0), secure=True)
    with pytest.raises(ValueError, match="secrets has entry -1"):
        scheme.share([-1], rng=np.random.default_rng(0))
    shares = scheme.share([1, 2], rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="distinct"):
        scheme.reconstruct(shares[[0, 0, 1]], [0, 0, 1], 2)
    with pytest.raises(ValueError, match=r"members=\[0, 1, 9\]"):
        scheme.reconstruct(shares[:3], [0, 1, 9], 2)
    with pytest.raises(ValueError, match="one row per member"):
        scheme.reconstruct(shares[:3], [0, 1, 2, 3], 2)


def test_million_elements_n20_t5_k5(capsys):
    """Sharing 10^6 elements is a few matrix products; the timing is printed, not asserted."""
    scheme = PackedShamir(n=20, t=5, k=5)
    rng = np.random.default_rng(9)
    secrets = scheme.field.random(rng, 1_000_000)
    start = time.perf_counter()
    shares = scheme.share(secrets, rng=rng)
    shared = time.perf_counter()
    members = rng.permutation(20)[: scheme.threshold]
    recovered = scheme.reconstruct(shares[members], members, secrets.size)
    reconstructed = time.perf_counter()
    checked = scheme.reconstruct(shares, np.arange(20), secrets.size)
    verified = time.perf_counter()
    assert (recovered == secrets).all() and (checked == secrets).all()
    with capsys.disabled():
        print(
            f"\n[shamir n=20 t=5 k=5, 10^6 elements] share {shared - start:.3f} s, "
            f"reconstruct from 10 {reconstructed - shared:.3f} s, "
            f"reconstruct+check from 20 {verified - reconstructed:.3f} s"
        )
