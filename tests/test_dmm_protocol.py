"""DMM committee rounds: exact releases, every stage under member/client dropouts and tampering."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedsim.privacy.dmm import IntegerNoising
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.tree import honaker_tree
from protocols.dmm import (
    ACTIVE,
    TRANSITIONS,
    DMMCommitteeProtocol,
    DMMFaults,
    DMMStage,
    ReleaseTampering,
    RoundAborted,
    StateLost,
    check_transition,
)
from protocols.resharing import ReshareAbort
from protocols.secagg import StageError
from protocols.shamir import PackedShamir

D, CLIENTS, ROUNDS, F = 8, 6, 8, 10


@pytest.fixture(scope="module")
def noising():
    return IntegerNoising(honaker_tree(ROUNDS), F)


def _inputs(noising, step, seed):
    rng = np.random.default_rng([seed, step])
    rows = noising.rows_drawn_at(step).size
    updates = {i: rng.integers(-100, 100, D) for i in range(CLIENTS)}
    noises = {i: rng.integers(-30, 30, (rows, D)) for i in range(CLIENTS)}
    return updates, noises


class Reference:
    """The plain integers: 2^f U_t + sum_r M[t, r] z_r over the contributing clients."""

    def __init__(self, noising):
        self.noising, self.z, self.step = noising, {}, 0

    def release(self, updates, noises, clients):
        t, M = self.step, self.noising.integer_matrix
        for a, r in enumerate(self.noising.rows_drawn_at(t)):
            self.z[int(r)] = sum(np.asarray(noises[i][a], dtype=object) for i in clients)
        out = sum(np.asarray(updates[i], dtype=object) for i in clients) * 2**F
        for r, row in self.z.items():
            out = out + int(M[t, r]) * row
        self.step += 1
        return np.array(out, dtype=np.int64)


def _protocol(noising, mode="full", n=10, t=2, k=3, **kw):
    rng = np.random.default_rng(0) if mode == "full" else None
    return DMMCommitteeProtocol(PackedShamir(n, t, k), noising, D, mode=mode, rng=rng, **kw)


def test_every_stage_pair_is_checked():
    for current, target in itertools.product(DMMStage, DMMStage):
        if target in TRANSITIONS[current]:
            check_transition(current, target, "r")
        else:
            with pytest.raises(StageError):
                check_transition(current, target, "r")


@pytest.mark.parametrize("kind", ["honaker", "banded"])
def test_full_and_ideal_release_the_reference_integers_every_step(kind):
    noising = IntegerNoising(honaker_tree(ROUNDS) if kind == "honaker" else banded(ROUNDS, 3), F)
    full, ideal, ref = _protocol(noising), _protocol(noising, "ideal"), Reference(noising)
    for step in range(ROUNDS):
        updates, noises = _inputs(noising, step, 1)
        faults = DMMFaults(member={(step % 10, DMMStage.RESHARE): "drop"})
        a = full.run_round(updates, noises, faults, step)
        b = ideal.run_round(updates, noises, faults, step)
        expected = ref.release(updates, noises, range(CLIENTS))
        np.testing.assert_array_equal(a.release, expected)
        np.testing.assert_array_equal(b.release, expected)
        # state is pruned to what M still uses
        assert set(full.held_rows) == {int(r) for r in noising.needed_after(step)}
        assert set(full.member_shares()) == set(full.held_rows)


@pytest.mark.parametrize("stage", ACTIVE)
@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.6])
def test_member_dropout_sweep(noising, stage, fraction):
    """n = 10, t + k = 5: up to 5 members may drop at any stage; 6 -> the stage's abort."""
    proto, ref = _protocol(noising), Reference(noising)
    updates, noises = _inputs(noising, 0, 2)
    proto.run_round(updates, noises, DMMFaults(), 0)
    ref.release(updates, noises, range(CLIENTS))
    updates, noises = _inputs(noising, 1, 2)
    dropped = round(fraction * 10)
    faults = DMMFaults(member={(j, stage): "drop" for j in range(dropped)})
    if 10 - dropped >= 5:
        out = proto.run_round(updates, noises, faults, 1)
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
        # and the next committee carries on
        updates, noises = _inputs(noising, 2, 2)
        out = proto.run_round(updates, noises, DMMFaults(), 2)
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
        return
    expected_error = {
        DMMStage.SHARE: StateLost,
        DMMStage.COMBINE: StateLost,
        DMMStage.RELEASE: RoundAborted,
        DMMStage.RESHARE: ReshareAbort,
    }[stage]
    with pytest.raises(expected_error) as caught:
        proto.run_round(updates, noises, faults, 1)
    assert (caught.value.needed, caught.value.answered) == (5, 4)
    assert proto.stage is DMMStage.ABORTED
    if stage is DMMStage.RESHARE:  # the release itself was correct and stays valid
        np.testing.assert_array_equal(
            proto.last_output.release, ref.release(updates, noises, range(CLIENTS))
        )
        assert proto.step == 2


