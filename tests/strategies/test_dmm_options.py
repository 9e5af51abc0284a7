"""DMM's typed options (strategies/methods/dmm/options.py) and its checkpoints' custody
(strategies/secure/dmm/custody.py): errors name ``strategy.options.<key>``, the defaults are the
strategy's, and a checkpoint written before the custody existed loads into one."""

from __future__ import annotations

import inspect

import pytest

from fedsim.config import ConfigError
from strategies.methods.dmm import DMM, SPEC, from_options
from strategies.methods.dmm.options import DMMOptions
from strategies.spec import RunFacts

BASE = {"clipping_norm": 1.0, "noise_multiplier": 1.0}
COMMITTEE = {"committee_size": 11, "threshold": 2, "packing": 1, "member_dropouts": 2}


FACTS = RunFacts(
    expected_clients=10, evaluate_fraction=0.0, seed=1, worker_reduction=False, population=30,
    rounds=4,
)  # fmt: skip


def build(**options):
    return SPEC.build({**BASE, **options}, FACTS)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"clipping_nrom": 1.0}, "strategy.options.clipping_nrom"),
        ({"clipping_norm": 0.0}, "strategy.options.clipping_norm"),
        ({"noise_multiplier": -1}, "strategy.options.noise_multiplier"),
        ({"committee_size": 11.5}, "strategy.options.committee_size"),
        ({"threshold": 0}, "strategy.options.threshold"),
        ({"member_dropouts": -1}, "strategy.options.member_dropouts"),
        ({"mode": "plaintext"}, "strategy.options.mode"),
        ({"kind": "blt"}, "strategy.options.kind"),
        ({"bands": 0}, "strategy.options.bands"),
        ({"kind": "tree", "kind_options": {"depth": 2}}, "strategy.options.kind_options.depth"),
        ({"kind_options": {"x": "two"}}, "strategy.options.kind_options.x"),
        ({"worker_fold": 1}, "strategy.options.worker_fold"),
        ({"committee_actors": "yes"}, "strategy.options.committee_actors"),
        ({"expected_client_dropout": 1.0}, "strategy.options.expected_client_dropout"),
        ({"committee_shards": 12, **COMMITTEE}, "strategy.options.committee_shards"),
    ],
)
def test_a_bad_option_names_its_key(options, key):
    with pytest.raises(ConfigError) as caught:
        build(**options)
    assert caught.value.key == key


def test_a_missing_required_option_names_it():
    with pytest.raises(ConfigError) as caught:
        SPEC.build({"noise_multiplier": 1.0}, FACTS)
    assert caught.value.key == "strategy.options.clipping_norm"


def test_a_committee_below_its_bound_is_refused_naming_the_options():
    with pytest.raises(ConfigError, match="cannot meet the corruption/dropout bound") as caught:
        build(committee_size=11, threshold=3, packing=1, member_dropouts=2)
    assert caught.value.key == "strategy.options"


def test_the_options_defaults_are_the_strategys():
    """Written once: every default of DMMOptions that DMM also takes is DMM's default."""
    taken = inspect.signature(DMM).parameters
    for name, field in DMMOptions.__dataclass_fields__.items():
        if name in taken and taken[name].default is not inspect.Parameter.empty:
            assert field.default == taken[name].default, name
    strategy = from_options(BASE, rounds=4, expected_clients=40, population=60, seed=1)
    scheme = strategy.secure.scheme
    assert (scheme.n, scheme.t, scheme.k) == (20, 3, 3)
    assert (strategy.member_dropouts, strategy.bits, strategy.secure.mode) == (3, 20, "full")
    assert strategy.mechanism.factorization.kind == "banded"
    assert strategy.ledger.delta == 1e-5


def test_kind_options_reach_the_kinds_spec(monkeypatch):
    """``strategy.options.kind_options`` are the built Spec's ``options`` (a kind that
    declares them gets them, as ``fedsim factorize --option``)."""
    from fedsim.privacy.matrix import build as build_module  # noqa: PLC0415
    from fedsim.privacy.matrix import kind as kind_module  # noqa: PLC0415
    from fedsim.privacy.matrix.kinds import kind  # noqa: PLC0415

    tree = kind("tree")
    with_depth = kind_module.Kind(**{**tree.__dict__, "options": ("depth",)})
    monkeypatch.setattr(build_module, "kind", lambda name: with_depth if name == "tree" else tree)
    built = []
    real_build = build_module.build
    monkeypatch.setattr(build_module, "build", lambda spec: built.append(spec) or real_build(spec))
    strategy = build(kind="tree", kind_options={"depth": 3})
    assert built[0].options == (("depth", 3),)
    assert strategy.mechanism.factorization.kind == "tree"
