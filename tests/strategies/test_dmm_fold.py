"""Worker-side folding of DMM's client shares (strategies/secure/dmm/fold.py): the fold of a batch's
sharing inputs deals exactly the sum of the clients' own share rows, and a folded full-mode run
releases what the unfolded and the ideal runs release, counting every folded client's noise."""

from __future__ import annotations

import numpy as np
import pytest
from dmm_support import digits_setup, make_dmm, run_dmm

from fedsim.engine import FaultConfig
from protocols.dmm.client import ShareFold, share_segments, sharing_inputs
from protocols.dmm.common import DMMKeys, RoundKeys
from protocols.shamir import PackedShamir

CLIENTS, ROUNDS = 12, 3


@pytest.fixture(scope="module")
def digits():
    return digits_setup(CLIENTS)


def _keys(dim: int, rows: int = 1) -> RoundKeys:
    return RoundKeys(
        round=0, step=0, rows=rows, n=7, t=2, k=2, field_exponent=61, dim=dim,
        session_id=None, member_keys={j: b"" for j in range(7)},
    )


def test_a_fold_deals_the_sum_of_the_clients_own_share_rows():
    keys, rng = _keys(dim=11), np.random.default_rng(0)
    scheme = PackedShamir(7, 2, 2)
    fold, expected = ShareFold(keys), 0
    for c in range(4):
        update, noise = rng.integers(-50, 50, 11), rng.integers(-50, 50, (1, 11))
        _, randomness = sharing_inputs(scheme, [update, *noise], np.random.default_rng(c))
        fold.add(update, noise, randomness)
        alone = share_segments(scheme, [update, *noise], np.random.default_rng(c))
        expected = scheme.field.add(expected, alone)
    np.testing.assert_array_equal(fold.shares(), expected)
    assert fold.count == 4


def test_a_fold_refuses_malformed_inputs_by_name():
    fold = ShareFold(_keys(dim=5))
    with pytest.raises(ValueError, match="update has shape"):
        fold.add(np.zeros(4, dtype=np.int64), np.zeros((1, 5), dtype=np.int64), np.zeros((2, 6)))
    with pytest.raises(ValueError, match="randomness has shape"):
        fold.add(
            np.zeros(5, dtype=np.int64), np.zeros((1, 5), dtype=np.int64),
            np.zeros((2, 5), dtype=np.int64),
        )
    with pytest.raises(ValueError, match="nothing was added"):
        fold.shares()


def test_folded_full_mode_equals_unfolded_and_ideal_and_counts_every_client(local_engine, digits):
    faults = FaultConfig(dropout=0.25, seed=3)

    def run(mode, **kwargs):
        strategy = make_dmm(mode, CLIENTS, ROUNDS, **kwargs)
        # no timeout: batches hold several clients (under one, each fold chunk is its own)
        return run_dmm(local_engine, digits, strategy, ROUNDS, faults=faults, timeout=None)

    folded_arrays, folded = run("full", worker_fold=True)
    plain_arrays, plain = run("full")
    ideal_arrays, _ = run("ideal")
    for key in folded_arrays:
        np.testing.assert_array_equal(folded_arrays[key], plain_arrays[key])
        np.testing.assert_array_equal(folded_arrays[key], ideal_arrays[key])
    for a, b in zip(folded.outputs, plain.outputs):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a.release, b.release)
            assert a.contributors == len(b.clients)
    assert folded.eps == plain.eps
    for replies, metrics in zip(folded.replies, folded.metrics):
        good = [r for r in replies if not r.has_error()]
        assert 0 < len(good) < sum(len(r.content[DMMKeys.BATCH]["nodes"]) for r in good)
        for reply in good:
            assert set(reply.content.keys()) == {"dmm.sealed", DMMKeys.BATCH}
        assert metrics["rejected"] == []
    for ours, theirs in zip(folded.metrics, plain.metrics):  # a batch's message, not each's
        assert 0 < ours["dmm-bytes-per-client"] < theirs["dmm-bytes-per-client"]
