"""A tampering dealer against a DMM handoff that exactly t + k members deal.

n = 10, t = 2, k = 3 (t + k = 5). In step 1 five members drop at RESHARE and one of the five
left (seat 6) deals a wrong copy of its partial-sum shares. With m = t + k dealers there are
m - t - k = 0 parity checks: the dealing used to go through unchecked, the next committee held
a wrong state, and every later release of the rows it carried decoded as verified -- to a wrong
value. Now a handoff needs t + k + ``reshare_checks`` dealers (default 1): the old committee
keeps its (correct) state and the later releases are exact. With ``reshare_checks = 0`` the
unchecked handoff is allowed, and every release of a row it carried says ``verified = False``.
"""

from __future__ import annotations

import numpy as np
from dmm_support import Committees, Reference, inputs

from fedsim.privacy.dmm import IntegerMechanism
from fedsim.privacy.matrix.banded import banded
from protocols.dmm.common import DMMFaults, DMMStage

D, CLIENTS, ROUNDS = 8, 6, 8
HANDOFF = DMMFaults(
    member={**{(j, DMMStage.RESHARE): "drop" for j in range(5)}, (6, DMMStage.RESHARE): "tamper"},
    seed=11,
)


def _run(checks: int | None):
    """Steps 0..4 with the faulty handoff in step 1: (outputs, reference releases)."""
    mechanism = IntegerMechanism(banded(ROUNDS, 3), 10)
    run = Committees(mechanism.integer_matrix, D, decoding=mechanism.decoding)
    if checks is not None:
        run.full.reshare_checks = checks
    ref = Reference(mechanism.integer_matrix)
    outputs, expected = [], []
    for step in range(5):
        updates, noises = inputs(run.full.schedule, step, CLIENTS, D, 21)
        outputs.append(run.full_round(step, updates, noises, HANDOFF if step == 1 else None))
        expected.append(ref.release(updates, noises, range(CLIENTS)))
    return outputs, expected


def test_a_handoff_by_exactly_t_plus_k_dealers_is_refused_and_later_releases_are_exact():
    outputs, expected = _run(None)
    wrong = [
        (out.step, bool(out.verified))
        for out, want in zip(outputs, expected)
        if not np.array_equal(out.release, want)
    ]
    assert wrong == [], f"releases (step, reported verified) that are wrong: {wrong}"
    assert not outputs[1].handed_over and "reshare_checks" in outputs[1].handoff_error
    assert outputs[1].holders == tuple(range(10))  # the old committee keeps the state


def test_an_unchecked_handoff_marks_every_release_that_depends_on_it_unverified():
    outputs, expected = _run(0)
    assert outputs[1].handed_over  # allowed, unchecked
    # rows 2 and 3 were open at step 1: their releases (steps 2, 3) rest on the handoff
    for out, want in zip(outputs[2:4], expected[2:4]):
        assert not np.array_equal(out.release, want)  # the dealer spoiled them
        assert not out.verified, f"step {out.step}: a wrong release reported verified"
    # row 4 began after it (and its handoffs were checked): exact and verified
    np.testing.assert_array_equal(outputs[4].release, expected[4])
    assert outputs[4].verified
