"""experiments/roots.py: the study root stays outside the results; one root per seed."""

from __future__ import annotations

import stat

import pytest

from experiments.roots import seed_root, study_root
from fedsim.config import ConfigError
from fedsim.randomness import Purpose, RunSecret


def test_seed_roots_are_repeatable_and_independent(tmp_path):
    root = study_root(tmp_path / "keys" / "study.key", tmp_path / "results")
    again = study_root(tmp_path / "keys" / "study.key", tmp_path / "results")
    assert seed_root(root, "s", 0).fingerprint() == seed_root(again, "s", 0).fingerprint()
    fingerprints = {
        seed_root(root, study, seed).fingerprint() for study in ("s", "t") for seed in (0, 1)
    }
    assert len(fingerprints) == 4 and root.fingerprint() not in fingerprints
    # the server's noise of two seeds differs (one root for every seed would repeat it)
    noise = [
        seed_root(root, "s", seed).server().generator(1, Purpose.NOISE).normal(size=4)
        for seed in (0, 1)
    ]
    assert not (noise[0] == noise[1]).all()


def test_study_root_file_is_private_and_outside_the_results(tmp_path):
    path = tmp_path / "keys" / "study.key"
    assert isinstance(study_root(path, tmp_path / "results"), RunSecret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="outside the run directory"):
        study_root(tmp_path / "results" / "study.key", tmp_path / "results")
