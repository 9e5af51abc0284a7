"""Your model and data in ``fedsim run`` (issue 20, point 1): a model factory with its options,
a Python loader and CSV / Parquet tables, under DP-FedAvg, DMM and FedAvg, and the errors
that name the key, the value and what is allowed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from byo_support import write_tables, write_user_module

from fedsim.config import ConfigError
from fedsim.data import DatasetSpec, build_dataset
from fedsim.frontend.experiment import run_experiment
from fedsim.frontend.results import read_rounds
from fedsim.frontend.run_config import ExperimentConfig
from fedsim.models import ModelSpec, build_model
from fedsim.randomness import RunSecret

SECRETS = RunSecret.from_passphrase("your model and data")


@pytest.fixture()
def code(tmp_path):
    """The directory of the user's module (not on the tests' sys.path)."""
    return str(write_user_module(tmp_path / "user_code"))


def config(code, log="", rounds=2, strategy=None, data=None, **tables):
    raw = {
        "rounds": rounds,
        "seed": 3,
        "data": data
        or {
            "source": "python",
            "loader": "byo_user:clients",
            "python_path": [code],
            "partition": "natural",
            "num_clients": 8,
            "options": {"count": 8},
        },
        "model": {"factory": "byo_user:make", "python_path": [code], "width": 6, "log": log},
        "client": {"epochs": 1, "batch_size": 8, "lr": 0.1},
        "engine": {"backend": "local", "device": "cpu"},
        "strategy": strategy or {"name": "fedavg", "clients_per_round": 4},
    }
    raw.update(tables)
    return ExperimentConfig.from_dict(raw)


def rounds_of(out):
    return [r for r in read_rounds(out / "rounds.jsonl") if r["round"] >= 1]


def test_a_custom_model_on_python_data_runs_dp_fedavg(code, tmp_path):
    """DP-FedAvg on the factory's model: epsilon in every round line and growing, the
    factory's option (width 6) shapes the stored model, and the model and every batch it
    saw were on the configured device."""
    log = tmp_path / "forward.log"
    strategy = {
        "name": "dp-fedavg",
        "clients_per_round": 4,
        "options": {"clipping_norm": 1.0, "noise_multiplier": 0.8},
    }
    cfg = config(code, log=str(log), strategy=strategy)
    summary = run_experiment(cfg, tmp_path / "run", progress=False, secrets=SECRETS)
    lines = rounds_of(tmp_path / "run")
    eps = [r["privacy"]["epsilon"] for r in lines]
    assert len(eps) == 2 and 0 < eps[0] < eps[1]
    assert summary["privacy"]["epsilon"] == pytest.approx(eps[-1])
    model = np.load(tmp_path / "run" / "model.npz")
    assert model["hidden.weight"].shape == (6, 5) and model["out.weight"].shape == (3, 6)
    seen = log.read_text().split("\n")[:-1]
    assert seen and all(line.split()[:2] == ["cpu", "cpu"] for line in seen)
    assert {int(line.split()[2]) for line in seen} == {os.getpid()}  # in-process workers
    # training batches (at most batch_size rows) reached the model, not only evaluation
    assert any(line.endswith("(8, 5)") for line in seen)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["options"] == {"width": 6, "log": str(log)}
    assert saved["model"]["kind"] == "factory"
    # the stored config loads back to the same config (resume and audits read it)
    assert ExperimentConfig.from_dict(saved) == cfg


def test_a_custom_model_on_python_data_runs_dmm(code, tmp_path):
    """DMM (full mode: committee, shares, secure transfer) on the factory's model."""
    strategy = {
        "name": "dmm",
        "clients_per_round": 12,
        "sampling": "min-separation",
        "options": {
            "clipping_norm": 1.0,
            "noise_multiplier": 1.0,
            "committee_size": 11,
            "threshold": 2,
            "packing": 1,
            "member_dropouts": 2,
        },
    }
    data = {
        "source": "python",
        "loader": "byo_user:clients",
        "python_path": [code],
        "partition": "natural",
        "num_clients": 24,
        "options": {"count": 24, "rows": 12},
    }
    cfg = config(code, rounds=3, strategy=strategy, data=data)
    run_experiment(cfg, tmp_path / "run", progress=False, secrets=SECRETS)
    lines = rounds_of(tmp_path / "run")
    assert [r["privacy"]["mode"] for r in lines] == ["full"] * 3
    eps = [r["privacy"]["epsilon"] for r in lines]  # each client trains every 2nd round
    assert 0 < eps[0] <= eps[1] < eps[2]
    model = np.load(tmp_path / "run" / "model.npz")
    assert set(model.files) == {"hidden.weight", "hidden.bias", "out.weight", "out.bias"}
    assert all(np.all(np.isfinite(model[k])) for k in model.files)


