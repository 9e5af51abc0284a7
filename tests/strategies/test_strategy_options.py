"""Contract of every registered method's ``strategy.options``: a frozen dataclass read by
:func:`fedsim.config.from_mapping`, whose errors name ``strategy.options.<key>``, whose
defaults build the method (given the keys a method requires) and round-trip."""

from __future__ import annotations

import dataclasses

import pytest

from fedsim.config import ConfigError, from_mapping, to_mapping
from strategies.registry import (
    SPECS,
    build_personalised_strategy,
    build_strategy,
    build_text_strategy,
)

#: the keys a method cannot default (everything else does)
REQUIRED = {
    name: {"clipping_norm": 1.0, "noise_multiplier": 1.0}
    for name in ("dp-fedavg", "matrix-mechanism", "ddgauss", "dmm")
}
#: the text methods: a noise (or target epsilon), and the tiny models for the build below
REQUIRED.update(
    {name: {"noise_multiplier": 1.0} for name in ("popri", "private-evolution")}
)
TINY = {"generator": "tiny", "embedder": "tiny", "num_prompts": 2, "samples_per_prompt": 2,
        "examples_per_prompt": 1, "max_new_tokens": 2}  # fmt: skip

WHERE = "strategy.options"


SPEC_PARAMS = [pytest.param(spec, id=spec.name) for spec in SPECS]


def _read(spec, options):
    return from_mapping(spec.options, options, WHERE)


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_options_are_a_frozen_dataclass(spec):
    assert dataclasses.is_dataclass(spec.options) and isinstance(spec.options, type)
    assert spec.options.__dataclass_params__.frozen
    options = _read(spec, REQUIRED.get(spec.name, {}))
    field = dataclasses.fields(options)[0].name if dataclasses.fields(options) else None
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, field, None)


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_an_unknown_key_is_refused_by_name(spec):
    with pytest.raises(ConfigError) as err:
        _read(spec, {**REQUIRED.get(spec.name, {}), "no_such_key": 1})
    assert err.value.key == f"{WHERE}.no_such_key"
    assert err.value.value == 1 and "known keys" in err.value.allowed


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_a_wrongly_typed_value_is_refused_by_name(spec):
    assert spec.options is not None
    for field in dataclasses.fields(spec.options):
        wrong = object()  # no config annotation accepts it
        with pytest.raises(ConfigError) as err:
            _read(spec, {**REQUIRED.get(spec.name, {}), field.name: wrong})
        assert err.value.key == f"{WHERE}.{field.name}", field.name
        assert err.value.value is wrong


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_a_required_key_is_named_when_missing(spec):
    assert spec.options is not None
    for key in REQUIRED.get(spec.name, {}):
        given = {k: v for k, v in REQUIRED[spec.name].items() if k != key}
        with pytest.raises(ConfigError) as err:
            _read(spec, given)
        assert err.value.key == f"{WHERE}.{key}"


@pytest.mark.parametrize("spec", SPEC_PARAMS)
def test_the_defaults_round_trip_and_build(spec):
    options = _read(spec, REQUIRED.get(spec.name, {}))
    assert _read(spec, to_mapping(options)) == options
    if spec.personalised:
        strategy = build_personalised_strategy(
            spec.name,
            {},
            clients_per_round=2,
            sampling="poisson",
            population=8,
            seed=0,
            rounds=4,
            evaluate_every=2,
            head_layers=1,
        )
    elif spec.text:
        strategy = build_text_strategy(
            spec.name,
            {**REQUIRED[spec.name], **TINY},
            _tiny_text_source(),
            expected_clients=2,
            evaluate_fraction=0.0,
            seed=0,
            population=3,
            rounds=4,
        )
    else:
        strategy = build_strategy(
            spec.name,
            REQUIRED.get(spec.name, {}),
            expected_clients=4,
            evaluate_fraction=0.0,
            seed=0,
            population=100,
            rounds=4,
        )
    assert strategy is not None


def _tiny_text_source():
    """A three-client federation from in-memory texts, registered under its spec."""
    from fedsim.data.text import (  # noqa: PLC0415
        TextSourceSpec,
        in_memory_federation,
        register_text_federation,
    )

    clients = [(f"c{i}", [f"client {i} text number {j} of four" for j in range(4)])
               for i in range(3)]  # fmt: skip
    public = [f"a public example sentence {k}" for k in range(4)]
    source = TextSourceSpec(kind="table", path="in-memory-options-contract")
    register_text_federation(source, in_memory_federation(clients, public))
    return source


def test_build_strategy_reads_the_declared_options():
    """The registry reads a config's mapping with the spec's type: the error names the key."""
    with pytest.raises(ConfigError) as err:
        build_strategy(
            "fedadam", {"eta": "fast"}, expected_clients=4, evaluate_fraction=0.0, seed=0
        )
    assert err.value.key == f"{WHERE}.eta" and err.value.value == "fast"
    with pytest.raises(ConfigError) as err:
        build_strategy(
            "dp-fedavg",
            {"clipping_norm": True, "noise_multiplier": 1.0},
            expected_clients=4,
            evaluate_fraction=0.0,
            seed=0,
        )
    assert err.value.key == f"{WHERE}.clipping_norm"


def test_the_predicates_read_keys_as_the_options_are_read():
    """``-`` and ``_`` spell the same key for the builder and for the spec's predicates (the
    client app, the proximal term and the evaluation check follow the built strategy)."""
    from strategies.plumbing.secure_aggregation import SecureAggregation  # noqa: PLC0415
    from strategies.registry import spec_for  # noqa: PLC0415

    dashed = {"secure-sum": "secagg"}
    built = build_strategy("fedavg", dashed, expected_clients=4, evaluate_fraction=0.0, seed=0)
    assert isinstance(built, SecureAggregation)
    assert spec_for("fedavg").secure_replies(dashed)
    assert spec_for("fedavg").client_app_for(dashed) is not None
    assert spec_for("dp-fedavg").proximal({"server-optimizer": "fedprox"})
    assert not spec_for("dp-fedavg").proximal({"server_optimizer": "fedadam"})
