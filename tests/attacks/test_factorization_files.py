"""Whoever writes a factorization file cannot make the matrix mechanism's epsilon optimistic.

The attacker crafts (or plants where ``fedsim factorize --out`` will look) an ``.npz`` whose
C and B are honest -- ``B C = A`` holds, so the sensitivity and epsilon computed from C look
right -- while the streaming parameters the noise is generated from (BLT weights and thetas,
tree alphas, bands) belong to another C. The noise then added is ``C_s^{-1} z`` for the
attacker's ``C_s``: the mechanism is that of ``C_s``, whose sensitivity is far larger. The
claim: such a file is refused by name, whoever reads it (``Factorization.load``, ``fedsim
account matrix``, the strategy), and ``fedsim factorize`` never reuses a planted file.
"""

from __future__ import annotations

import json

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from fedsim.cli import main
from fedsim.config import ConfigError
from fedsim.privacy.matrix import Factorization, binary_tree, blt, honaker_tree
from fedsim.privacy.matrix.blt import blt_coefficients
from fedsim.privacy.matrix.build import Spec

try:  # the digest a file carries (absent before files carried one: written without it)
    from fedsim.privacy.matrix.factorization import content_digest
except ImportError:
    content_digest = None
from fedsim.privacy.matrix.toeplitz import toeplitz_matrix

N, Z, DELTA, SCALE = 64, 1.0, 1e-5, 1e3


def write(path, f: Factorization, digest: bool) -> None:
    """Save ``f`` as the attacker would: without a digest (the old format), or with the
    digest recomputed over the crafted content (the hash function is public)."""
    arrays = {"kind": np.array(f.kind), "workload": f.A, "encoder": f.C, "decoder": f.B}
    arrays.update({f"param_{k}": np.asarray(v) for k, v in f.params.items()})
    extra = {"sha256": np.array(content_digest(arrays))} if digest and content_digest else {}
    np.savez(path, **arrays, **extra)


def crafted_blt(n: int = N) -> tuple[Factorization, Factorization]:
    """(the crafted file's factorization, the honest one of the noise it generates): C and B
    of a real BLT, weights scaled by SCALE so the stream generates ``T(c')^{-1} z``."""
    honest = blt(n, 3, max_iter=100)
    w, th = honest.params["weights"], honest.params["thetas"]
    crafted = Factorization(
        "blt", honest.A, honest.C, honest.B, {**honest.params, "weights": w * SCALE}
    )
    C_s = toeplitz_matrix(blt_coefficients(w * SCALE, th, n), n)
    real = Factorization("dense", honest.A, C_s, np.zeros_like(C_s), {})  # only C_s matters
    return crafted, real


def account(capsys, path, z: float) -> tuple[int, dict | str]:
    code = main(
        [
            "account",
            "matrix",
            "--factorization",
            str(path),
            "--noise-multiplier",
            str(z),
            "--delta",
            str(DELTA),
            "--json",
        ]
    )
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else captured.err)


@pytest.mark.parametrize("digest", [False, True], ids=["old-format", "digest-recomputed"])
def test_a_blt_file_whose_weights_are_not_its_c_is_refused(capsys, tmp_path, digest):
    crafted, real = crafted_blt()
    path = tmp_path / "blt.npz"
    write(path, crafted, digest)
    # what the noise generated from this file is worth: the mechanism of C_s, whose noise std
    # is Z sens(C) (the file's claim) while its sensitivity is sens(C_s)
    z_real = Z * crafted.sensitivity().value / real.sensitivity().value
    real_epsilon = RdpAccountant().compose(dpa.GaussianDpEvent(z_real)).get_epsilon(DELTA)
    assert real_epsilon > 1e4  # the noise added protects nothing
    code, message = account(capsys, path, Z)
    assert code == 2, (
        f"epsilon {message['epsilon']:.3g} reported for a crafted file whose noise is worth "
        f"{real_epsilon:.3g}"
    )
    assert "--factorization" in message and str(path) in message and "Traceback" not in message
    with pytest.raises(ConfigError, match="noise stream") as err:
        Factorization.load(path)
    assert str(path) in str(err.value) and "weights and thetas" in str(err.value)


