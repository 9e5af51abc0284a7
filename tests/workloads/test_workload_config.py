"""Client methods selected by config keys: [client.optimizer], [client.averaging],
[client.compression], [strategy.averaging], through run_experiment into rounds.jsonl."""

import pytest

from fedsim.config import ConfigError, from_mapping
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.workloads.averaging import Averaging
from fedsim.workloads.compression import Quantization
from fedsim.workloads.optim import ClientOptimizer
from fedsim.workloads.supervised import LocalTraining


def config(client=None, strategy=None):
    return ExperimentConfig.from_dict(
        {
            "name": "methods",
            "seed": 3,
            "rounds": 3,
            "data": {"source": "digits", "partition": "iid", "num_clients": 12},
            "model": {"kind": "mlp", "hidden": [16]},
            "client": {"epochs": 1, "batch_size": 16, "lr": 0.1, **(client or {})},
            "strategy": {"name": "fedavg", "clients_per_round": 6, **(strategy or {})},
            "evaluation": {"every": 1, "central_rows": 100},
            "engine": {"backend": "local"},
        }
    )


def test_client_tables_become_method_configs():
    training = from_mapping(
        LocalTraining,
        {
            "optimizer": {"name": "mars-lion", "lr": 1e-3},
            "averaging": {"kind": "ema", "beta": 0.9},
            "compression": {"bits": 4, "levels": "adaptive"},
        },
        "client",
    )
    assert training.optimizer == ClientOptimizer(name="mars-lion", lr=1e-3)
    assert training.averaging == Averaging(kind="ema", beta=0.9)
    assert training.compression == Quantization(bits=4, levels="adaptive")
    assert training.uses_methods and not LocalTraining().uses_methods


def test_bad_method_keys_name_themselves():
    with pytest.raises(ConfigError, match="client.optimizer.name"):
        config({"optimizer": {"name": "adam"}})
    with pytest.raises(ConfigError, match="client.compression.bits"):
        config({"compression": {"bits": 40}})
    with pytest.raises(ConfigError, match="strategy.averaging.k"):
        config(strategy={"averaging": {"k": 0}})
    with pytest.raises(ConfigError, match="strategy.partial_aggregation"):
        config({"compression": {"bits": 4}}, {"partial_aggregation": "on"})
    with pytest.raises(ConfigError, match="client.optimizer"):
        config(
            {"optimizer": {"name": "mars-adamw"}},
            {"name": "fedprox", "options": {"proximal_mu": 0.1}},
        )
    with pytest.raises(ConfigError, match="client.averaging"):
        config({"momentum": 0.9, "keep_momentum": True, "averaging": {"kind": "lawa"}})


def test_quantised_uploads_and_server_lawa_from_config_reach_rounds_jsonl(tmp_path):
    dense_dir, quant_dir = tmp_path / "dense", tmp_path / "quant"
    run_experiment(
        config({"optimizer": {"name": "mars-adamw", "lr": 1e-2}}), dense_dir, progress=False
    )
    run_experiment(
        config(
            {"optimizer": {"name": "mars-adamw", "lr": 1e-2}, "compression": {"bits": 4}},
            {"averaging": {"kind": "lawa", "k": 2}},
        ),
        quant_dir,
        progress=False,
    )
    dense = [r for r in read_rounds(dense_dir / "rounds.jsonl") if r["round"] >= 1]
    quant = [r for r in read_rounds(quant_dir / "rounds.jsonl") if r["round"] >= 1]
    coordinates = 64 * 16 + 16 + 16 * 10 + 10
    for d, q in zip(dense, quant, strict=True):
        assert q["train"]["metrics"]["upload-bits"] == 4 * 32 + 4 * coordinates
        assert q["aggregated"]["upload-bits-total"] == 6 * (4 * 32 + 4 * coordinates)
        assert q["bytes_up"] < 0.3 * d["bytes_up"]
        assert 0 <= q["central"]["accuracy"] <= 1
    assert quant[-1]["central"]["accuracy"] > 0.3
