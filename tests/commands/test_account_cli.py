"""``fedsim account``: epsilon, calibration and sweeps from the command line, and its errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from fedsim.cli import main

ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5
REFERENCE = [
    "account",
    "dp-fedavg",
    "--noise-multiplier",
    "1",
    "--sampling-rate",
    "0.01",
    "--rounds",
    "1000",
    "--delta",
    "1e-5",
]


def account(capsys, *argv):
    """Run ``fedsim account ... --json``; its exit code and parsed stdout."""
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def direct(accountant, event, count):
    """Epsilon of ``count`` self-compositions of ``event``, straight from dp_accounting."""
    acc = RdpAccountant() if accountant == "rdp" else PLDAccountant()
    return acc.compose(event, count).get_epsilon(DELTA)


# ---------------------------------------------------------------- dp-fedavg


@pytest.mark.parametrize(("accountant", "expected"), [("rdp", 2.1014), ("pld", 1.8282)])
def test_dp_fedavg_reference_epsilon(capsys, accountant, expected):
    result = account(capsys, *REFERENCE, "--accountant", accountant)
    assert round(result["epsilon"], 4) == expected
    event = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0))
    assert result["epsilon"] == pytest.approx(direct(accountant, event, 1000), rel=1e-12)
    assert result["accountant"] == accountant
    assert result["delta"] == DELTA
    assert result["noise_multiplier"] == 1.0
    assert result["sampling_rate"] == 0.01
    assert result["rounds"] == 1000
    assert result["sampling"] == "poisson"
    assert result["relation"] == "add_remove"


def test_dp_fedavg_text_output_has_one_line_and_no_run_summary(capsys):
    assert main(REFERENCE) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "epsilon = 2.1014" in out
    assert "(rdp)" in out
    assert "results in" not in out


def test_dp_fedavg_fixed_size_and_full_participation(capsys):
    fixed = account(
        capsys,
        "account",
        "dp-fedavg",
        "--noise-multiplier",
        "1.5",
        "--sampling-rate",
        "0.05",
        "--population",
        "400",
        "--sampling",
        "fixed",
        "--rounds",
        "50",
        "--delta",
        "1e-5",
    )
    assert fixed["cohort_size"] == 20
    assert fixed["relation"] == "replace_one"
    # Replace-one moves the sum by 2C: the RDP event carries z / 2.
    event = dpa.SampledWithoutReplacementDpEvent(400, 20, dpa.GaussianDpEvent(0.75))
    raw = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    assert fixed["epsilon"] == pytest.approx(raw.compose(event, 50).get_epsilon(DELTA), rel=1e-12)

    full = account(
        capsys,
        "account",
        "dp-fedavg",
        "--noise-multiplier",
        "8",
        "--sampling",
        "full",
        "--rounds",
        "16",
        "--delta",
        "1e-5",
    )
    assert full["sampling_rate"] == 1.0
    # Sixteen Gaussians with z = 8 are one Gaussian with z = 2.
    assert full["epsilon"] == pytest.approx(direct("rdp", dpa.GaussianDpEvent(2.0), 1), rel=1e-3)


# ---------------------------------------------------------------- dp-sgd


def test_dp_sgd_is_poisson_sampled_gaussian_over_the_steps(capsys):
    argv = [
        "account",
        "dp-sgd",
        "--noise-multiplier",
        "1.1",
        "--batch-size",
        "256",
        "--dataset-size",
        "60000",
        "--epochs",
        "3",
        "--delta",
        "1e-5",
    ]
    rdp = account(capsys, *argv)
    assert rdp["steps"] == 704  # ceil(3 * 60000 / 256) = ceil(703.125)
    assert rdp["sampling_rate"] == pytest.approx(256 / 60000, rel=1e-15)
    assert (rdp["batch_size"], rdp["dataset_size"], rdp["epochs"]) == (256, 60000, 3.0)
    event = dpa.PoissonSampledDpEvent(256 / 60000, dpa.GaussianDpEvent(1.1))
    assert rdp["epsilon"] == pytest.approx(direct("rdp", event, 704), rel=1e-12)
    pld = account(capsys, *argv, "--accountant", "pld")
    assert pld["epsilon"] == pytest.approx(direct("pld", event, 704), rel=1e-9)
    assert 0 < pld["epsilon"] < rdp["epsilon"]  # PLD is the tighter of two valid bounds
    # More epochs, more epsilon.
    longer = account(capsys, *argv[:-4], "--epochs", "6", "--delta", "1e-5")
    assert longer["steps"] == 1407
    assert longer["epsilon"] > rdp["epsilon"]


# ---------------------------------------------------------------- calibrate


@pytest.mark.parametrize(
    ("target", "setting", "accountant"),
    [
        (2.0, ["dp-fedavg", "--sampling-rate", "0.01", "--rounds", "1000"], "rdp"),
        (4.0, ["dp-fedavg", "--sampling-rate", "0.1", "--rounds", "20"], "pld"),
        (
            3.0,
            ["dp-sgd", "--batch-size", "64", "--dataset-size", "2000", "--epochs", "2"],
            "rdp",
        ),
        (
            3.0,
            ["dp-sgd", "--batch-size", "200", "--dataset-size", "2000", "--epochs", "2"],
            "pld",
        ),
    ],
)
def test_calibrate_round_trips_within_one_percent(capsys, target, setting, accountant):
    common = [*setting[1:], "--delta", "1e-5", "--accountant", accountant]
    calibrated = account(
        capsys, "account", "calibrate", setting[0], "--target-epsilon", str(target), *common
    )
    z = calibrated["noise_multiplier"]
    assert calibrated["target_epsilon"] == target
    assert calibrated["mechanism"] == setting[0]
    assert calibrated["accountant"] == accountant
    again = account(capsys, "account", setting[0], "--noise-multiplier", repr(z), *common)
    assert again["epsilon"] == calibrated["epsilon"]
    assert again["epsilon"] <= target
    assert again["epsilon"] == pytest.approx(target, rel=0.01)
    # The calibrated noise is not wasteful: 2 % less noise overshoots the target.
    less = account(capsys, "account", setting[0], "--noise-multiplier", repr(0.98 * z), *common)
    assert less["epsilon"] > target


def test_calibrate_text_prints_the_noise_multiplier(capsys):
    argv = ["account", "calibrate", "dp-fedavg", "--target-epsilon", "2"]
    assert main([*argv, "--sampling-rate", "0.01", "--rounds", "1000", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "noise multiplier 1.0224" in out


# ---------------------------------------------------------------- sweep


def test_sweep_writes_a_png_and_the_curves(capsys, tmp_path):
    plot = tmp_path / "plots" / "eps.png"
    result = account(
        capsys,
        "account",
        "sweep",
        "dp-fedavg",
        "--noise-multiplier",
        "0.8",
        "1.0",
        "--sampling-rate",
        "0.01",
        "0.05",
        "--rounds",
        "1000",
        "--points",
        "20",
        "--delta",
        "1e-5",
        "--plot",
        str(plot),
    )
    png = plot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000  # a drawn figure, not an empty canvas
    assert result["plot"] == str(plot)
    curves = result["curves"]
    assert [(c["noise_multiplier"], c["sampling_rate"]) for c in curves] == [
        (0.8, 0.01),
        (0.8, 0.05),
        (1.0, 0.01),
        (1.0, 0.05),
    ]
    for curve in curves:
        assert curve["rounds"] == [50 * i for i in range(1, 21)]
        assert curve["epsilon"] == sorted(curve["epsilon"])
        assert len(set(curve["epsilon"])) == 20
    # A curve's last point is the dp-fedavg epsilon of the whole run.
    assert curves[2]["epsilon"][-1] == pytest.approx(2.1014, abs=5e-5)
    # More noise or less sampling, less epsilon, at every point.
    assert all(a > b for a, b in zip(curves[0]["epsilon"], curves[2]["epsilon"]))
    assert all(a > b for a, b in zip(curves[1]["epsilon"], curves[0]["epsilon"]))


def test_sweep_dp_sgd_over_batch_sizes(capsys, tmp_path):
    plot = tmp_path / "sgd.png"
    argv = ["account", "sweep", "dp-sgd", "--noise-multiplier", "1.0", "--batch-size", "32", "128"]
    argv += ["--dataset-size", "10000", "--epochs", "2", "--points", "5", "--delta", "1e-5"]
    assert main([*argv, "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "2 curves" in text and str(plot) in text
    assert plot.read_bytes().startswith(b"\x89PNG")
    result = account(capsys, *argv, "--plot", str(plot))
    steps = [c["steps"][-1] for c in result["curves"]]
    assert steps == [625, 157]  # ceil(2 * 10000 / B)
    event = dpa.PoissonSampledDpEvent(32 / 10000, dpa.GaussianDpEvent(1.0))
    assert result["curves"][0]["epsilon"][-1] == pytest.approx(direct("rdp", event, 625), rel=1e-9)


# ---------------------------------------------------------------- errors


FEDAVG = ["account", "dp-fedavg", "--noise-multiplier", "1", "--rounds", "10"]


SGD = ["account", "dp-sgd", "--batch-size", "256", "--dataset-size", "60000", "--epochs", "2"]


def test_dp_sgd_prv_is_opacus_prv_upper_bound_below_rdp(capsys):
    """--accountant prv: Opacus's PRV accountant (dp_accounting 0.6.0 ships none), the value
    a [client.dp_sgd] client with accountant = "prv" reports; it lies between PLD's estimate
    region and RDP's looser bound, and grows with the steps."""
    from opacus.accountants import PRVAccountant

    argv = [*SGD, "--noise-multiplier", "1.1", "--delta", "1e-5"]
    prv = account(capsys, *argv, "--accountant", "prv")
    assert prv["accountant"] == "prv" and prv["steps"] == 469  # ceil(2 * 60000 / 256)
    direct_prv = PRVAccountant()
    direct_prv.history = [(1.1, 256 / 60000, 469)]
    assert prv["epsilon"] == pytest.approx(direct_prv.get_epsilon(delta=1e-5), rel=1e-12)
    rdp = account(capsys, *argv)
    pld = account(capsys, *argv, "--accountant", "pld")
    assert pld["epsilon"] * 0.95 < prv["epsilon"] < rdp["epsilon"]
    longer = account(capsys, *SGD[:-1], "4", "--noise-multiplier", "1.1", "--delta", "1e-5",
                     "--accountant", "prv")
    assert longer["epsilon"] > prv["epsilon"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*SGD, "--noise-multiplier", "0.2", "--delta", "1e-5"], "--noise-multiplier = 0.2"),
        (
            ["account", "calibrate", "dp-sgd", "--target-epsilon", "2", *SGD[2:]]
            + ["--delta", "1e-5"],
            "--accountant = 'prv'",
        ),
    ],
)
def test_prv_refuses_what_it_does_not_account(capsys, argv, needle):
    assert main([*argv, "--accountant", "prv", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedsim: error: {needle} is not allowed: ") and "prv" in err


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        ([*FEDAVG, "--sampling-rate", "0.01", "--delta", "1"], "--delta", "1.0"),
        ([*FEDAVG, "--sampling-rate", "0.01", "--delta", "2.5"], "--delta", "2.5"),
        ([*FEDAVG, "--sampling-rate", "0.01", "--delta", "0"], "--delta", "0.0"),
        ([*FEDAVG, "--sampling-rate", "0", "--delta", "1e-5"], "--sampling-rate", "0.0"),
        ([*FEDAVG, "--sampling-rate", "1.5", "--delta", "1e-5"], "--sampling-rate", "1.5"),
        ([*FEDAVG, "--sampling-rate", "-0.1", "--delta", "1e-5"], "--sampling-rate", "-0.1"),
        ([*FEDAVG, "--delta", "1e-5"], "--sampling-rate", "None"),
        (
            ["account", "dp-fedavg", "--noise-multiplier", "-1", "--sampling-rate", "0.01"]
            + ["--rounds", "10", "--delta", "1e-5"],
            "--noise-multiplier",
            "-1.0",
        ),
        (
            [*FEDAVG, "--sampling-rate", "0.01", "--delta", "1e-5", "--accountant", "prv"],
            "--accountant",
            "'prv'",
        ),
        # dp_accounting has no PLD event for sampling without replacement.
        (
            [*FEDAVG, "--sampling-rate", "0.01", "--delta", "1e-5", "--accountant", "pld"]
            + ["--sampling", "fixed", "--population", "1000"],
            "--accountant",
            "'pld'",
        ),
        # Its RDP accountant amplifies Poisson sampling for add/remove neighbours only.
        (
            [*FEDAVG, "--sampling-rate", "0.01", "--delta", "1e-5", "--relation", "replace_one"],
            "--relation",
            "'replace_one'",
        ),
        (
            [*FEDAVG, "--sampling-rate", "0.01", "--delta", "1e-5", "--sampling", "fixed"],
            "--population",
            "None",
        ),
        (
            ["account", "dp-sgd", "--noise-multiplier", "1", "--batch-size", "600"]
            + ["--dataset-size", "500", "--epochs", "1", "--delta", "1e-5"],
            "--batch-size",
            "600",
        ),
        (
            ["account", "calibrate", "dp-fedavg", "--target-epsilon", "-1"]
            + ["--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5"],
            "--target-epsilon",
            "-1.0",
        ),
        (
            ["account", "calibrate", "dp-fedavg", "--target-epsilon", "1"]
            + ["--sampling-rate", "0.01", "--rounds", "10", "--delta", "1.0"],
            "--delta",
            "1.0",
        ),
        (
            ["account", "sweep", "dp-fedavg", "--noise-multiplier", "1", "0"]
            + ["--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5", "--plot", "e.png"],
            "--noise-multiplier",
            "0.0",
        ),
        (
            ["account", "sweep", "dp-fedavg", "--noise-multiplier", "1"]
            + ["--sampling-rate", "0.01", "--rounds", "10", "--delta", "1e-5", "--plot", "e.pdf"],
            "--plot",
            "'e.pdf'",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_flag_and_value(
    capsys, monkeypatch, tmp_path, argv, flag, value
):
    monkeypatch.chdir(tmp_path)  # a wrongly accepted sweep would write its plot here
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"fedsim: error: {flag} = {value} is not allowed: ")
    assert list(tmp_path.iterdir()) == []


def test_unparseable_numbers_are_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*FEDAVG, "--sampling-rate", "lots", "--delta", "1e-5"])
    assert exit_.value.code == 2
    assert "--sampling-rate" in capsys.readouterr().err


def test_python_dash_m_fedsim_account_json():
    proc = subprocess.run(
        [sys.executable, "-m", "fedsim", *REFERENCE, "--accountant", "pld", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert round(result["epsilon"], 4) == 1.8282
    assert result["accountant"] == "pld"
    assert math.isfinite(result["epsilon"])
