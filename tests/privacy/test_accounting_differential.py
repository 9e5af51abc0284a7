"""Differential check: every accounted value equals the one stored before the accounting split.

``tests/privacy/accounting_baseline.json`` was written by ``tests/accounting_cases.py`` from the
single-module ``fedsim.privacy.accounting`` (commit 4382919); the split modules must reproduce
each value to a relative 1e-12 (DP-FedAvg Poisson/fixed/full/min-separation under RDP and PLD,
calibration, DDGauss and DMM ledgers, the matrix mechanism and ``fedsim account``).
"""

import json

import pytest
from accounting_cases import BASELINE, compute


def test_every_value_matches_the_stored_baseline(tmp_path):
    stored = json.loads(BASELINE.read_text())
    values = compute(tmp_path)
    assert sorted(values) == sorted(stored)
    for key, value in stored.items():
        assert values[key] == pytest.approx(value, rel=1e-12, abs=0), key
