"""Bad configuration stops before any work, naming the key, the value and what is allowed."""

from dataclasses import dataclass
from typing import Literal

import pytest

from fedsim.config import ConfigError, from_mapping, load_toml, to_mapping
from fedsim.frontend.run_config import ExperimentConfig

BASE = {
    "rounds": 2,
    "data": {"source": "digits", "partition": "iid", "num_clients": 20},
    "strategy": {"clients_per_round": 5},
}


def config(**sections):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(name), dict):
            raw[name].update(value)
        else:
            raw[name] = value
    return ExperimentConfig.from_dict(raw)


@dataclass(frozen=True, kw_only=True)
class Inner:
    size: int = 1
    mode: Literal["a", "b"] = "a"


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    ratio: float = 0.5
    inner: Inner = Inner()
    tags: tuple[str, ...] = ()


def test_from_mapping_checks_keys_types_and_literals():
    built = from_mapping(
        Outer, {"name": "x", "ratio": 1, "inner": {"size": 3, "mode": "b"}, "tags": ["t"]}
    )
    assert built == Outer(name="x", ratio=1.0, inner=Inner(size=3, mode="b"), tags=("t",))
    assert to_mapping(built)["inner"] == {"size": 3, "mode": "b"}
    cases = [
        ({"name": "x", "colour": 1}, "colour", "known keys are"),
        ({"name": 3}, "name", "a string"),
        ({"name": "x", "inner": {"size": "big"}}, "inner.size", "an integer"),
        ({"name": "x", "inner": {"mode": "c"}}, "inner.mode", "'a', 'b'"),
        ({"name": "x", "ratio": True}, "ratio", "a number"),
        ({}, "name", "required"),
    ]
    for mapping, key, allowed in cases:
        with pytest.raises(ConfigError) as err:
            from_mapping(Outer, mapping)
        assert err.value.key == key and allowed in str(err.value)


def test_dashes_and_underscores_are_the_same_key():
    assert from_mapping(Inner, {"size": 2}).size == 2
    assert (
        from_mapping(
            ExperimentConfig,
            {"rounds": 1, "data": BASE["data"], "strategy": {"clients-per-round": 3}},
        ).strategy.clients_per_round
        == 3
    )


@pytest.mark.parametrize(
    "sections,key,value",
    [
        ({"strategy": {"clients_per_round": 21}}, "strategy.clients_per_round", 21),
        ({"strategy": {"clients_per_round": -1}}, "strategy.clients_per_round", -1),
        ({"data": {"num_clients": -5}}, "data.num_clients", -5),
        ({"rounds": 0}, "rounds", 0),
        ({"strategy": {"name": "fedfoo"}}, "strategy.name", "fedfoo"),
        ({"evaluation": {"clients": 6}}, "evaluation.clients", 6),
        ({"engine": {"workers": -1}}, "engine.workers", -1),
        ({"engine": {"backend": "spark"}}, "engine.backend", "spark"),
        ({"client": {"lr": 0}}, "client.lr", 0.0),
        ({"model": {"kind": "transformer"}}, "model.kind", "transformer"),
        ({"data": {"alpah": 0.1}}, "data.alpah", 0.1),
    ],
)
def test_bad_values_are_named(sections, key, value):
    with pytest.raises(ConfigError) as err:
        config(**sections)
    assert err.value.key == key and err.value.value == value
    assert key in str(err.value)


def test_seeds_of_data_and_client_default_to_the_run_seed():
    built = config(seed=42)
    assert built.data.seed == 42 and built.client.seed == 42
    assert config(seed=42, data={"seed": 1}).data.seed == 1


def test_toml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="existing TOML"):
        load_toml(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = [")
    with pytest.raises(ConfigError, match="valid TOML"):
        load_toml(broken)
