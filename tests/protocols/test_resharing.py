"""Linear packed resharing: correctness over surviving sets, aborts, tampering, traffic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from protocols.dmm.parity import naive_reshare_elements, parity_checks
from protocols.dmm.resharing import (
    TRANSITIONS,
    ReshareAbort,
    ReshareFaults,
    ReshareStage,
    Resharing,
    check_transition,
)
from protocols.field import MersenneField
from protocols.kit import StageError, TamperingDetected
from protocols.shamir import NotEnoughSharesError, PackedShamir


def _shared(scheme, secrets, rng):
    shares = scheme.share(secrets, rng=rng)
    return {j: shares[j] for j in range(scheme.n)}


def test_every_stage_pair_is_checked():
    for current, target in itertools.product(ReshareStage, ReshareStage):
        if target in TRANSITIONS[current]:
            check_transition(current, target, "r")
        else:
            with pytest.raises(StageError, match=current.name):
                check_transition(current, target, "r")


def test_parity_checks_vanish_on_codewords():
    scheme = PackedShamir(9, 3, 2)
    rng = np.random.default_rng(0)
    shares = scheme.share(scheme.field.random(rng, 6), rng=rng)
    members = [0, 2, 3, 5, 6, 7, 8]
    h = parity_checks(scheme, members)
    assert h.shape == (len(members) - scheme.threshold, len(members))
    assert not np.any(scheme.field.matmul(h, shares[members]))
    shares[3, 0] = (shares[3, 0] + 1) % scheme.field.modulus
    assert np.any(scheme.field.matmul(h, shares[members]))


@pytest.mark.parametrize("encrypt", [True, False])
def test_any_surviving_set_reconstructs_the_same_secrets_over_hops(encrypt):
    field = MersenneField(61)
    old = PackedShamir(7, 2, 2, field)
    new = PackedShamir(8, 3, 2, field)
    rng = np.random.default_rng(1)
    secrets = field.random(rng, 9)
    state = _shared(old, secrets, rng)
    schemes = [old, new, old, new]
    for hop, (a, b) in enumerate(itertools.pairwise(schemes)):
        drop_old = {hop % a.n, (hop + 3) % a.n}
        result = Resharing(a, b, round_=hop, encrypt=encrypt).run(
            {i: s for i, s in state.items() if i not in drop_old},
            ReshareFaults(new_drop=frozenset({(hop + 1) % b.n})),
            rng=rng,
        )
        assert result.verified
        state = result.shares
        # every (t + k)-subset of the holders gives the same secrets
        for subset in itertools.combinations(result.holders, b.threshold):
            rows = np.stack([state[j] for j in subset])
            assert np.array_equal(b.reconstruct(rows, subset, secrets.size), secrets)


def test_secure_randomness_path():
    old = PackedShamir(6, 2, 2)
    new = PackedShamir(6, 2, 2)
    secrets = np.arange(5, dtype=np.int64)
    state = {j: s for j, s in enumerate(old.share(secrets, secure=True))}
    result = Resharing(old, new).run(state, secure=True)
    rows = np.stack([result.shares[j] for j in result.holders])
    assert np.array_equal(new.reconstruct(rows, result.holders, 5), secrets)
    with pytest.raises(ValueError, match="exactly one source"):
        Resharing(old, new).run(state)


@pytest.mark.parametrize("side", ["old", "new"])
def test_below_threshold_aborts_naming_needed_and_answered(side):
    scheme = PackedShamir(7, 2, 3)
    rng = np.random.default_rng(2)
    state = _shared(scheme, scheme.field.random(rng, 6), rng)
    gone = frozenset(range(3))  # 4 remain < t + k = 5
    faults = ReshareFaults(old_drop=gone) if side == "old" else ReshareFaults(new_drop=gone)
    resharing = Resharing(scheme, scheme)
    with pytest.raises(ReshareAbort, match="t \\+ k = 5 needed") as caught:
        resharing.run(state, faults, rng=rng)
    assert (caught.value.side, caught.value.needed, caught.value.answered) == (side, 5, 4)
    assert resharing.stage is ReshareStage.ABORTED


def test_dealer_dropping_mid_deal_is_retried_without_it():
    scheme = PackedShamir(8, 2, 2)
    rng = np.random.default_rng(3)
    secrets = scheme.field.random(rng, 7)
    state = _shared(scheme, secrets, rng)
    result = Resharing(scheme, scheme).run(
        state, ReshareFaults(old_drop_deal=frozenset({0, 1})), rng=rng
    )
    assert result.attempts == 2 and set(result.removed) == {0, 1}
    assert not {0, 1} & set(result.dealers)
    rows = np.stack([result.shares[j] for j in result.holders])
    assert np.array_equal(scheme.reconstruct(rows, result.holders, 7), secrets)
    # the failed attempt's traffic stays counted
    assert result.transcript.messages(stage=ReshareStage.DEAL) > 8 * 8


def test_share_corrupted_in_transit_removes_its_dealer():
    scheme = PackedShamir(8, 2, 2)
    rng = np.random.default_rng(4)
    secrets = scheme.field.random(rng, 4)
    state = _shared(scheme, secrets, rng)
    result = Resharing(scheme, scheme).run(
        state, ReshareFaults(corrupt_in_transit=frozenset({(1, 5)})), rng=rng
    )
    assert result.removed == (1,)
    rows = np.stack([result.shares[j] for j in result.holders])
    assert np.array_equal(scheme.reconstruct(rows, result.holders, 4), secrets)


def test_tampered_share_is_named_and_removed_when_locatable():
    scheme = PackedShamir(9, 2, 2)  # m = 9 >= t + k + 2: the error can be located
    rng = np.random.default_rng(5)
    secrets = scheme.field.random(rng, 10)
    state = _shared(scheme, secrets, rng)
    for culprit in (0, 4, 8):
        result = Resharing(scheme, scheme).run(
            state, ReshareFaults(tamper=frozenset({culprit}), seed=culprit), rng=rng
        )
        assert result.removed == (culprit,)
        rows = np.stack([result.shares[j] for j in result.holders])
        assert np.array_equal(scheme.reconstruct(rows, result.holders, 10), secrets)


def test_tampering_is_located_within_the_radius_and_aborts_beyond_it():
    scheme = PackedShamir(6, 2, 3)  # m = t + k + 1: detection only
    rng = np.random.default_rng(6)
    state = _shared(scheme, scheme.field.random(rng, 6), rng)
    with pytest.raises(TamperingDetected, match="cannot be singled out"):
        Resharing(scheme, scheme).run(state, ReshareFaults(tamper=frozenset({2})), rng=rng)
    scheme = PackedShamir(9, 2, 2)  # 5 parity checks: 2 wrong dealers located, 3 are not
    secrets = scheme.field.random(rng, 6)
    state = _shared(scheme, secrets, rng)
    result = Resharing(scheme, scheme).run(state, ReshareFaults(tamper=frozenset({1, 5})), rng=rng)
    assert result.removed == (1, 5) and result.attempts == 2 and result.verified
    rows = np.stack([result.shares[j] for j in result.holders])
    assert np.array_equal(scheme.reconstruct(rows, result.holders, 6), secrets)
    resharing = Resharing(scheme, scheme)
    with pytest.raises(TamperingDetected, match="cannot be singled out") as caught:
        resharing.run(state, ReshareFaults(tamper=frozenset({1, 5, 7})), rng=rng)
    assert caught.value.suspects == () and resharing.stage is ReshareStage.ABORTED


def test_too_few_holders_cannot_reconstruct():
    scheme = PackedShamir(7, 2, 2)
    rng = np.random.default_rng(7)
    state = _shared(scheme, scheme.field.random(rng, 4), rng)
    result = Resharing(scheme, scheme).run(state, rng=rng)
    few = result.holders[: scheme.threshold - 1]
    with pytest.raises(NotEnoughSharesError):
        scheme.reconstruct(np.stack([result.shares[j] for j in few]), few, 4)


def test_packed_bytes_per_secret_flat_in_n_naive_linear():
    rng = np.random.default_rng(8)
    packed, naive = [], []
    for n in (10, 20, 40):
        t, k = n // 5, n // 5  # k grows with n
        scheme = PackedShamir(n, t, k)
        secrets = scheme.field.random(rng, 20 * k)
        result = Resharing(scheme, scheme, encrypt=False).run(
            _shared(scheme, secrets, rng), rng=rng
        )
        per_dealer = result.bytes_per_dealer_per_secret()
        packed.append(per_dealer)
        naive.append(naive_reshare_elements(1, n, secrets.size) * 8 / secrets.size)
    # packed: n_new / k elements per secret (+ the check block) -> constant; naive: n
    assert max(packed) / min(packed) < 1.1
    assert naive[-1] / naive[0] == pytest.approx(4.0)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="old.k=2 and new.k=3"):
        Resharing(PackedShamir(6, 2, 2), PackedShamir(6, 2, 3))
    with pytest.raises(ValueError, match="member 9"):
        Resharing(PackedShamir(6, 2, 2), PackedShamir(6, 2, 2)).run(
            {9: np.zeros(2, dtype=np.int64)}, rng=np.random.default_rng(0)
        )
