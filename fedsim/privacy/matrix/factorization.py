"""A factorization A = B C of a workload, and the quantities every family shares.

The matrix mechanism releases ``B (C x + z) = A (x + C^{-1} z)`` with ``z ~ N(0, sigma^2 I)``
and ``sigma = noise_multiplier * sens(C)`` (Denisov et al. 2022; Choquette-Choo et al. 2023,
"Multi-Epoch Matrix Factorization Mechanisms"). Per unit noise multiplier:

- per-round squared error ``sens(C)^2 * ||B[t, :]||^2`` (:meth:`Factorization.rmse` is its
  square root);
- loss ``sens(C)^2 * ||B||_F^2 / n`` (mean over rounds, ``reduction="mean"``), or
  ``sens(C)^2 * max_t ||B[t, :]||^2`` (``reduction="max"``).

C is lower-triangular and square for every family except the trees, whose C stacks one row per
tree node (m x n). The noise that reaches the gradients is ``G z`` with the noising matrix
``G = A^{-1} B`` (``= C^{-1}`` when C is square).
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg
import scipy.optimize

from fedsim.config import ConfigError, require
from fedsim.privacy.matrix.sensitivity import Sensitivity, sensitivity
from fedsim.privacy.matrix.structure import check_rounds as check_rounds
from fedsim.privacy.participation import Participation

_REDUCTIONS = ("mean", "max")


@dataclass(frozen=True, eq=False)
class Factorization:
    """``A = B C`` with its family's structure.

    ``workload`` is A (n x n), ``encoder`` is C (m x n), ``decoder`` is B (n x m); ``kind``
    names the family and ``params`` holds what its streaming noise generator needs (Toeplitz
    coefficients, bands, BLT buffers, tree weights).
    """

    kind: str
    workload: np.ndarray
    encoder: np.ndarray
    decoder: np.ndarray
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Number of rounds."""
        return int(self.workload.shape[0])

    @property
    def A(self) -> np.ndarray:  # noqa: N802 - the papers' name
        return self.workload

    @property
    def B(self) -> np.ndarray:  # noqa: N802
        return self.decoder

    @property
    def C(self) -> np.ndarray:  # noqa: N802
        return self.encoder

    def reconstruction_error(self) -> float:
        """``max |B C - A|`` (0 up to rounding for a valid factorization)."""
        return float(np.max(np.abs(self.decoder @ self.encoder - self.workload)))

    def noising_matrix(self) -> np.ndarray:
        """``G = A^{-1} B``, the map from noise z to the noise added to the gradients
        (``C^{-1}`` for square C); lower-triangular in the round index."""
        C = self.encoder
        if C.shape[0] == C.shape[1]:
            return scipy.linalg.solve_triangular(C, np.eye(self.n), lower=True)
        return scipy.linalg.solve_triangular(self.workload, self.decoder, lower=True)

    def apply_noising(self, Z: np.ndarray) -> np.ndarray:
        """``G Z`` by triangular solves (no inverse formed); Z has m rows (one per row of C)."""
        Z = np.asarray(Z, dtype=np.float64)
        C = self.encoder
        require(Z.shape[0] == C.shape[0], "Z", Z.shape, f"an array with {C.shape[0]} rows")
        if C.shape[0] == C.shape[1]:
            return scipy.linalg.solve_triangular(C, Z, lower=True)
        return scipy.linalg.solve_triangular(self.workload, self.decoder @ Z, lower=True)

    def max_column_norm(self) -> float:
        """``max_j ||C[:, j]||``: the single-participation sensitivity."""
        return float(np.linalg.norm(self.encoder, axis=0).max())

    def sensitivity(self, participation: Participation | None = None) -> Sensitivity:
        """Sensitivity of this C (the matrix actually used) under ``participation``."""
        return sensitivity(self.encoder, participation or Participation.single())

    def encoder_through(self, rounds: int) -> np.ndarray:
        """The part of C released in the first ``rounds`` rounds: the rows whose last non-zero
        column is < ``rounds`` (row i of a square C at round i; a tree node when its last leaf
        arrives), restricted to columns ``:rounds``."""
        require(
            isinstance(rounds, (int, np.integer)) and 1 <= rounds <= self.n,
            "rounds",
            rounds,
            f"an integer in [1, n = {self.n}]",
        )
        C = self.encoder
        last = C.shape[1] - 1 - np.argmax(C[:, ::-1] != 0, axis=1)
        return C[last < int(rounds)][:, : int(rounds)]

    def sensitivity_through(
        self, rounds: int, participation: Participation | None = None
    ) -> Sensitivity:
        """Sensitivity of the release after ``rounds`` rounds: that of :meth:`encoder_through`
        under ``participation`` restricted to those rounds (non-decreasing in ``rounds``, and
        :meth:`sensitivity` at ``rounds = n``)."""
        return sensitivity(self.encoder_through(rounds), participation or Participation.single())

    def squared_error_per_round(self) -> np.ndarray:
        """``||B[t, :]||^2`` for every round t (unit noise, unit sensitivity)."""
        return np.sum(self.decoder**2, axis=1)

    def rmse(self, participation: Participation | None = None) -> np.ndarray:
        """Per-round RMSE per unit noise multiplier: ``sens(C) * ||B[t, :]||``."""
        sens = self.sensitivity(participation).value
        return sens * np.sqrt(self.squared_error_per_round())

    def loss(self, participation: Participation | None = None, reduction: str = "mean") -> float:
        """``sens^2 ||B||_F^2 / n`` (``mean``) or ``sens^2 max_t ||B[t]||^2`` (``max``)."""
        require(reduction in _REDUCTIONS, "reduction", reduction, f"one of {_REDUCTIONS}")
        errors = self.squared_error_per_round()
        per_round = float(errors.mean() if reduction == "mean" else errors.max())
        return self.sensitivity(participation).value ** 2 * per_round

    def summary(self, participation: Participation | None = None) -> dict[str, Any]:
        """JSON-ready numbers: sensitivity (and whether exact), max column norm, mean and max
        loss, last-round and largest per-round RMSE, reconstruction error."""
        sens = self.sensitivity(participation)
        errors = self.squared_error_per_round()
        rmse = sens.value * np.sqrt(errors)
        return {
            "kind": self.kind,
            "n": self.n,
            "sensitivity": sens.value,
            "sensitivity_exact": sens.exact,
            "sensitivity_method": sens.method,
            "max_column_norm": self.max_column_norm(),
            "loss_mean": sens.value**2 * float(errors.mean()),
            "loss_max": sens.value**2 * float(errors.max()),
            "rmse_last": float(rmse[-1]),
            "rmse_max": float(rmse.max()),
            "reconstruction_error": self.reconstruction_error(),
        }

    def arrays(self) -> dict[str, np.ndarray]:
        """What :meth:`save` writes (without the digest): A, C, B, kind and ``param_*``."""
        return {
            "kind": np.array(self.kind),
            "workload": np.asarray(self.workload),
            "encoder": np.asarray(self.encoder),
            "decoder": np.asarray(self.decoder),
            **{f"param_{k}": np.asarray(v) for k, v in self.params.items()},
        }

    def digest(self) -> str:
        """SHA-256 of the content :meth:`save` writes (:func:`content_digest`)."""
        return content_digest(self.arrays())

    def save(self, path: str | Path) -> None:
        """Write A, C, B, the family parameters and their SHA-256 (``sha256``) to an ``.npz``."""
        arrays = self.arrays()
        np.savez(path, **arrays, sha256=np.array(content_digest(arrays)))

    @classmethod
    def load(cls, path: str | Path) -> Factorization:
        """Read a file written by :meth:`save`, refusing (ConfigError naming the file) one that
        is not an ``.npz`` of a factorization, whose ``sha256`` does not match its content,
        whose B C is not A (to 1e-8), or whose streaming parameters do not generate the noise
        of its C (:func:`fedsim.privacy.matrix.verify.stream_mismatch`)."""
        from fedsim.privacy.matrix.verify import stream_mismatch  # noqa: PLC0415

        what = "an .npz written by fedsim factorize"
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
            raise ConfigError("factorization", str(path), f"{what} ({err})") from None
        missing = [k for k in ("kind", "workload", "encoder", "decoder") if k not in arrays]
        require(not missing, "factorization", str(path), f"{what} (it lacks {missing})")
        stored = arrays.pop("sha256", None)
        if stored is not None:
            digest = content_digest(arrays)
            require(
                stored.shape == () and str(stored) == digest,
                "factorization",
                str(path),
                f"a file whose content matches its sha256 (stored {str(stored)[:16]}..., "
                f"content {digest[:16]}...: changed after it was written)",
            )
        f = cls._from_arrays(arrays, str(path))
        err = f.reconstruction_error()
        require(err <= 1e-8, "factorization", str(path), f"a file with B C = A (error {err:.2e})")
        mismatch = stream_mismatch(f)
        require(
            mismatch is None,
            "factorization",
            str(path),
            f"a file whose noise stream generates the noise its C accounts for: {mismatch}",
        )
        return f

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray], path: str) -> Factorization:
        kind, A, C, B = (arrays[k] for k in ("kind", "workload", "encoder", "decoder"))
        require(
            kind.shape == () and kind.dtype.kind == "U",
            "factorization",
            path,
            "a file whose kind is a string",
        )
        for name, value in (("workload", A), ("encoder", C), ("decoder", B)):
            require(
                value.ndim == 2 and value.dtype.kind == "f",
                "factorization",
                path,
                f"a file whose {name} is a 2-D float array (it is {value.dtype} {value.shape})",
            )
        n, m = A.shape[0], C.shape[0]
        require(
            A.shape == (n, n) and n >= 1 and C.shape == (m, n) and B.shape == (n, m),
            "factorization",
            path,
            f"A n x n, C m x n, B n x m (they are {A.shape}, {C.shape}, {B.shape})",
        )
        params: dict[str, Any] = {}
        for key, value in arrays.items():
            if key.startswith("param_"):
                params[key[6:]] = value.item() if value.ndim == 0 else value
        return cls(str(kind), A, C, B, params)


