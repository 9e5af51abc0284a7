"""DMM rounds: exact releases of the integer mechanism, data-only state, dropouts, aborts,
tampering within and beyond the decoding radius."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dmm_support import Committees, Reference, assert_same, inputs

from fedsim.privacy.dmm import IntegerMechanism
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.tree import honaker_tree
from protocols.dmm.common import (
    ACTIVE,
    TRANSITIONS,
    DMMAbort,
    DMMFaults,
    DMMStage,
    Schedule,
    StateLost,
    check_transition,
)
from protocols.dmm.release import ReleaseDecoder
from protocols.kit import StageError, TamperingDetected

D, CLIENTS, ROUNDS = 8, 6, 8


def banded_mechanism():
    return IntegerMechanism(banded(ROUNDS, 3), 10)


def tree_mechanism():
    return IntegerMechanism(honaker_tree(ROUNDS), 0)


def committees(mechanism, **kw) -> Committees:
    return Committees(mechanism.integer_matrix, D, decoding=mechanism.decoding, **kw)


def reconstruct_state(pool, scheme, holders) -> dict[int, np.ndarray]:
    """What the committee's held shares open to (test-only: all members together)."""
    rows: dict[int, dict[int, np.ndarray]] = {}
    for group, obj in zip(pool.groups, pool.objects):
        _, partials = obj.snapshot()
        for r, shares in partials.items():
            for a, seat in enumerate(group):
                rows.setdefault(r, {})[seat] = shares[a]
    out = {}
    for r, by_seat in rows.items():
        seats = [s for s in holders][: scheme.threshold]
        values = scheme.reconstruct(np.stack([by_seat[s] for s in seats]), seats, D)
        out[r] = scheme.field.decode_signed(values)
    return out


def test_every_stage_pair_is_checked():
    for current, target in itertools.product(DMMStage, DMMStage):
        if target in TRANSITIONS[current]:
            check_transition(current, target, "r")
        else:
            with pytest.raises(StageError):
                check_transition(current, target, "r")


