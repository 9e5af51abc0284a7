"""Differential check: every accounted value equals the one stored before the accounting split.

``tests/privacy/accounting_baseline.json`` was written by ``tests/accounting_cases.py`` from the
single-module ``fedsim.privacy.accounting`` (commit 4382919); the split modules must reproduce
each value to a relative 1e-12, each PLD value to 1e-9 (DP-FedAvg Poisson/fixed/full/
min-separation under RDP and PLD, calibration, DDGauss and DMM ledgers, the matrix mechanism
and ``fedsim account``).

PLD composes by FFT convolution, whose last bits follow the CPU's SIMD path: on an AVX-512
machine every PLD value differed from the baseline by 1e-11 to 2e-10 relative while every RDP
value matched to the bit.
"""

import json

import pytest
from accounting_cases import BASELINE, compute

PLD_REL = 1e-9


def test_every_value_matches_the_stored_baseline(tmp_path):
    stored = json.loads(BASELINE.read_text())
    values = compute(tmp_path)
    assert sorted(values) == sorted(stored)
    for key, value in stored.items():
        rel = PLD_REL if "pld" in key.split("/") else 1e-12
        assert values[key] == pytest.approx(value, rel=rel, abs=0), key
