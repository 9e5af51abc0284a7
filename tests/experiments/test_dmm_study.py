"""The DMM study's validation split, server learning rates and stored choice."""

from __future__ import annotations

import json

import dp_accounting as dpa
import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg, FedAvgM

from experiments.dmm import methods, run, tune
from experiments.dmm.table import CHOICE_FILE, choice_of


def test_validation_and_test_rows_are_disjoint_and_cover_the_test_set():
    validation, test = run.split_rows(361)
    assert len(validation) == 180 and len(test) == 181
    assert not set(validation) & set(test)
    assert np.array_equal(np.sort(np.concatenate([validation, test])), np.arange(361))
    again = run.split_rows(361)  # a fixed public split: the same rows every run
    assert np.array_equal(again[0], validation) and np.array_equal(again[1], test)
    assert not np.array_equal(run.split_rows(361, seed=1)[0], validation)
    with pytest.raises(ValueError, match="count = 1"):
        run.split_rows(1)


def test_the_server_rate_one_is_plain_fedavg_and_others_fedavgm():
    assert type(methods.server_optimizer()) is FedAvg
    other = methods.server_optimizer(0.5)
    assert isinstance(other, FedAvgM)
    assert (other.server_learning_rate, other.server_momentum) == (0.5, 0.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="server learning rate"):
            methods.server_optimizer(bad)


def test_the_noise_does_not_depend_on_the_server_rate():
    st = methods.Setting("digits", 50, 10)
    for method in ("dp-fedavg", "central-bandmf", "ddgauss"):
        a, za = methods.make_strategy(method, 2.0, 0, 650, st, "plaintext", 1.0)
        b, zb = methods.make_strategy(method, 2.0, 0, 650, st, "plaintext", 0.5)
        assert za == zb, method


def _store(directory, method, eps, lr, seed, validation, test):
    row = {
        "method": method,
        "target_epsilon": eps,
        "server_learning_rate": lr,
        "seed": seed,
        "validation_accuracy": validation,
        "accuracy": test,
        "run_nonce": "0" * 32,
    }
    run.write_json(tune.tuning_path(directory, method, eps, lr, seed), row)


def test_changing_stored_test_accuracies_does_not_change_the_choice(tmp_path):
    scores = {(0.5, 100): 0.3, (0.5, 101): 0.35, (1.0, 100): 0.4, (1.0, 101): 0.2}
    for (lr, seed), val in scores.items():
        _store(tmp_path, "ddgauss", 4.0, lr, seed, val, 0.9 if lr == 0.5 else 0.1)
    first = tune.write_choice(tmp_path, [1.0, 0.5], [101, 100])
    assert choice_of(first) == {("ddgauss", 4.0): 0.5}
    assert json.loads((tmp_path / CHOICE_FILE).read_text()) == first
    for path in (tmp_path / "tuning").glob("*.json"):
        row = json.loads(path.read_text())
        row["accuracy"] = 1.0 - row["accuracy"]
        path.write_text(json.dumps(row))
    assert tune.write_choice(tmp_path, [0.5, 1.0], [100, 101]) == first


def test_a_zcdp_round_is_accounted_as_the_gaussian_of_its_rdp_curve():
    assert methods.as_gaussian(dpa.ZCDpEvent(0.5)) == dpa.GaussianDpEvent(1.0)
    assert methods.as_gaussian(dpa.ZCDpEvent(2.0)) == dpa.GaussianDpEvent(0.5)
    other = dpa.GaussianDpEvent(3.0)
    assert methods.as_gaussian(other) is other
    # the same epsilon as the event it replaces, where both are accounted
    for rho in (0.05, 0.5):
        zcdp, gauss = dpa.rdp.RdpAccountant(), dpa.rdp.RdpAccountant()
        zcdp.compose(dpa.ZCDpEvent(rho), 4)
        gauss.compose(methods.as_gaussian(dpa.ZCDpEvent(rho)), 4)
        assert gauss.get_epsilon(1e-5) == pytest.approx(zcdp.get_epsilon(1e-5), rel=1e-3)
