"""The cross-check against the authors' pFedHB code: their loaders get our split exactly,
their settings are ours, and the scale study's findings pair runs by seed."""

import numpy as np
import pytest

from experiments.pfedhb import crosscheck, findings, study, tuning


def _digits_pool_federation():
    from fedsim.data.spec import build_dataset
    from fedsim.frontend.run_config import ExperimentConfig

    config = study.config_for("digits-pairs", "pfedhb-adam", 3, 2)
    config["data"] = {**config["data"], "num_clients": 6, "client_test": "class-pool"}
    return build_dataset(ExperimentConfig.from_dict(config).data)


def test_the_reference_loaders_hold_our_split_row_for_row():
    dataset = _digits_pool_federation()
    train_loaders, test_loaders, n_classes, labels, _, test_ind, relabel = crosscheck.split_loaders(
        dataset, batch_size=50, seed=3
    )
    train, test = dataset.train, dataset.test
    assert n_classes == dataset.num_classes == len(test_loaders) and relabel is False
    assert test_ind == labels  # client_test_ind: each client is tested on its own classes
    for k, loader in enumerate(train_loaders):
        lo, hi = train.offsets[k], train.offsets[k + 1]
        x, y = loader.dataset.tensors
        np.testing.assert_array_equal(x.numpy(), train.x[lo:hi].reshape(hi - lo, -1))
        np.testing.assert_array_equal(y.numpy(), train.y[lo:hi])
        assert labels[k] == sorted(set(train.y[lo:hi].tolist()))
        assert len(labels[k]) == 5
    # the per-class loaders are the pool: every client's test rows of class c are exactly
    # the rows of test loader c
    for k in range(dataset.num_clients):
        lo, hi = test.offsets[k], test.offsets[k + 1]
        for c in labels[k]:
            x, y = test_loaders[c].dataset.tensors
            rows = test.y[lo:hi] == c
            assert (y.numpy() == c).all()
            np.testing.assert_array_equal(x.numpy(), test.x[lo:hi][rows].reshape(rows.sum(), -1))


def test_numpy_1_22_sums_a_generator_and_numpy_2_does_not():
    old = crosscheck.Numpy122()
    assert old.sum(n for n in (3, 4, 5)) == 12
    assert old.sum(np.ones((2, 3)), axis=0).tolist() == [2.0, 2.0, 2.0]
    assert old.float32 is np.float32
    with pytest.raises(TypeError):
        np.sum(n for n in (3, 4, 5))


def test_the_reference_runs_at_our_settings():
    args, ours = crosscheck.REFERENCE_ARGS, study.PERSONAL
    assert (args["local_head_epochs"], args["local_base_epochs"]) == (
        ours["head_steps"],
        ours["body_epochs"],
    )
    assert (args["local_lr_head"], args["local_lr_base"]) == (ours["head_lr"], ours["body_lr"])
    assert (args["batch_size"], args["n_mc"]) == (ours["batch_size"], ours["mc_samples"])
    assert args["kl_coeff_base"] == ours["body_kl"]
    # the stored run is the grid point at the reference's head-KL weight, the authors' solver
    name, options, personal = study.method_settings(crosscheck.METHOD, crosscheck.FEDERATION)
    assert (name, options) == ("pfedhb", {"server_solver": "adam"})
    assert personal["head_kl"] == args["kl_coeff_head"] == 1
    config = study.config_for(crosscheck.FEDERATION, crosscheck.METHOD, crosscheck.SEED, 30)
    assert (
        config["strategy"]["clients_per_round"] / config["data"]["num_clients"]
        == (args["sampling_rate"])
    )

    from strategies.methods.pfedhb import HBConfig

    server = HBConfig()
    assert (server.server_steps, server.server_lr) == (args["global_head_epochs"], 0.01)
    assert args["global_lr_head"] == args["global_lr_base"] == server.server_lr
    assert server.lam_mu == server.lam_sigma == args["mu_regularizer"] == 5
    assert args["sch_step_size"] == server.server_milestones[0] == 60


def _run(method, seed, personal, global_acc=0.5, federation="femnist-pairs-300"):
    return {
        "federation": federation,
        "method": method,
        "seed": seed,
        "curve": [
            {"round": 5, "personal_acc_mean": 0.0, "global_acc": 0.0},
            {"round": 30, "personal_acc_mean": personal, "global_acc": global_acc},
        ],
    }


def test_findings_pair_by_seed_and_the_interval_decides_the_verdict():
    hb, vem = tuning.tuned("pfedhb-adam"), tuning.tuned("pfedvem")
    runs = [_run(hb, s, 0.90 + 0.01 * s) for s in range(4)]
    runs += [_run(vem, s, 0.89 + 0.01 * s + 0.001 * (-1) ** s) for s in range(4)]
    runs += [_run(vem, 9, 0.0), _run(hb, 0, 0.0, federation="femnist-pairs")]  # unpaired
    assert findings.paired(runs, "femnist-pairs-300", hb, vem, "personal_acc_mean") == (
        pytest.approx([0.9, 1.1, 0.9, 1.1])
    )
    text = findings.scale_findings(runs, "femnist-pairs-300")
    assert f"**{hb} − {vem}**: personalised +1.00 [" in text
    assert "**ahead**; global +0.00" in text and "(n = 4)" in text
    # a spread wider than the mean: level
    runs += [_run(vem, s, 0.90 + 0.01 * s + 0.03 * (-1) ** s) for s in range(4, 8)]
    runs += [_run(hb, s, 0.90 + 0.01 * s) for s in range(4, 8)]
    assert "personalised" in findings.supports(runs, "femnist-pairs-300", hb)
    assert f"against {vem} " in findings.supports(runs, "femnist-pairs-300", hb)
    assert ", level" in findings.supports(runs, "femnist-pairs-300", hb)


def test_the_crosscheck_table_reads_the_final_round_of_both_curves():
    curve = {"5": 0.5, "30": 0.9}
    stored = {
        "federation": "femnist-pairs-300-validation",
        "method": crosscheck.METHOD,
        "seed": crosscheck.SEED,
        "final_round": 30,
        "ours": {"personal_acc": curve, "global_acc": {"30": 0.8}, "cpu_seconds": 300.0},
        "reference": {
            "repository": "mahendrathapa/pFedHB",
            "commit": "511aba1",
            "personal_acc": {"30": 0.87},
            "global_acc": {"30": 0.7},
            "cpu_seconds": 310.0,
        },
    }
    runs = [_run(tuning.tuned("pfedhb-adam"), s, 0.9 + 0.01 * s) for s in range(3)]
    text = findings.crosscheck_table(stored, runs)
    assert "| 90.0 | 80.0 | 300 |" in text and "| 87.0 | 70.0 | 310 |" in text
    assert "+3.0 points" in text and "over its 3 reported seeds" in text
    assert "is 1.0 points" in text  # sd (ddof = 1) of 90, 91, 92
