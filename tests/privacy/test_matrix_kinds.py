"""The factorization kinds' registry (fedsim.privacy.matrix.kinds): every registered kind
loads under its name, a saved file's kind finds its family, and a kind's own options are
checked by name and leave the cache keys of specs without them as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedsim.commands.factorize import kind_options
from fedsim.config import ConfigError
from fedsim.privacy.matrix.build import Spec, build, spec_of
from fedsim.privacy.matrix.kinds import NAMES, REGISTERED, kind, saved_kind
from fedsim.privacy.matrix.streaming import noise_stream

STREAMS = {"tree": "TreeStream", "honaker": "TreeStream", "sqrt": "DenseStream",
           "toeplitz": "BandedStream", "banded": "BandedStream", "blt": "BLTStream"}  # fmt: skip


def test_every_registered_kind_loads_under_its_name_and_its_saved_kind_finds_it():
    assert NAMES == tuple(REGISTERED)
    for name in NAMES:
        assert kind(name).name == name
        assert saved_kind(kind(name).saved_as) is kind(name)
    assert saved_kind("banded_toeplitz") is kind("toeplitz")
    assert saved_kind("no-such-kind") is None


@pytest.mark.parametrize("name", ["tree", "honaker", "sqrt", "toeplitz", "banded", "blt"])
def test_a_built_factorization_streams_and_checks_by_its_kind(name):
    f = build(Spec(kind=name, rounds=6, participations=2, min_sep=3))
    assert f.kind == kind(name).saved_as
    assert kind(name).mismatch(f) is None
    stream = noise_stream(f, np.random.default_rng, 2)
    assert type(stream).__name__ == STREAMS[name]


def test_a_spec_key_without_options_is_the_key_of_before():
    key = json.loads(Spec(kind="tree", rounds=8).key())
    assert "options" not in key
    assert sorted(key) == [
        "bands", "buffers", "format", "kind", "min_sep", "participations", "rounds",
    ]  # fmt: skip


def test_an_option_the_kind_does_not_declare_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        Spec(kind="tree", rounds=8, options=(("restart_every", 4),))
    assert err.value.key == "kind_options.restart_every"
    assert "nothing for kind tree" in err.value.allowed


def test_spec_of_reads_back_a_spec_with_options(monkeypatch):
    from fedsim.privacy.matrix import kind as kind_module  # noqa: PLC0415

    tree = kind("tree")
    with_options = kind_module.Kind(**{**tree.__dict__, "options": ("depth",)})
    monkeypatch.setattr(
        "fedsim.privacy.matrix.build.kind", lambda name: with_options if name == "tree" else tree
    )
    spec = Spec(kind="tree", rounds=8, options=(("depth", 3),))
    assert json.loads(spec.key())["options"] == [["depth", 3]]
    f = build(spec)
    f.params["cache_key"] = spec.key()
    assert spec_of(f) == spec


def test_option_flags_parse_and_a_bad_one_names_the_flag():
    assert kind_options(["restart_every=4", "x = 2"]) == (("restart_every", 4), ("x", 2))
    for bad in ("restart_every", "restart_every=four", "=3"):
        with pytest.raises(ConfigError) as err:
            kind_options([bad])
        assert err.value.key == "--option"
