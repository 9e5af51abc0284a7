"""Benchmark: our banded (BandMF) and banded-Toeplitz optimisers against jax_privacy's.

For every n in ``--rounds`` and every b in ``--bands`` both libraries optimise the same
problem -- prefix-sum workload, single participation, mean squared error -- and every
resulting C is scored by the same code (:meth:`fedsim.privacy.matrix.Factorization.loss`,
``sens(C)^2 ||A C^{-1}||_F^2 / n``), so the losses are comparable however each library
normalises its coefficients.

* ours: :func:`fedsim.privacy.matrix.banded` and
  :func:`fedsim.privacy.matrix.banded_toeplitz` (scipy float64 L-BFGS-B);
* jax_privacy: ``matrix_factorization.banded.optimize`` (100 steps, its default) and
  ``matrix_factorization.toeplitz.optimize_banded_toeplitz`` (250 steps, its default),
  optax L-BFGS in float64 on the CPU. Its time includes jit compilation, as a user pays it
  on every call (the optimiser's step function is compiled per call).

jax_privacy needs jax, which fedsim does not (``pip install -e '.[bench]'`` adds both, or point
``--jax-python`` at another environment with ``pip install jax_privacy``). The jax side runs in
its own process, in worker mode of this same file, and hands C back through a temporary
``.npy`` file, so both sides get the same CPUs one after the other.

Prints (and with ``--out`` writes) one JSON object: per setting, both losses and times,
``loss_ratio = ours / jax_privacy`` and ``time_ratio = ours / jax_privacy``; the target is
``loss_ratio <= 1.005`` and ``time_ratio <= 2``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

KINDS = ("banded", "toeplitz")


def _jax_worker(kind: str, n: int, bands: int, out: str) -> None:
    """Runs under the jax interpreter: optimise with jax_privacy, save C, print the time."""
    import jax  # noqa: PLC0415

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import banded, toeplitz  # noqa: PLC0415

    start = time.perf_counter()
    if kind == "banded":
        strategy = banded.optimize(n, bands=bands)
        C = np.asarray(strategy.materialize(), dtype=np.float64)
    else:
        coef = np.asarray(toeplitz.optimize_banded_toeplitz(n, bands), dtype=np.float64)
        C = np.asarray(toeplitz.materialize_lower_triangular(coef, n), dtype=np.float64)
    seconds = time.perf_counter() - start
    np.save(out, C)
    print(json.dumps({"seconds": seconds, "jax": jax.__version__}))


def _jax_run(python: str, kind: str, n: int, bands: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "C.npy")
        cmd = [python, __file__, "--jax-worker", kind, str(n), str(bands), path]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:g} s"}
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        info["C"] = np.load(path)
        return info


def _ours(kind: str, n: int, bands: int) -> tuple[object, float]:
    from fedsim.privacy.matrix import banded, banded_toeplitz  # noqa: PLC0415

    start = time.perf_counter()
    f = banded(n, bands) if kind == "banded" else banded_toeplitz(n, bands)
    return f, time.perf_counter() - start


def _score(C: np.ndarray) -> dict:
    """Loss, max column norm and reconstruction check of C on prefix sums (single
    participation), by fedsim's own code."""
    from fedsim.privacy.matrix.factorization import from_square_encoder  # noqa: PLC0415

    n = C.shape[0]
    f = from_square_encoder("bench", C, np.tri(n), {})
    return {"loss": f.loss(), "max_column_norm": f.max_column_norm()}


def run(args: argparse.Namespace) -> dict:
    rows = []
    for n in args.rounds:
        for bands in args.bands:
            for kind in args.kinds:
                ours_f, ours_s = _ours(kind, n, bands)
                row = {
                    "kind": kind,
                    "n": n,
                    "bands": bands,
                    "ours_loss": ours_f.loss(),
                    "ours_seconds": ours_s,
                }
                if args.jax_python:
                    theirs = _jax_run(args.jax_python, kind, n, bands, args.timeout)
                    if "error" in theirs:
                        row["jax_privacy_error"] = theirs["error"]
                    else:
                        score = _score(theirs["C"])
                        row.update(
                            jax_privacy_loss=score["loss"],
                            jax_privacy_seconds=theirs["seconds"],
                            jax_privacy_max_column_norm=score["max_column_norm"],
                            loss_ratio=row["ours_loss"] / score["loss"],
                            time_ratio=ours_s / theirs["seconds"],
                        )
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    ratios = [r for r in rows if "loss_ratio" in r]
    return {
        "benchmark": "factorize",
        "cpus": os.cpu_count(),
        "settings": rows,
        "max_loss_ratio": max((r["loss_ratio"] for r in ratios), default=None),
        "max_time_ratio": max((r["time_ratio"] for r in ratios), default=None),
        "target": {"loss_ratio": 1.005, "time_ratio": 2.0},
        "meets_target": bool(ratios)
        and all(r["loss_ratio"] <= 1.005 and r["time_ratio"] <= 2.0 for r in ratios),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--jax-worker":
        _jax_worker(argv[1], int(argv[2]), int(argv[3]), argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[512, 2048], help="n values")
    parser.add_argument("--bands", type=int, nargs="+", default=[8, 64], help="band counts")
    parser.add_argument(
        "--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="optimisers to compare"
    )
    parser.add_argument(
        "--jax-python",
        default=None,
        help="a Python interpreter with jax_privacy installed (default: this one if it has "
        "jax_privacy, else ours only)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per jax_privacy run")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.jax_python is None and importlib.util.find_spec("jax_privacy") is not None:
        args.jax_python = sys.executable  # installed here (the "bench" extra)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