def test_schedule_releases_each_row_once_and_holds_only_open_rows():
    tree = Schedule(tree_mechanism().integer_matrix)
    assert [len(tree.released_at(t)) for t in range(ROUNDS)] == [1, 2, 1, 3, 1, 2, 1, 4]
    assert len(tree.open_after(2)) == 3  # nodes [2,3], [0,3], [0,7]: at most log2 T + 1
    band = Schedule(banded_mechanism().integer_matrix)
    assert all(band.released_at(t) == (t,) for t in range(ROUNDS))
    assert band.open_after(4) == (5, 6) and band.open_after(ROUNDS - 1) == ()
    with pytest.raises(ValueError, match="all-zero row"):
        Schedule(np.array([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="ordered by release round"):
        Schedule(np.array([[0, 1], [1, 0]]))
    with pytest.raises(ValueError, match="integer matrix"):
        Schedule(np.eye(2))


@pytest.mark.parametrize("make", [banded_mechanism, tree_mechanism], ids=["banded", "tree"])
def test_releases_are_the_integer_mechanism_and_the_state_is_data_only(make):
    mechanism = make()
    run = committees(mechanism)
    ref = Reference(mechanism.integer_matrix)
    decoder = ReleaseDecoder(Schedule(mechanism.integer_matrix), mechanism.decoding)
    for step in range(ROUNDS):
        updates, noises = inputs(run.full.schedule, step, CLIENTS, D, 1)
        faults = DMMFaults(member={(step % 10, DMMStage.RESHARE): "drop"})
        full, ideal = run.both(step, updates, noises, faults)
        assert_same(full, ideal)
        expected = ref.release(updates, noises, range(CLIENTS))
        np.testing.assert_array_equal(full.release, expected)
        # decoding is x_hat = D y: the round sum plus (D z)_t, exactly as from the releases
        np.testing.assert_allclose(
            full.estimate, decoder.add(step, dict(zip(full.rows, expected))), rtol=0, atol=0
        )
        # the committee holds shares of the open rows' partial sums of the DATA, no noise
        held = reconstruct_state(run.full.pool, run.full.scheme, run.full.holders)
        assert held.keys() == ref.partial_sums().keys()
        for r, value in ref.partial_sums().items():
            np.testing.assert_array_equal(held[r], value)
    assert run.full.counts == {i: CLIENTS for i in range(run.full.schedule.rows)}


def test_decoded_estimates_remove_the_round_sums_exactly_in_expectation():
    mechanism = banded_mechanism()
    run = committees(mechanism)
    zero_noise_sums, errors = [], []
    for step in range(ROUNDS):
        updates, noises = inputs(run.full.schedule, step, CLIENTS, D, 2)
        zero = {c: np.zeros_like(n) for c, n in noises.items()}
        out = run.ideal.run_plain_round(step, updates, zero)
        zero_noise_sums.append(sum(updates.values()))
        errors.append(out.estimate - zero_noise_sums[-1])
    assert np.max(np.abs(errors)) < 1e-6  # without noise x_hat is X exactly


@pytest.mark.parametrize("stage", ACTIVE)
@pytest.mark.parametrize("dropped", [0, 2, 5, 6])
def test_member_dropout_sweep(stage, dropped):
    """n = 10, t + k = 5: up to 5 members may drop at any stage; 6 -> that stage's abort
    (RESHARE: the release stands and the old committee keeps the state). A handoff needs
    t + k + 1 dealers (one parity check), so with 5 dropped the old committee keeps it."""
    mechanism = banded_mechanism()
    run = committees(mechanism)
    ref = Reference(mechanism.integer_matrix)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 3)
    run.both(0, updates, noises)
    ref.release(updates, noises, range(CLIENTS))
    updates, noises = inputs(run.full.schedule, 1, CLIENTS, D, 3)
    faults = DMMFaults(member={(j, stage): "drop" for j in range(dropped)})
    full, ideal = run.both(1, updates, noises, faults)
    assert_same(full, ideal)
    if dropped > 5 and stage in (DMMStage.SHARE, DMMStage.COMBINE):
        assert isinstance(full, StateLost) and full.stage is stage
        return
    if dropped > 5 and stage is DMMStage.RELEASE:
        assert isinstance(full, DMMAbort) and full.stage is DMMStage.RELEASE
        assert run.full.step == 1  # nothing decoded, the state of step 1 is kept
        # but 4 > t = 2 members' shares reached the server: the step counts as released
        assert full.opened is not None and full.opened.members == (6, 7, 8, 9)
        return
    np.testing.assert_array_equal(full.release, ref.release(updates, noises, range(CLIENTS)))
    assert full.handed_over == (dropped < 5)  # 5 dealers = t + k: no check, no handoff
    if stage is not DMMStage.RESHARE:
        answers = 10 - dropped
        assert full.verified == (answers > 5) and full.radius == (answers - 5) // 2
    # the next round runs on whichever committee holds the state
    updates, noises = inputs(run.full.schedule, 2, CLIENTS, D, 3)
    full, ideal = run.both(2, updates, noises)
    assert_same(full, ideal)
    np.testing.assert_array_equal(full.release, ref.release(updates, noises, range(CLIENTS)))


def test_late_releases_abort_the_round_as_an_opened_release_never_run_again():
    """6 of 10 release shares miss the deadline: too few to decode, but every share reached
    the server (it holds the key of the late ones too), so the step counts as released and
    its state is never released again with fresh noise."""
    mechanism = banded_mechanism()
    run = committees(mechanism)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 4)
    late = DMMFaults(member={(j, DMMStage.RELEASE): "late" for j in range(6)})
    for outcome in run.both(0, updates, noises, late):
        assert isinstance(outcome, DMMAbort) and outcome.stage is DMMStage.RELEASE
        assert outcome.opened.members == tuple(range(10)) and outcome.opened.clients == CLIENTS
    for server in (run.full, run.ideal):
        assert server.step == 0 and 0 in server.opened
    with pytest.raises(ValueError, match="not released again"):
        run.full_round(1, updates, noises)
    with pytest.raises(ValueError, match="not released again"):
        run.ideal.run_plain_round(1, updates, noises)


def test_client_dropouts_partial_and_corrupted_shares_leave_the_client_out():
    mechanism = tree_mechanism()
    run = committees(mechanism)
    ref = Reference(mechanism.integer_matrix)
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 5)
    faults = DMMFaults(
        client_drop={0: DMMStage.SHARE},
        client_partial=frozenset({1}),
        corrupt_in_transit=frozenset({(2, 3)}),
    )
    full, ideal = run.both(0, updates, noises, faults)
    assert full.clients == (3, 4, 5) and full.excluded == (1, 2)
    assert ideal.clients == (2, 3, 4, 5)  # ideal mode has no ciphertexts to corrupt
    np.testing.assert_array_equal(full.release, ref.release(updates, noises, (3, 4, 5)))
    assert run.full.counts == {0: 3}  # the noise actually present