def test_tree_alphas_and_bands_that_do_not_generate_c_are_refused(tmp_path):
    tree = binary_tree(16)
    alphas = honaker_tree(16).params["alphas"]  # Honaker's weights with the plain tree's B
    cases = {
        "alphas": Factorization("tree", tree.A, tree.C, tree.B, {"alphas": alphas}),
        "bands": None,
    }
    from fedsim.privacy.matrix import banded

    band = banded(16, 4, max_iter=20)
    cases["bands"] = Factorization("banded", band.A, band.C, band.B, {"bands": 2})
    for name, f in cases.items():
        path = tmp_path / f"{name}.npz"
        write(path, f, digest=True)
        with pytest.raises(ConfigError, match="noise stream") as err:
            Factorization.load(path)
        assert str(path) in str(err.value), name


def test_an_edited_file_fails_its_digest(tmp_path):
    f = blt(N, 3, max_iter=50)
    path = tmp_path / "f.npz"
    f.save(path)
    arrays = dict(np.load(path, allow_pickle=False))
    arrays["param_weights"] = arrays["param_weights"] * 1.0000001
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match="sha256"):
        Factorization.load(path)


ARGS = ("--kind", "blt", "--rounds", str(N), "--buffers", "3")


@pytest.mark.parametrize("digest", [False, True], ids=["old-format", "digest-recomputed"])
def test_factorize_does_not_reuse_a_planted_file(capsys, tmp_path, digest):
    crafted, _ = crafted_blt()
    spec = Spec(kind="blt", rounds=N, buffers=3)
    planted = Factorization(
        "blt",
        crafted.A,
        crafted.C,
        crafted.B,
        {**crafted.params, "cache_key": spec.key(), "seconds": 1.0},
    )
    out = tmp_path / "f.npz"
    write(out, planted, digest)
    assert main(["factorize", *ARGS, "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cached"] is False, "the planted file was reused"
    assert "noise stream" in result["replaced"]
    rebuilt = Factorization.load(out)  # what is there now is verified, and its own digest
    assert rebuilt.digest() == result["sha256"]
    assert not np.array_equal(rebuilt.params["weights"], planted.params["weights"])
    # the rebuilt file is reused as it is
    assert main(["factorize", *ARGS, "--out", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["cached"] is True and again["sha256"] == result["sha256"]


def test_factorize_does_not_reuse_a_consistent_file_that_is_not_the_closed_form(capsys, tmp_path):
    # stream, digest and cache key all consistent, but the content is not the tree the spec
    # names: closed forms are rebuilt and compared
    spec = Spec(kind="tree", rounds=16)
    other = honaker_tree(16)
    planted = Factorization(
        "tree",
        other.A,
        other.C,
        other.B,
        {**other.params, "cache_key": spec.key(), "seconds": 0.5},
    )
    out = tmp_path / "tree.npz"
    planted.save(out)
    assert main(["factorize", "--kind", "tree", "--rounds", "16", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cached"] is False and "closed form" in result["replaced"]
    assert np.array_equal(Factorization.load(out).B, binary_tree(16).B)


@pytest.mark.parametrize("key", ["garbage", '{"format": "fedsim.factorize/1", "kind": 3}', "[]"])
def test_account_matrix_refuses_a_cache_key_that_is_not_a_spec(capsys, tmp_path, key):
    # the participation account matrix assumes comes from the cache key: a key that is not a
    # spec must not be read as "single participation"
    f = binary_tree(16)
    path = tmp_path / "tree.npz"
    write(path, Factorization(f.kind, f.A, f.C, f.B, {**f.params, "cache_key": key}), True)
    code, message = account(capsys, path, Z)
    assert code == 2 and "--factorization" in message and "cache_key" in message, message