def test_late_releases_abort_the_round_and_keep_the_state(noising):
    proto, ref = _protocol(noising), Reference(noising)
    updates, noises = _inputs(noising, 0, 3)
    proto.run_round(updates, noises, DMMFaults(), 0)
    ref.release(updates, noises, range(CLIENTS))
    updates, noises = _inputs(noising, 1, 3)
    late = DMMFaults(member={(j, DMMStage.RELEASE): "late" for j in range(6)})
    with pytest.raises(RoundAborted, match="4 members released, t \\+ k = 5 needed"):
        proto.run_round(updates, noises, late, 1)
    assert proto.step == 1  # nothing released, the step did not advance
    out = proto.run_round(updates, noises, DMMFaults(), 2)
    np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_next_committee_dropout(noising, fraction):
    proto = _protocol(noising)
    updates, noises = _inputs(noising, 0, 4)
    gone = frozenset(range(round(fraction * 10)))
    if 10 - len(gone) >= 5:
        proto.run_round(updates, noises, DMMFaults(next_drop=gone), 0)
        assert not gone & set(proto.holders)
    else:
        with pytest.raises(ReshareAbort) as caught:
            proto.run_round(updates, noises, DMMFaults(next_drop=gone), 0)
        assert caught.value.side == "new"


@pytest.mark.parametrize("stage", ACTIVE)
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_client_dropout_sweep(noising, stage, fraction):
    """Clients that stop at SHARE are left out (update and noise); later they change nothing."""
    for mode in ("full", "ideal"):
        proto, ref = _protocol(noising, mode), Reference(noising)
        updates, noises = _inputs(noising, 0, 5)
        gone = range(round(fraction * CLIENTS))
        faults = DMMFaults(client_drop={i: stage for i in gone})
        contributing = [i for i in range(CLIENTS) if stage is not DMMStage.SHARE or i not in gone]
        if not contributing:
            with pytest.raises(RoundAborted, match="min_clients = 1"):
                proto.run_round(updates, noises, faults, 0)
            assert proto.step == 0
            continue
        out = proto.run_round(updates, noises, faults, 0)
        assert list(out.clients) == contributing
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, contributing))
        assert proto.noise_counts[0] == len(contributing)


def test_partial_and_corrupted_client_shares_exclude_the_client(noising):
    for mode in ("full", "ideal"):
        proto, ref = _protocol(noising, mode), Reference(noising)
        updates, noises = _inputs(noising, 0, 6)
        faults = DMMFaults(client_partial=frozenset({1}), corrupt_in_transit=frozenset({(3, 7)}))
        out = proto.run_round(updates, noises, faults, 0)
        if mode == "full":
            assert out.excluded == (1, 3)
            keep = [0, 2, 4, 5]
        else:  # no ciphertexts to corrupt in ideal mode
            keep = [0, 2, 3, 4, 5]
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, keep))


@pytest.mark.parametrize("stage", [DMMStage.COMBINE, DMMStage.RELEASE, DMMStage.RESHARE])
def test_one_tampering_member_is_named_and_the_results_stay_correct(noising, stage):
    proto, ref = _protocol(noising), Reference(noising)
    for step in range(3):
        updates, noises = _inputs(noising, step, 7)
        faults = DMMFaults(member={(4, stage): "tamper"} if step == 1 else {}, seed=step)
        out = proto.run_round(updates, noises, faults, step)
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
        if step == 1 and stage is not DMMStage.RESHARE:
            assert out.faulty == (4,)
        if step == 1 and stage is DMMStage.RESHARE:
            assert out.reshare_attempts == 2  # the check named member 4; DEAL ran again


def test_tampering_beyond_unique_decoding_aborts_without_release(noising):
    proto = _protocol(noising, n=7)  # 7 answers, t + k = 5: one error correctable
    updates, noises = _inputs(noising, 0, 8)
    faults = DMMFaults(member={(1, DMMStage.RELEASE): "tamper", (5, DMMStage.RELEASE): "tamper"})
    with pytest.raises(ReleaseTampering):
        proto.run_round(updates, noises, faults, 0)
    assert proto.step == 0 and proto.stage is DMMStage.ABORTED


def test_fault_plans_are_checked():
    with pytest.raises(ValueError, match="only RELEASE has a deadline"):
        DMMFaults(member={(0, DMMStage.SHARE): "late"})
    with pytest.raises(ValueError, match="allowed stages"):
        DMMFaults(member={(0, DMMStage.DONE): "drop"})
    with pytest.raises(ValueError, match="hold nothing to alter"):
        DMMFaults(member={(0, DMMStage.SHARE): "tamper"})
