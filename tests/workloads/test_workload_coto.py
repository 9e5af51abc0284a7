"""CoTo progressive LoRA activation, adapter merging and federated LoRA fine-tuning."""

import json
import math
import random

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec, build_dataset
from fedsim.engine.rounds import run_rounds
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.models import ModelSpec, build_model, initial_arrays, load_arrays
from fedsim.record_codec import to_numpy, to_record
from fedsim.workloads.coto import (
    CoToController,
    CoToSchedule,
    LoRATraining,
    adapter_arrays,
    adapter_groups,
    build_lora_model,
    initial_adapter_arrays,
    interpolate_adapters,
    load_adapter_arrays,
    lora_groups,
    merged_arrays,
    prune_adapters,
)
from fedsim.workloads.lora_client import train_lora
from fedsim.workloads.methods import train_with_methods
from fedsim.workloads.optim import ClientOptimizer
from fedsim.workloads.supervised import LocalTraining, make_client_app
from fedsim.workloads.training import client_generator

SPEC = ModelSpec(kind="mlp", input_shape=(64,), num_classes=10, hidden=(16, 16))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (many threads only contend on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained_like(model, seed=0, scale=0.3):
    """Give the adapters nonzero A and B (a fresh adapter has B = 0)."""
    rng = np.random.default_rng(seed)
    arrays = {
        k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32)
        for k, v in adapter_arrays(model).items()
    }
    load_adapter_arrays(model, arrays)
    return arrays


def test_schedule_rises_linearly_from_p0_to_one_at_three_quarters():
    schedule = CoToSchedule(0.1, total_steps=100)
    assert schedule.probability(0) == pytest.approx(0.1)
    assert schedule.probability(75) == 1.0 and schedule.probability(99) == 1.0
    rising = [schedule.probability(t) for t in range(76)]
    assert np.allclose(np.diff(rising), 0.9 / 75)
    assert CoToSchedule(0.1, total_steps=10).ramp_steps == 8  # ceil(0.75 * 10)
    for kwargs, key in (
        ({"p0": 0.0, "total_steps": 10}, "p0"),
        ({"p0": 0.5, "total_steps": 0}, "total_steps"),
        ({"p0": 0.5, "total_steps": 10, "ramp": 1.5}, "ramp"),
    ):
        with pytest.raises(ConfigError, match=key):
            CoToSchedule(**kwargs)


def test_active_fraction_tracks_p_of_t():
    spec = ModelSpec(kind="mlp", input_shape=(8,), num_classes=2, hidden=(4,) * 5)
    model = build_lora_model(spec, LoRATraining(rank=1))
    groups = len(lora_groups(model))
    assert groups == 6
    total = 4000
    controller = CoToController(model, CoToSchedule(0.1, total), torch.Generator().manual_seed(0))
    active = np.array([controller.activate(t) for t in range(total)], dtype=float)
    assert active.sum(axis=1).min() >= 1  # redrawn until some group is active
    p = np.array([controller.schedule.probability(t) for t in range(total)])
    # each group is Bernoulli(p) given that not all of them are off
    expected = p / (1 - (1 - p) ** groups)
    for window in np.array_split(np.arange(total), 10):
        assert active[window].mean() == pytest.approx(expected[window].mean(), abs=0.04)
    assert active[:400].mean() < 0.35 and active[3000:].mean() == 1.0
    assert controller.active_fraction == pytest.approx(active.mean())
    # the same seed draws the same groups
    again = CoToController(model, CoToSchedule(0.1, total), torch.Generator().manual_seed(0))
    assert [again.activate(t) for t in range(50)] == active[:50].astype(bool).tolist()


def test_inactive_layers_return_the_base_output_and_get_no_gradient():
    model = build_lora_model(SPEC, LoRATraining(rank=2), adapter_seed=1)
    trained_like(model)
    seen = {}
    layers = {name: layers[0] for name, layers in lora_groups(model).items()}
    for name, layer in layers.items():
        layer.register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, (args[0], out))
        )
    controller = CoToController(model, CoToSchedule(0.4, 1000), torch.Generator().manual_seed(3))
    x = torch.randn(7, 64)
    patterns = set()
    for step in range(12):
        flags = controller.activate(step)
        patterns.add(tuple(flags))
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), torch.arange(7)).backward()
        for (name, layer), on in zip(layers.items(), flags, strict=True):
            inputs, out = seen[name]
            base_out = layer.base_layer(inputs)
            lora_params = [p for n, p in layer.named_parameters() if "lora_" in n]
            if on:
                assert not torch.equal(out, base_out)
                assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_params)
            else:
                assert torch.equal(out, base_out)  # exactly the base output, no rescaling
                assert all(p.grad is None for p in lora_params)  # no gradient at all
    assert len(patterns) > 2  # the draws varied