def test_a_custom_model_trains_with_client_dp_sgd(code, tmp_path):
    """Opacus wraps the factory's model (per-example gradients of its Linear layers); every
    round line carries the worst client's own epsilon."""
    client = {"batch_size": 8, "dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}
    cfg = config(code, rounds=1, client=client)
    summary = run_experiment(cfg, tmp_path / "run", progress=False, secrets=SECRETS)
    [line] = rounds_of(tmp_path / "run")
    assert line["client_privacy"]["clients"] == 4 and line["client_privacy"]["max_epsilon"] > 0
    assert summary["max_client_epsilon"] == line["client_privacy"]["max_epsilon"]


def test_ray_workers_import_the_factory_from_python_path(code, tmp_path, ray_engine):
    """On Ray's worker processes (started before the user's directory was known, so never
    with it on their sys.path) the spec's import string is resolved again from python_path
    and the factory's model trains there."""
    log = tmp_path / "forward.log"
    cfg = config(code, log=str(log), rounds=1)
    run_experiment(cfg, tmp_path / "run", progress=False, engine=ray_engine, secrets=SECRETS)
    lines = [line.split(" ", 3) for line in log.read_text().split("\n")[:-1]]
    # training batches: 24 training rows per client in batches of 8 (the driver's model
    # check runs 2 rows, its central evaluation the 48 held-out rows at once)
    train_pids = {int(pid) for _, _, pid, shape in lines if shape == "(8, 5)"}
    assert train_pids and os.getpid() not in train_pids
    assert os.getpid() in {int(pid) for _, _, pid, shape in lines if shape == "(2, 5)"}
    assert rounds_of(tmp_path / "run")[0]["train"]["clients"] == 4


def test_fedavg_learns_from_a_csv_table_with_natural_clients(code, tmp_path):
    """A CSV table's ``user`` column gives the clients; FedAvg on the factory's model learns
    (central accuracy well above the 1/3 of chance after 3 rounds)."""
    paths = write_tables(tmp_path / "tables")
    data = {
        "source": "table",
        "path": str(paths["csv"]),
        "client_column": "user",
        "label_column": "target",
        "partition": "natural",
        "num_clients": 8,
    }
    cfg = config(code, rounds=3, data=data, evaluation={"every": 1})
    summary = run_experiment(cfg, tmp_path / "run", progress=False, secrets=SECRETS)
    assert summary["final"]["central"]["accuracy"] > 0.6


def test_tables_without_a_client_column_are_split_by_the_partition(tmp_path):
    paths = write_tables(tmp_path / "tables")
    spec = DatasetSpec(
        source="table",
        path=str(paths["parquet"]),
        label_column="target",
        partition="dirichlet",
        num_clients=5,
        seed=1,
    )
    dataset = build_dataset(spec)
    assert dataset.num_clients == 5 and dataset.feature_shape == (5,)
    assert len(dataset.train.y) + len(dataset.test.y) == 240 and dataset.num_classes == 3
    natural = DatasetSpec(**{**spec.__dict__, "partition": "natural"})
    with pytest.raises(ConfigError, match=r"data\.client_column = 'client_id' .*columns present"):
        build_dataset(natural)


def test_the_three_forms_a_loader_may_return(code):
    base = {"source": "python", "python_path": (code,), "seed": 0}
    pooled = build_dataset(
        DatasetSpec(**base, loader="byo_user:pooled", partition="iid", num_clients=4)
    )
    assert pooled.num_clients == 4 and len(pooled.train.y) + len(pooled.test.y) == 200
    per_client = build_dataset(
        DatasetSpec(**base, loader="byo_user:clients", partition="natural", num_clients=3)
    )
    assert per_client.num_clients == 3
    assert (per_client.train.sizes() + per_client.test.sizes()).tolist() == [30, 30, 30]
    resplit = build_dataset(
        DatasetSpec(**base, loader="byo_user:clients", partition="shards", num_clients=4)
    )
    assert len(resplit.train.y) + len(resplit.test.y) == 8 * 30
    own_test = build_dataset(
        DatasetSpec(**base, loader="byo_user:with_test", partition="natural", num_clients=4)
    )
    assert own_test.train.sizes().tolist() == [20, 20, 20, 20]
    assert own_test.test.sizes().tolist() == [5, 6, 7, 0]  # the last client has none
    options = build_dataset(
        DatasetSpec(
            **base,
            loader="byo_user:clients",
            partition="natural",
            num_clients=2,
            options={"count": 2, "rows": 10},
        )
    )
    assert (options.train.sizes() + options.test.sizes()).tolist() == [10, 10]


LOADER_ERRORS = [
    ("byo_user:mismatched_lengths", r"client 'a': x has 4 rows and y 3 labels"),
    ("byo_user:empty_client", r"client 'b': no rows"),
    ("byo_user:float_labels", r"integer class labels, it has dtype float64"),
    ("byo_user:negative_labels", r"labels must be >= 0"),
    ("byo_user:other_features", r"client 'b' has features of shape \(6,\)"),
    ("byo_user:flat_x", r"shape \(n, \*feature_shape\), it has shape \(4,\)"),
    ("byo_user:one_class", r"at least 2 classes"),
    ("byo_user:a_list", r"it returned a list"),
    ("byo_user:unknown_test_client", r"test mapping has clients the training mapping lacks"),
]


@pytest.mark.parametrize("loader, message", LOADER_ERRORS)
def test_what_a_loader_returns_is_checked_and_the_error_names_the_loader(code, loader, message):
    spec = DatasetSpec(
        source="python", loader=loader, python_path=(code,), partition="natural", num_clients=1
    )
    expected = rf"data\.loader = '{loader}' is not allowed: .*{message}"
    with pytest.raises(ConfigError, match=expected):
        build_dataset(spec)


REFERENCE_ERRORS = [
    ("byo_user", r"'package.module:function'"),
    ("no_such_module_xyz:load", r"importable module: importing 'no_such_module_xyz' failed"),
    ("byo_user:missing", r"a name defined in module 'byo_user' \(it has no 'missing'\)"),
    ("byo_user:NOT_CALLABLE", r"a callable \(it names a int\)"),
]


@pytest.mark.parametrize("reference, message", REFERENCE_ERRORS)
def test_a_bad_loader_or_factory_reference_is_refused_naming_the_key(code, reference, message):
    with pytest.raises(ConfigError, match=rf"data\.loader = '{reference}' .*{message}"):
        DatasetSpec(
            source="python", loader=reference, python_path=(code,), partition="iid", num_clients=2
        )
    raw = {
        "rounds": 1,
        "data": {"source": "digits", "partition": "iid", "num_clients": 4},
        "model": {"factory": reference, "python_path": [code]},
    }
    with pytest.raises(ConfigError, match=rf"model\.factory = '{reference}' .*{message}"):
        ExperimentConfig.from_dict(raw)


def test_the_module_is_imported_only_from_python_path(code, tmp_path):
    """Without python_path the user's module is not found (it is not installed), and the
    error says where to put its directory."""
    common = {"source": "python", "partition": "iid", "num_clients": 2}
    with pytest.raises(ConfigError, match=r"data\.loader .*python_path"):
        DatasetSpec(loader="byo_user_elsewhere:clients", **common)
    nowhere = (str(tmp_path / "nowhere"),)
    with pytest.raises(ConfigError, match=r"data\.python_path = '.*nowhere' .*existing directory"):
        DatasetSpec(loader="byo_user:clients", python_path=nowhere, **common)


@pytest.mark.parametrize(
    "model, key, message",
    [
        (
            {"factory": "byo_user:not_a_module"},
            "model.factory",
            r"returning a torch.nn.Module \(it returned a str\)",
        ),
        (
            {"factory": "byo_user:wrong_output"},
            "model.factory",
            r"logits of shape \(n, num_classes\) = \(2, 3\) for a batch of 2 "
            r"\(it returned \(2, 4\)\)",
        ),
        (
            {"factory": "byo_user:make", "depth": 3},
            "model.factory",
            r"accepting the keyword arguments \['depth', 'input_shape', 'num_classes'\]",
        ),
        (
            {"factory": "byo_user:make", "num_classes": 3},
            "model.num_classes",
            r"the factory gets it from the data",
        ),
    ],
)
def test_a_factory_that_does_not_fit_the_data_is_refused_before_the_rounds(
    code, tmp_path, model, key, message
):
    raw = {
        "rounds": 1,
        "data": {
            "source": "python",
            "loader": "byo_user:clients",
            "python_path": [code],
            "partition": "natural",
            "num_clients": 4,
            "options": {"count": 4},
        },
        "model": {"python_path": [code], **model},
        "engine": {"backend": "local"},
        "strategy": {"clients_per_round": 2},
    }
    with pytest.raises(ConfigError) as err:
        run_experiment(
            ExperimentConfig.from_dict(raw), tmp_path / "run", progress=False, secrets=SECRETS
        )
    assert err.value.key == key
    assert err.match(message)
    assert not (tmp_path / "run" / "rounds.jsonl").exists() or not rounds_of(tmp_path / "run")


def test_a_factory_gets_only_the_data_arguments_its_signature_names(code):
    spec = ModelSpec(
        kind="factory",
        factory="byo_user:make_without_data_arguments",
        python_path=(code,),
        options={"width": 7},
        input_shape=(5,),
        num_classes=3,
    )
    model = build_model(spec)
    assert model[1].out_features == 7
    out = model(torch.zeros(2, 5))
    assert out.shape == (2, 3)


@pytest.mark.parametrize(
    "model, key",
    [
        ({"kind": "factory", "factory": "byo_user:make", "hidden": [32]}, "model.hidden"),
        ({"kind": "mlp", "factory": "byo_user:make"}, "model.kind"),
        ({"kind": "mlp", "options": {"width": 3}}, "model.options"),
        ({"factory": "byo_user:make", "width": 3, "options": {"width": 4}}, "model.width"),
    ],
)
def test_model_tables_that_contradict_themselves_are_refused(code, model, key):
    raw = {
        "rounds": 1,
        "data": {"source": "digits", "partition": "iid", "num_clients": 4},
        "model": {"python_path": [code], **model},
    }
    if "factory" not in model:
        raw["model"].pop("python_path")
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict(raw)
    assert err.value.key == key


@pytest.mark.parametrize(
    "data, key",
    [
        ({"source": "digits", "loader": "byo_user:clients"}, "data.loader"),
        ({"source": "digits", "options": {"count": 2}}, "data.options"),
        ({"source": "python"}, "data.loader"),
    ],
)
def test_loader_keys_belong_to_source_python(data, key):
    with pytest.raises(ConfigError) as err:
        DatasetSpec(partition="iid", num_clients=2, **data)
    assert err.value.key == key


def test_a_table_error_names_the_data_key(tmp_path):
    paths = write_tables(tmp_path / "tables")
    spec = DatasetSpec(
        source="table",
        path=str(paths["csv"]),
        client_column="user",
        partition="natural",
        num_clients=2,
    )
    with pytest.raises(ConfigError, match=r"data\.label_column = 'label' .*present: user, target"):
        build_dataset(spec)
