"""The client training interface: one minibatch helper, one place that checks combinations,
one dispatcher from the [client] table to the implementation."""

import dataclasses
import itertools

import pytest
import torch

from fedsim.config import ConfigError
from fedsim.models import ModelSpec
from fedsim.workloads.constrained import ConstrainedTraining
from fedsim.workloads.dp_sgd import PrivateSGD
from fedsim.workloads.lora_client import AdapterTraining
from fedsim.workloads.methods import MethodsTraining
from fedsim.workloads.sgd import SGDTraining
from fedsim.workloads.supervised import PARTS, LocalTraining, check_parts, client_training
from fedsim.workloads.training import minibatches

#: the smallest valid table of each part
TABLES = {
    "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
    "optimizer": {"name": "mars-adamw"},
    "averaging": {"kind": "ema"},
    "compression": {"bits": 4},
    "conformal": {},
    "sst": {},
    "constraints": {},
    "lora": {"rounds": 2},
}
#: the pairs of parts a client may combine; every other pair is refused
COMBINABLE = {
    frozenset(pair)
    for pair in (
        ("optimizer", "averaging"),
        ("optimizer", "compression"),
        ("optimizer", "conformal"),
        ("optimizer", "sst"),
        ("optimizer", "lora"),
        ("averaging", "compression"),
        ("averaging", "conformal"),
        ("compression", "conformal"),
        ("compression", "sst"),
        ("conformal", "sst"),
    )
}
LOGREG = ModelSpec(kind="logreg", input_shape=(64,), num_classes=10)
MLP = ModelSpec(kind="mlp", input_shape=(64,), num_classes=10, hidden=(8,))


def handwritten(n, batch_size, generator, epochs, max_steps, between=None):
    """The loop every training module used to write out."""
    batches, steps = [], 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            if max_steps and steps >= max_steps:
                break
            batches.append(order[start : start + batch_size])
            if between is not None:
                between()
            steps += 1
    return batches


@pytest.mark.parametrize(
    "n, batch_size, epochs, max_steps", [(10, 3, 2, 0), (10, 3, 3, 5), (7, 7, 1, 0), (0, 4, 2, 0)]
)
def test_minibatches_draw_the_stream_of_the_handwritten_loop(n, batch_size, epochs, max_steps):
    ours_gen, theirs_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn = []  # a step that also draws from the generator (zeroth-order directions, SST)
    ours = []
    for idx in minibatches(n, batch_size, ours_gen, epochs=epochs, max_steps=max_steps):
        ours.append(idx)
        drawn.append(torch.rand(1, generator=ours_gen))
    theirs_drawn = []
    theirs = handwritten(
        n,
        batch_size,
        theirs_gen,
        epochs,
        max_steps,
        between=lambda: theirs_drawn.append(torch.rand(1, generator=theirs_gen)),
    )
    budget = epochs * -(-n // batch_size)
    assert len(ours) == len(theirs) == (min(max_steps, budget) if max_steps else budget)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(drawn, theirs_drawn, strict=True))
    assert torch.equal(ours_gen.get_state(), theirs_gen.get_state())


@pytest.mark.parametrize("pair", list(itertools.combinations(TABLES, 2)))
def test_each_pair_of_parts_combines_or_names_one_of_its_keys(pair):
    tables = {key: TABLES[key] for key in pair}
    if frozenset(pair) in COMBINABLE:
        training = LocalTraining(**tables)
        assert all(getattr(training, key) is not None for key in pair)
        return
    with pytest.raises(ConfigError) as caught:
        LocalTraining(**tables)
    key = caught.value.key
    assert key.startswith(tuple(f"client.{part}" for part in pair)), key
    assert str(caught.value.value) in str(caught.value)  # the message shows the value


@pytest.mark.parametrize("part", list(TABLES))
def test_every_part_refuses_fedprox(part):
    training = LocalTraining(**{part: TABLES[part]})
    check_parts(training)  # alone it is fine
    with pytest.raises(ConfigError, match=rf"client\.{part} = .*FedProx"):
        check_parts(training, fedprox=True)


def test_plain_sgd_takes_fedprox():
    check_parts(LocalTraining(momentum=0.9, keep_momentum=True), fedprox=True)


@pytest.mark.parametrize("part", ["sst", "averaging", "conformal", "lora", "dp_sgd"])
def test_kept_momentum_refuses_what_it_refused(part):
    allowed = part == "dp_sgd"
    tables = {part: TABLES[part], "momentum": 0.9, "keep_momentum": True}
    if allowed:
        assert LocalTraining(**tables).keep_momentum
        return
    with pytest.raises(ConfigError, match=rf"client\.{part}\b"):
        LocalTraining(**tables)


def test_whole_batch_optimisers_name_the_optimizer():
    for part in ("conformal", "sst", "lora"):
        for name in ("r-adazo", "zo-adamm", "hdm-hb"):
            with pytest.raises(ConfigError, match=rf"client\.optimizer\.name = '{name}'.*{part}"):
                LocalTraining(optimizer={"name": name}, **{part: TABLES[part]})


def test_declared_exclusions_name_known_features_and_keys():
    features = set(PARTS) | {"keep_momentum", "fedprox", "whole-batch-optimizer"}
    for key, (_, exclusions) in PARTS.items():
        for exclusion in exclusions:
            assert exclusion.feature in features, (key, exclusion)
            named = (exclusion.named or key).split(".")[0]
            assert named in {f.name for f in dataclasses.fields(LocalTraining)}, (key, exclusion)


def test_the_dispatcher_picks_one_implementation_per_table():
    assert type(client_training(MLP, LocalTraining())) is SGDTraining
    dp = LocalTraining(dp_sgd=TABLES["dp_sgd"])
    assert type(client_training(MLP, dp)) is PrivateSGD
    for part in ("optimizer", "averaging", "compression", "conformal", "sst"):
        chosen = client_training(MLP, LocalTraining(**{part: TABLES[part]}))
        assert type(chosen) is MethodsTraining and getattr(chosen, part) is not None
    constrained = LocalTraining(constraints=TABLES["constraints"])
    assert type(client_training(LOGREG, constrained)) is ConstrainedTraining
    with pytest.raises(ValueError, match="logreg"):
        client_training(MLP, constrained)
    lora = LocalTraining(lora={"rounds": 2, "targets": ["layers.0"]}, optimizer={"name": "sgd"})
    chosen = client_training(MLP, lora)
    assert type(chosen) is AdapterTraining and chosen.optimizer.name == "sgd"