def test_optimiser_leaves_inactive_adapters_untouched():
    model = build_lora_model(SPEC, LoRATraining(rank=2), adapter_seed=1)
    trained_like(model)
    groups = lora_groups(model)
    controller = CoToController(model, CoToSchedule(0.3, 100), torch.Generator().manual_seed(5))
    flags = []
    x, y = torch.randn(8, 64), torch.arange(8) % 10
    before = adapter_arrays(model)
    training = LocalTraining(epochs=1, batch_size=8, lr=0.1, momentum=0.0)
    train_with_methods(
        model,
        x,
        y,
        training,
        torch.Generator().manual_seed(0),
        optimizer=ClientOptimizer(name="mars-adamw", lr=1e-2, weight_decay=0.1),
        before_step=lambda step: flags.append(controller.activate(step)),
    )
    after = adapter_arrays(model)
    assert len(flags) == 1 and not all(flags[0])
    for name, on in zip(groups, flags[0], strict=True):
        keys = [k for k in before if k.startswith(f"{name}.lora_")]
        assert len(keys) == 2
        changed = [not np.array_equal(before[k], after[k]) for k in keys]
        assert all(changed) if on else not any(changed)


def test_p0_one_is_plain_lora_exactly():
    digits = build_dataset(DatasetSpec(source="digits", partition="iid", num_clients=4, seed=0))
    x = torch.as_tensor(np.asarray(digits.train.client(0)[0]), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(digits.train.client(0)[1]), dtype=torch.int64)
    spec = ModelSpec(kind="mlp", input_shape=digits.feature_shape, num_classes=10, hidden=(16,))
    results = {}
    for name, lora in (
        ("plain", LoRATraining(rank=2, coto=False, rounds=3)),
        ("coto-p0-1", LoRATraining(rank=2, coto=True, coto_p0=1.0, rounds=3)),
        ("coto", LoRATraining(rank=2, coto=True, coto_p0=0.1, rounds=3)),
    ):
        model = build_lora_model(spec, lora, adapter_seed=2)
        training = LocalTraining(epochs=2, batch_size=16, lr=0.2, momentum=0.5, lora=lora)
        shuffling = client_generator(training.seed, 1, 0)
        result = train_lora(
            model, x, y, training, lora, shuffling, server_round=1, partition_id=0
        )
        metrics = {"train_loss": result.loss, **result.metrics}
        results[name] = (adapter_arrays(model), metrics, model(x[:20]).detach())
    plain, ones, coto = results["plain"], results["coto-p0-1"], results["coto"]
    for key, value in plain[0].items():
        np.testing.assert_array_equal(ones[0][key], value)
    assert ones[1]["train_loss"] == plain[1]["train_loss"]
    assert torch.equal(ones[2], plain[2])
    assert ones[1]["coto-active-fraction"] == 1.0
    assert 0 < coto[1]["coto-active-fraction"] < 0.6
    assert any(not np.array_equal(coto[0][k], v) for k, v in plain[0].items())


def test_merged_model_equals_the_adapter_model():
    model = build_lora_model(SPEC, LoRATraining(rank=3, alpha=6.0), adapter_seed=4)
    trained_like(model)
    x = torch.randn(32, 64)
    merged = merged_arrays(model)
    plain = build_model(SPEC)
    assert merged.keys() == plain.state_dict().keys()
    load_arrays(plain, merged)
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-5)
    assert adapter_arrays(model)  # the model keeps its adapters
    base = initial_arrays(SPEC, 0)
    assert not np.array_equal(merged["layers.0.weight"], base["layers.0.weight"])
    np.testing.assert_array_equal(merged["layers.0.bias"], base["layers.0.bias"])