def content_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over ``arrays`` by sorted name: each name, dtype, shape and C-order bytes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def check_workload(workload: np.ndarray | None, n: int) -> np.ndarray:
    """The workload as a float64 n x n invertible lower-triangular matrix (prefix sums if None)."""
    if workload is None:
        return np.tri(n, dtype=np.float64)
    A = np.asarray(workload, dtype=np.float64)
    require(A.shape == (n, n), "workload", A.shape, f"an n x n matrix with n = {n}")
    require(
        bool(np.allclose(A, np.tril(A), rtol=0, atol=0)),
        "workload",
        "entries above the diagonal",
        "a lower-triangular matrix (row t reads rounds <= t only)",
    )
    require(bool(np.all(np.diag(A) != 0)), "workload", "a zero diagonal entry", "an invertible A")
    return A


def from_square_encoder(
    kind: str, C: np.ndarray, workload: np.ndarray, params: dict[str, Any]
) -> Factorization:
    """``B = A C^{-1}`` for an invertible lower-triangular C."""
    B = scipy.linalg.solve_triangular(C, workload.T, lower=True, trans="T").T
    return Factorization(kind, workload, C, B, params)


#: ``progress(iteration, loss)``: called after each optimiser iteration (1-based)
Progress = Callable[[int, float], None]


def lbfgs(
    fun: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    max_iter: int,
    tol: float = 1e-10,
    progress: Progress | None = None,
) -> np.ndarray:
    """Minimise ``fun`` (value and gradient) with scipy's float64 L-BFGS-B; the best point.
    ``progress`` (if given) hears of each iteration."""
    count = [0]

    def callback(intermediate_result: scipy.optimize.OptimizeResult) -> None:
        count[0] += 1
        progress(count[0], float(intermediate_result.fun))

    result = scipy.optimize.minimize(
        fun,
        np.asarray(x0, dtype=np.float64),
        jac=True,
        method="L-BFGS-B",
        callback=None if progress is None else callback,
        options={"maxiter": int(max_iter), "ftol": tol, "gtol": 1e-9, "maxcor": 20},
    )
    return np.asarray(result.x, dtype=np.float64)
