"""Against the linear packed resharing (protocols.dmm.resharing): colluding old members who try to
get an honest dealer removed, a hostile new member who forges the parity check when it cannot
be verified, hostile dealers, a hostile relay and garbage arguments. Each test fails if an
honest member is blamed, a wrong sharing is handed over, or garbage gets anything but a clean
rejection (a removed dealer, ReshareAbort / TamperingDetected / ValueError / StageError with
the resharing left ABORTED)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from protocols.channels import Envelope
from protocols.dmm.parity import parity_checks
from protocols.dmm.resharing import ReshareAbort, ReshareFaults, ReshareStage, Resharing
from protocols.kit import NEW_ID_BASE, StageError, TamperingDetected
from protocols.shamir import PackedShamir


def shared(scheme, secrets, rng):
    return dict(enumerate(scheme.share(secrets, rng=rng)))


def secrets_of(scheme, result, length):
    rows = np.stack([result.shares[j] for j in result.holders])
    return scheme.reconstruct(rows, result.holders, length)


def test_colluding_dealers_cannot_get_an_honest_dealer_removed():
    """8 dealers, t + k = 5: 3 parity checks, radius 1. Colluders 2, 5, 7 (t = 3) add to
    their held shares the values of a degree < 5 polynomial vanishing at members 1, 3, 4, 6:
    the syndromes are exactly those of a single error at honest member 0, which the old
    single-error locator removed. Now: detected, nobody named, the resharing ABORTED."""
    scheme = PackedShamir(8, 3, 2)
    rng = np.random.default_rng(1)
    state = shared(scheme, scheme.field.random(rng, 6), rng)
    f, points = scheme.field, scheme.share_points
    for member in (2, 5, 7):
        value = 1000
        for zero in (1, 3, 4, 6):
            value = value * (int(points[member]) - int(points[zero])) % f.modulus
        state[member] = f.add(state[member], value)
    resharing = Resharing(scheme, scheme)
    with pytest.raises(TamperingDetected, match="cannot be singled out") as caught:
        resharing.run(state, rng=rng)
    assert caught.value.suspects == () and resharing.stage is ReshareStage.ABORTED


def test_an_unverifiable_parity_check_names_nobody():
    """Exactly t' + k new members hold the check shares, so nothing checks the opening: one of
    them shifts its check shares so that the syndromes point at honest old member 3. The
    resharing aborts naming nobody, instead of removing member 3."""
    old, new = PackedShamir(9, 2, 2), PackedShamir(8, 2, 2)
    rng = np.random.default_rng(2)
    state = shared(old, old.field.random(rng, 6), rng)
    holders = [0, 1, 2, 3]  # 4 of 8 new members gone: t' + k = 4 remain
    checks = parity_checks(old, list(range(9)))
    weights = new.field.lagrange_coefficients(new.share_points[holders], new.secret_points)
    wanted = new.field.mul(checks[:, 3], 77)  # the syndromes of an error at member 3
    shift = new.field.mul(wanted, new.field.inv(weights[0, 0]))  # holder 0's share in slot 0

    def forge(j, row):
        return new.field.add(row, shift) if j == 0 else row

    faults = ReshareFaults(new_drop=frozenset({4, 5, 6, 7}), rewrite_check=forge)
    resharing = Resharing(old, new)
    with pytest.raises(TamperingDetected, match="cannot be singled out") as caught:
        resharing.run(state, faults, rng=rng)
    assert caught.value.suspects == () and resharing.stage is ReshareStage.ABORTED
    # with all 8 new members the forgery is a wrong check share (radius 2, room for t' = 2):
    # its sender is named
    with pytest.raises(TamperingDetected, match="sent wrong check shares") as caught:
        Resharing(old, new).run(state, ReshareFaults(rewrite_check=forge), rng=rng)
    assert caught.value.suspects == (NEW_ID_BASE + 0,)


DEAL_GARBAGE = {
    "wrong length": lambda row: row[:-1],
    "too long": lambda row: np.r_[row, row],
    "float": lambda row: row.astype(np.float64),
    "out of field": lambda row: row + 2**61,
    "negative": lambda row: -row - 1,
    "2-D": lambda row: row[None, :],
    "bool": lambda row: row > 0,
    "empty": lambda row: row[:0],
    "bytes": lambda row: row.tobytes(),
    "object": lambda row: row.astype(object),
    "string": lambda row: row.astype(str),
}


@pytest.mark.parametrize("encrypt", [True, False])
def test_hostile_dealer_payloads_remove_that_dealer(encrypt, capsys):
    scheme = PackedShamir(9, 2, 2)
    rng = np.random.default_rng(3)
    secrets = scheme.field.random(rng, 8)
    state = shared(scheme, secrets, rng)
    tally = Counter()
    for kind, garble in DEAL_GARBAGE.items():
        def rewrite(old, new, row, garble=garble):
            return garble(row) if old == 1 and new in (2, 5) else row

        result = Resharing(scheme, scheme, encrypt=encrypt).run(
            state, ReshareFaults(rewrite_deal=rewrite), rng=rng
        )
        tally["tried"] += 1
        assert result.removed == (1,) and 1 not in result.dealers, kind
        assert np.array_equal(secrets_of(scheme, result, 8), secrets)
        tally["dealer removed"] += 1
    with capsys.disabled():
        print(f"\n[fuzz resharing DEAL payloads, encrypt={encrypt}] {dict(tally)}")


def _hostile_relay(rng, tally, earlier, rate):
    """What a hostile relay delivers in place of each envelope: itself, nothing, a copy, a
    forgery, a relabelled or retyped one, one from an earlier resharing, or junk."""

    def relay(envelope):
        tally["envelopes"] += 1
        kind = int(rng.integers(1, 12)) if rng.random() < rate else 0
        tally[f"kind {kind}"] += 1
        earlier.append(envelope)
        replace = dataclasses.replace
        return {
            0: lambda: [envelope],
            1: lambda: [],
            2: lambda: [envelope, envelope],
            3: lambda: [replace(envelope, ciphertext=rng.bytes(len(envelope.ciphertext)))],
            4: lambda: [replace(envelope, round=envelope.round + 1)],
            5: lambda: [replace(envelope, stage="VERIFY")],
            6: lambda: [replace(envelope, sender=envelope.sender + 1)],
            7: lambda: [replace(envelope, sender=12345)],
            8: lambda: [replace(envelope, sender="1", nonce=None)],
            9: lambda: [earlier[int(rng.integers(len(earlier)))], envelope],
            10: lambda: [b"junk", None, envelope],
            11: lambda: [Envelope(envelope.sender, envelope.receiver, 0, "DEAL", bytes(12), b"")],
        }[kind]()

    return relay


def test_a_hostile_relay_never_changes_the_secrets(capsys):
    """A relay that drops, duplicates, forges, relabels, redirects, replays (also from earlier
    resharings) and injects junk: every resharing hands over the original secrets with some
    dealers removed, or aborts cleanly (ReshareAbort, ABORTED); nothing else."""
    rng = np.random.default_rng(4)
    scheme = PackedShamir(10, 2, 2)
    tally, earlier = Counter(), []
    for attempt in range(30):
        secrets = scheme.field.random(rng, 6)
        state = shared(scheme, secrets, rng)
        resharing = Resharing(scheme, scheme, round_=attempt % 3)
        rate = (0.005, 0.02, 0.2)[attempt % 3]  # share of envelopes the relay meddles with
        faults = ReshareFaults(relay=_hostile_relay(rng, tally, earlier, rate))
        try:
            result = resharing.run(state, faults, rng=rng)
        except ReshareAbort as error:
            assert error.side == "old" and resharing.stage is ReshareStage.ABORTED
            tally["aborted"] += 1
            continue
        assert np.array_equal(secrets_of(scheme, result, 6), secrets)
        tally["handed over"] += 1
        tally["dealers removed"] += len(result.removed)
    with capsys.disabled():
        print(f"\n[fuzz resharing hostile relay] {dict(sorted(tally.items()))}")
    assert tally["handed over"] > 0 and tally["dealers removed"] > 0


CHECK_GARBAGE = [
    lambda row: row.tobytes(),
    lambda row: row[:-1],
    lambda row: row.astype(np.float64),
    lambda row: row + 2**61,
    lambda row: row[None, :],
    lambda row: None,
]


def test_garbage_check_shares_name_the_new_member():
    scheme = PackedShamir(8, 2, 2)
    rng = np.random.default_rng(5)
    state = shared(scheme, scheme.field.random(rng, 4), rng)
    for garble in CHECK_GARBAGE:
        resharing = Resharing(scheme, scheme)
        faults = ReshareFaults(rewrite_check=lambda j, row, g=garble: g(row) if j == 6 else row)
        with pytest.raises(TamperingDetected, match="new member 6") as caught:
            resharing.run(state, faults, rng=rng)
        assert caught.value.suspects == (NEW_ID_BASE + 6,)
        assert resharing.stage is ReshareStage.ABORTED


BAD_STATES = [
    {},
    [np.zeros(3, dtype=np.int64)],
    {0: np.zeros(3, dtype=np.int64), 1: np.zeros(4, dtype=np.int64)},
    {"0": np.zeros(3, dtype=np.int64)},
    {-1: np.zeros(3, dtype=np.int64)},
    {0: np.zeros(3)},
    {0: np.full(3, 2**61 - 1)},
    {0: np.array(["a", "b"])},
    {0: None},
]


def test_bad_arguments_and_stages_are_refused_and_leave_it_aborted():
    scheme = PackedShamir(6, 2, 2)
    rng = np.random.default_rng(6)
    for state in BAD_STATES:
        resharing = Resharing(scheme, scheme)
        with pytest.raises(ValueError):
            resharing.run(state, rng=rng)
        assert resharing.stage is ReshareStage.ABORTED
        with pytest.raises(StageError):  # a resharing runs once
            resharing.run(shared(scheme, np.arange(4), rng), rng=rng)
    resharing = Resharing(scheme, scheme)
    resharing.run(shared(scheme, np.arange(4), rng), rng=rng)
    with pytest.raises(StageError, match="DONE"):
        resharing.run(shared(scheme, np.arange(4), rng), rng=rng)