def test_interpolation_and_pruning_of_adapters():
    model = build_lora_model(SPEC, LoRATraining(rank=2), adapter_seed=1)
    first = trained_like(model, seed=1)
    second = {k: v * 2 + 1 for k, v in first.items()}
    np.testing.assert_array_equal(
        interpolate_adapters(first, second, 0.0)["base_model.model.layers.0.lora_A.default.weight"],
        first["base_model.model.layers.0.lora_A.default.weight"],
    )
    middle = interpolate_adapters(first, second, 0.5)
    for k in first:
        np.testing.assert_allclose(middle[k], 1.5 * first[k] + 0.5, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="different keys"):
        interpolate_adapters(first, {k: v for k, v in list(first.items())[1:]}, 0.5)
    groups = adapter_groups(first)
    assert groups == [f"base_model.model.layers.{i}" for i in (0, 2, 4)]
    # pruning a group's adapter equals switching that group's adapter off
    load_adapter_arrays(model, prune_adapters(first, [groups[1]]))
    x = torch.randn(9, 64)
    pruned_out = model(x)
    load_adapter_arrays(model, first)
    lora_groups(model)[groups[1]][0].enable_adapters(False)
    assert torch.equal(pruned_out, model(x))
    with pytest.raises(ValueError, match="layer groups"):
        prune_adapters(first, ["layers.9"])


def test_transformer_blocks_are_the_layer_groups():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    from fedsim.workloads.coto import wrap_lora

    lora = LoRATraining(rank=2, targets=("q_proj", "v_proj", "down_proj"))
    model = wrap_lora(LlamaForCausalLM(config), lora)
    groups = lora_groups(model)
    assert list(groups) == [f"base_model.model.model.layers.{i}" for i in range(3)]
    assert all(len(layers) == 3 for layers in groups.values())
    trained_like(model, scale=0.2)
    tokens = torch.randint(0, 32, (2, 6))
    controller = CoToController(model, CoToSchedule(0.3, 50), torch.Generator().manual_seed(1))
    while True:  # a step with block 0 off and some other block on
        flags = controller.activate(0)
        if not flags[0]:
            break
    full = model(tokens).logits
    # block 0 off equals block 0's adapters removed
    load_adapter_arrays(model, prune_adapters(adapter_arrays(model), list(groups)[:1]))
    controller.enable_all()
    for (name, layers), on in zip(groups.items(), flags, strict=True):
        for layer in layers:
            layer.enable_adapters(on or name == list(groups)[0])
    torch.testing.assert_close(model(tokens).logits, full, rtol=0, atol=0)


def test_lora_config_keys_are_validated():
    training = LocalTraining(lora={"rank": 8, "alpha": 16, "targets": ["layers.0"], "coto_p0": 0.2})
    assert training.lora == LoRATraining(rank=8, alpha=16.0, targets=("layers.0",), coto_p0=0.2)
    for table, key in (
        ({"rank": 0}, "client.lora.rank"),
        ({"coto_p0": 0.0}, "client.lora.coto_p0"),
        ({"coto_p0": 1.5}, "client.lora.coto_p0"),
        ({"coto_ramp": 0}, "client.lora.coto_ramp"),
        ({"alpha": -1}, "client.lora.alpha"),
        ({"dropout": 1.0}, "client.lora.dropout"),
        ({"base": "/nonexistent/model.npz"}, "client.lora.base"),
        ({"rnak": 4}, "client.lora.rnak"),
    ):
        with pytest.raises(ConfigError, match=key):
            LocalTraining(lora=table)
    with pytest.raises(ConfigError, match="client.compression"):
        LocalTraining(lora={}, compression={"bits": 4})
    with pytest.raises(ConfigError, match="client.optimizer.name"):
        LocalTraining(lora={}, optimizer={"name": "r-adazo"})
    data = DatasetSpec(source="digits", partition="iid", num_clients=4, seed=0)
    with pytest.raises(ValueError, match=r"client.lora.targets .*'fc9'"):
        make_client_app(SPEC, data, LocalTraining(lora={"targets": ["fc9"], "rounds": 2}))
    with pytest.raises(ConfigError, match="client.lora.rounds"):
        make_client_app(SPEC, data, LocalTraining(lora={}))
    with pytest.raises(ConfigError, match=r"client.lora = .*FedProx"):
        ExperimentConfig.from_dict(
            {
                "rounds": 2,
                "data": {"source": "digits", "partition": "iid", "num_clients": 4},
                "client": {"lora": {"rank": 2}},
                "strategy": {"name": "fedprox", "clients_per_round": 2},
            }
        )


