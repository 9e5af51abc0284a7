"""``fedsim factorize`` (cached factorizations) and ``fedsim account matrix``."""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from fedsim.cli import main
from fedsim.privacy.matrix import Factorization

DELTA = 1e-5


def fedsim_json(capsys, *argv):
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def factorize(capsys, out, *args):
    return fedsim_json(capsys, "factorize", *args, "--out", str(out))


BANDED = ("--kind", "banded", "--rounds", "24", "--bands", "3", "--participations", "4")


def test_banded_summary_and_file(capsys, tmp_path):
    out = tmp_path / "banded.npz"
    result = factorize(capsys, out, *BANDED, "--min-sep", "6")
    f = Factorization.load(out)
    np.testing.assert_allclose(np.linalg.norm(f.C, axis=0), 1.0, atol=1e-12)
    assert result["sensitivity"] == pytest.approx(2.0) and result["sensitivity_exact"]
    assert result["max_column_norm"] == pytest.approx(1.0)
    assert result["loss"] == pytest.approx(4 * np.sum(f.B**2) / 24, rel=1e-9)
    assert result["participations"] == 4 and result["bands"] == 3
    assert result["cached"] is False and result["seconds"] >= 0


def test_same_arguments_reuse_the_file_and_others_rebuild_it(capsys, tmp_path):
    out = tmp_path / "f.npz"
    first = factorize(capsys, out, "--kind", "toeplitz", "--rounds", "32", "--bands", "4")
    stamp = out.stat().st_mtime_ns
    again = factorize(capsys, out, "--kind", "toeplitz", "--rounds", "32", "--bands", "4")
    assert again["cached"] is True and out.stat().st_mtime_ns == stamp
    assert again["loss"] == first["loss"] and again["seconds"] == first["seconds"]
    other = factorize(capsys, out, "--kind", "toeplitz", "--rounds", "32", "--bands", "5")
    assert other["cached"] is False and other["loss"] < first["loss"]  # more bands: no worse


@pytest.mark.parametrize(
    "args",
    [
        ("--kind", "tree", "--rounds", "16"),
        ("--kind", "honaker", "--rounds", "16"),
        ("--kind", "sqrt", "--rounds", "16"),
        ("--kind", "dense", "--rounds", "16", "--participations", "2", "--min-sep", "8"),
        ("--kind", "blt", "--rounds", "16", "--buffers", "2"),
    ],
)
def test_every_kind_builds(capsys, tmp_path, args):
    result = factorize(capsys, tmp_path / "f.npz", *args)
    assert result["n"] == 16 and result["reconstruction_error"] < 1e-8
    assert math.isfinite(result["loss"]) and result["sensitivity"] >= result["max_column_norm"]


