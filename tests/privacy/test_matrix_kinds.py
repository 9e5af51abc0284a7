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


def test_dmm_knows_the_kinds_by_their_declared_flags(monkeypatch):
    """DMM's banded and 0/1 kinds are the registry's flags: a newly registered 0/1 kind is
    accepted by ``strategy.options.kind`` and taken as M = C, with nothing else edited."""
    import fedsim.privacy.matrix.kinds as kinds  # noqa: PLC0415
    from fedsim.privacy import dmm  # noqa: PLC0415
    from fedsim.privacy.matrix import kind as kind_module  # noqa: PLC0415
    from strategies.methods.dmm.options import DMMOptions  # noqa: PLC0415

    for flag, names in (("banded", dmm.banded_kinds()), ("zero_one_encoder", dmm.tree_kinds())):
        assert names == tuple(name for name in NAMES if getattr(kind(name), flag))
    assert dmm.banded_kinds()[:2] == ("toeplitz", "banded")
    assert dmm.tree_kinds()[:2] == ("tree", "honaker")
    assert not {"sqrt", "dense", "blt"} & set(dmm.kinds())
    assert {"tree", "honaker", "sqrt"} <= set(kinds.named_with("closed_form"))
    assert not {"banded", "toeplitz", "dense", "blt"} & set(kinds.named_with("closed_form"))
    with pytest.raises(ValueError, match="flag='name'"):
        kinds.named_with("name")
    with pytest.raises(ConfigError) as err:
        DMMOptions(clipping_norm=1.0, noise_multiplier=1.0, kind="tree2")
    assert err.value.allowed == f"one of {', '.join(dmm.kinds())}"
    real = kinds.kind
    tree2 = kind_module.Kind(**{**real("tree").__dict__, "name": "tree2"})
    monkeypatch.setattr(kinds, "NAMES", (*kinds.NAMES, "tree2"))
    monkeypatch.setattr(kinds, "kind", lambda name: tree2 if name == "tree2" else real(name))
    assert dmm.tree_kinds()[-1] == "tree2" and "tree2" not in dmm.banded_kinds()
    assert DMMOptions(clipping_norm=1.0, noise_multiplier=1.0, kind="tree2").kind == "tree2"
    f = build(Spec(kind="tree", rounds=4))
    f2 = type(f)("tree2", f.workload, f.encoder, f.decoder, f.params)
    mechanism = dmm.IntegerMechanism(f2, 0)
    assert mechanism.is_tree and np.array_equal(mechanism.integer_matrix, f.encoder)
