"""Kind ``dense``: multi-epoch MF with a participation mask (:mod:`fedsim.privacy.matrix.dense`),
streamed by forward substitution over every past output."""

from __future__ import annotations

from typing import Any

from fedsim.config import require
from fedsim.privacy.matrix.dense import dense
from fedsim.privacy.matrix.factorization import Factorization, Progress
from fedsim.privacy.matrix.kind import Cost, Kind
from fedsim.privacy.matrix.streaming import DenseStream, RoundNoise
from fedsim.privacy.matrix.verify import square_mismatch

#: the optimiser's iteration cap (its ``max_iter`` default)
MAX_ITER = 1000


def dense_stream(f: Factorization, noise: RoundNoise, shape: Any) -> DenseStream:
    """Forward substitution over all of ``f``'s lower-triangular C."""
    return DenseStream(f.encoder, noise, shape)


def _build(spec: Any, progress: Progress | None) -> Factorization:
    """Dense MF for the spec's participations as fixed epochs (rounds must be a multiple)."""
    n = spec.rounds
    epochs = spec.participation.participations(n)
    require(
        n % epochs == 0,
        "participations",
        spec.participations,
        f"a number of epochs dividing rounds = {n} (dense optimises fixed-epoch order)",
    )
    return dense(n, epochs, progress=progress)


def _file_problems(spec: Any, f: Factorization) -> list[str]:
    if f.params.get("epochs") != spec.participation.participations(spec.rounds):
        return ["another number of epochs"]
    return []


DENSE = Kind(
    name="dense",
    build=_build,
    stream=dense_stream,
    mismatch=square_mismatch,
    # Cholesky of the n x n Gram matrix and two solves; the n x n work arrays and L-BFGS's
    # 20 pairs of ~n^2 / 2 parameters
    cost=lambda spec: Cost(MAX_ITER, 4.3 * spec.rounds**3, 8.0 * (8 + 20) * spec.rounds**2),
    file_problems=_file_problems,
)