def test_tree_restart_builds_with_its_option_and_needs_it(capsys, tmp_path):
    args = ("--kind", "tree_restart", "--rounds", "16", "--participations", "4")
    out = tmp_path / "r.npz"
    result = factorize(capsys, out, *args, "--min-sep", "4", "--option", "restart_every=4")
    f = Factorization.load(out)
    assert f.kind == "tree_restart" and f.params["restart_every"] == 4
    assert result["reconstruction_error"] == 0.0 and result["sensitivity_exact"]
    assert result["sensitivity"] == pytest.approx(math.sqrt(4 * 3))  # 4 blocks, 3 nodes each
    assert main(["factorize", *args, "--min-sep", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsim: error: kind_options.restart_every = None is not allowed")
    assert "required by kind tree_restart" in err


def test_text_summary_is_one_line(capsys, tmp_path):
    assert (
        main(["factorize", "--kind", "sqrt", "--rounds", "8", "--out", str(tmp_path / "s.npz")])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "loss" in out and "sensitivity" in out


def gaussian_epsilon(z):
    return RdpAccountant().compose(dpa.GaussianDpEvent(z)).get_epsilon(DELTA)


def test_account_matrix_is_one_gaussian_with_the_noise_multiplier(capsys, tmp_path):
    out = tmp_path / "banded.npz"
    factorize(capsys, out, *BANDED, "--min-sep", "6")
    base = ("account", "matrix", "--factorization", str(out), "--delta", str(DELTA))
    result = fedsim_json(capsys, *base, "--noise-multiplier", "1.5")
    assert result["epsilon"] == pytest.approx(gaussian_epsilon(1.5), rel=1e-9)
    assert result["sensitivity"] == pytest.approx(2.0)  # k = 4 read from the file
    assert result["max_column_norm"] == pytest.approx(1.0)
    f = Factorization.load(out)
    expected_rmse = 1.5 * 2.0 * np.sqrt(np.mean(np.sum(f.B**2, axis=1)))
    assert result["rmse"] == pytest.approx(expected_rmse, rel=1e-9)
    assert result["noise_multiplier"] == 1.5 and result["delta"] == DELTA
    # after 6 rounds one participation is out: the largest released column norm
    early = fedsim_json(capsys, *base, "--noise-multiplier", "1.5", "--rounds", "6")
    norm = np.linalg.norm(f.C[:6, :6], axis=0).max()
    assert early["epsilon"] == pytest.approx(gaussian_epsilon(1.5 * 2.0 / norm), rel=1e-9)
    # replace-one neighbours move a contribution twice as far
    replace = fedsim_json(capsys, *base, "--noise-multiplier", "1.5", "--relation", "replace_one")
    assert replace["epsilon"] == pytest.approx(gaussian_epsilon(0.75), rel=1e-9)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("factorize", "--kind", "lattice", "--rounds", "8"), "--kind"),
        (("factorize", "--kind", "tree", "--rounds", "0"), "--rounds"),
        (("factorize", "--kind", "banded", "--rounds", "8"), "--bands"),
        (("factorize", "--kind", "banded", "--rounds", "8", "--bands", "9"), "--bands"),
        (("factorize", "--kind", "tree", "--rounds", "8", "--participations", "2"), "--min-sep"),
        (
            (
                "factorize",
                "--kind",
                "tree",
                "--rounds",
                "8",
                "--min-sep",
                "0",
                "--participations",
                "2",
            ),
            "--min-sep",
        ),
        (("factorize", "--kind", "blt", "--rounds", "8", "--buffers", "0"), "--buffers"),
        (
            (
                "factorize",
                "--kind",
                "dense",
                "--rounds",
                "9",
                "--participations",
                "2",
                "--min-sep",
                "4",
            ),
            "--participations",
        ),
    ],
)
def test_factorize_errors_name_the_flag(capsys, tmp_path, argv, flag):
    assert main([*argv, "--out", str(tmp_path / "f.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedsim: error: {flag} = ") and "is not allowed" in err


def test_factorize_refuses_an_out_that_is_not_npz(capsys, tmp_path):
    assert main(["factorize", "--kind", "tree", "--rounds", "4", "--out", str(tmp_path / "f")]) == 2
    assert "--out" in capsys.readouterr().err


def test_account_matrix_errors_name_the_flag(capsys, tmp_path):
    out = tmp_path / "t.npz"
    factorize(capsys, out, "--kind", "tree", "--rounds", "8")
    base = ["account", "matrix", "--delta", "1e-5"]
    cases = [
        (
            ["--factorization", str(tmp_path / "none.npz"), "--noise-multiplier", "1"],
            "--factorization",
        ),
        (["--factorization", str(out), "--noise-multiplier", "0"], "--noise-multiplier"),
        (["--factorization", str(out), "--noise-multiplier", "1", "--rounds", "9"], "--rounds"),
        (
            ["--factorization", str(out), "--noise-multiplier", "1", "--min-sep", "2"],
            "--participations",
        ),
    ]
    for args, flag in cases:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedsim: error: {flag} = "), err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert main([*base, "--factorization", str(bad), "--noise-multiplier", "1"]) == 2
    assert "--factorization" in capsys.readouterr().err