def test_lora_from_a_config_runs_through_run_experiment(tmp_path, local_engine):
    base_model = tmp_path / "base.npz"
    spec = ModelSpec(kind="mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(16,))
    np.savez(base_model, **initial_arrays(spec, 7))
    config = ExperimentConfig.from_dict(
        {
            "name": "lora",
            "seed": 1,
            "rounds": 2,
            "data": {"source": "digits", "partition": "iid", "num_clients": 6},
            "model": {"kind": "mlp", "hidden": [16]},
            "client": {"batch_size": 32, "lr": 0.2, "lora": {"rank": 2, "base": str(base_model)}},
            "strategy": {"name": "fedavg", "clients_per_round": 3},
            "evaluation": {"every": 1, "central_rows": 100},
            "engine": {"backend": "local"},
        }
    )
    assert config.client.lora.rounds == 2  # CoTo's horizon from the run's rounds
    run_experiment(config, tmp_path / "run", progress=False, engine=local_engine)
    rounds = read_rounds(tmp_path / "run" / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [0, 1, 2]
    last = rounds[-1]
    assert 0 < last["train"]["metrics"]["coto-active-fraction"] <= 1
    assert 0 <= last["central"]["accuracy"] <= 1
    final = np.load(tmp_path / "run" / "model.npz")
    assert set(final.files) == set(initial_adapter_arrays(spec, config.client.lora, 1))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["client"]["lora"]["rank"] == 2


@pytest.mark.ray
def test_coto_client_runs_in_a_client_app_on_ray(ray_engine, tmp_path):
    spec = DatasetSpec(source="digits", partition="dirichlet", alpha=0.5, num_clients=8, seed=2)
    dataset = build_dataset(spec)
    model = ModelSpec(kind="mlp", input_shape=dataset.feature_shape, num_classes=10, hidden=(32,))
    base_path = tmp_path / "base.npz"
    np.savez(base_path, **initial_arrays(model, 3))
    lora = LoRATraining(rank=2, rounds=2, base=str(base_path))
    training = LocalTraining(epochs=1, batch_size=16, lr=0.2, seed=1, lora=lora)
    app = make_client_app(model, spec, training)

    class Phases:
        def __init__(self):
            self.reports = []

        def phase_finished(self, report):
            self.reports.append(report)

    def federate():
        phases = Phases()
        random.seed(0)
        grid = ray_engine.open_run(app, 8, datasets=((spec, dataset),), observer=phases)
        start = to_record(initial_adapter_arrays(model, lora, 0))
        final = run_rounds(FedAvg(fraction_evaluate=0.0), grid, start, 2)
        return to_numpy(final), phases.reports

    (first, reports), (second, _) = federate(), federate()
    start = initial_adapter_arrays(model, lora, 0)
    assert first.keys() == start.keys()  # adapters only travel
    adapter_bytes = sum(v.nbytes for v in start.values())
    full_bytes = sum(v.nbytes for v in initial_arrays(model, 0).values())
    assert adapter_bytes < 0.2 * full_bytes
    train = [r for r in reports if r.message_type.startswith("train")]
    assert [r.succeeded for r in train] == [8, 8]
    for report in train:
        assert 8 * adapter_bytes <= report.bytes_up < 8 * adapter_bytes + 8 * 4096
        assert 0 < report.client_metrics["coto-active-fraction"] <= 1
    for name, value in first.items():
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start[name])
        np.testing.assert_array_equal(value, second[name])  # seeded: same run, same result
    # the federated adapter improves the base model on the pooled test rows
    net = build_lora_model(model, lora)
    x = torch.as_tensor(np.asarray(dataset.test.x), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(dataset.test.y), dtype=torch.int64)
    with torch.no_grad():
        base_loss = float(nn.functional.cross_entropy(net(x), y))
        load_adapter_arrays(net, first)
        assert float(nn.functional.cross_entropy(net(x), y)) < base_loss
    assert math.isfinite(base_loss)