def test_fewer_than_min_clients_release_nothing():
    run = committees(banded_mechanism(), min_clients=4)
    updates, noises = inputs(run.full.schedule, 0, 3, D, 6)
    for outcome in run.both(0, updates, noises):
        assert isinstance(outcome, DMMAbort) and outcome.stage is DMMStage.COMBINE
    assert run.full.step == 0 and run.full.stage is DMMStage.ABORTED


@pytest.mark.parametrize("stage", [DMMStage.COMBINE, DMMStage.RELEASE, DMMStage.RESHARE])
def test_one_tampering_member_is_corrected_and_the_results_stay_correct(stage):
    mechanism = banded_mechanism()
    run = committees(mechanism)
    ref = Reference(mechanism.integer_matrix)
    for step in range(3):
        updates, noises = inputs(run.full.schedule, step, CLIENTS, D, 7)
        faults = DMMFaults(member={(4, stage): "tamper"}, seed=9) if step == 1 else None
        out = run.full_round(step, updates, noises, faults)
        np.testing.assert_array_equal(out.release, ref.release(updates, noises, range(CLIENTS)))
        if step == 1 and stage is not DMMStage.RESHARE:
            assert out.corrected == (4,) and out.verified  # named: the decoding is unique
        if step == 1 and stage is DMMStage.RESHARE:
            assert out.reshare_attempts == 2  # its wrong deal is caught in VERIFY, not handed on
        if step == 1 and stage is DMMStage.COMBINE:
            assert out.reshare_attempts == 1  # a corrected member does not deal its wrong state


def test_tampering_beyond_the_radius_aborts_without_release_and_names_nobody():
    run = committees(banded_mechanism())
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 8)
    faults = DMMFaults(member={(j, DMMStage.RELEASE): "tamper" for j in (1, 3, 6)}, seed=2)
    with pytest.raises(TamperingDetected) as caught:
        run.full_round(0, updates, noises, faults)
    assert caught.value.suspects == ()
    assert run.full.step == 0 and run.full.stage is DMMStage.ABORTED


def test_exactly_t_plus_k_answers_release_unverified():
    run = committees(banded_mechanism())
    updates, noises = inputs(run.full.schedule, 0, CLIENTS, D, 9)
    faults = DMMFaults(member={(j, DMMStage.RELEASE): "drop" for j in range(5)})
    full, ideal = run.both(0, updates, noises, faults)
    assert not full.verified and not ideal.verified and full.radius == 0


def test_fault_plans_are_checked():
    with pytest.raises(ValueError, match="allowed stages"):
        DMMFaults(member={(0, DMMStage.DONE): "drop"})
    with pytest.raises(ValueError, match="nothing to alter"):
        DMMFaults(member={(0, DMMStage.SHARE): "tamper"})
    with pytest.raises(ValueError, match="only RELEASE"):
        DMMFaults(member={(0, DMMStage.COMBINE): "late"})
    with pytest.raises(ValueError, match="client_drop"):
        DMMFaults(client_drop={0: DMMStage.SETUP})


def test_release_decoder_is_forward_substitution_and_refuses_what_it_cannot_decode():
    M = banded_mechanism().integer_matrix
    decoder = ReleaseDecoder(Schedule(M))
    y = np.random.default_rng(0).integers(-1000, 1000, (ROUNDS, 3))
    x = np.stack([decoder.add(t, {t: y[t]}) for t in range(ROUNDS)])
    np.testing.assert_allclose(x, np.linalg.solve(M.astype(float), y.astype(float)), rtol=1e-12)
    tree = tree_mechanism()
    with pytest.raises(ValueError, match="square lower-triangular"):
        ReleaseDecoder(Schedule(tree.integer_matrix))
    late = tree.decoding.copy()
    late[0, -1] = 1.0
    with pytest.raises(ValueError, match="not causal"):
        ReleaseDecoder(Schedule(tree.integer_matrix), late)
