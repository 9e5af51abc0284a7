"""Kind ``blt``: buffered linear Toeplitz (:mod:`fedsim.privacy.matrix.blt`), streamed by
its ``buffers`` buffers."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsim.privacy.matrix.blt import blt
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.kind import Cost, Kind
from fedsim.privacy.matrix.streaming import BLTStream, RoundNoise
from fedsim.privacy.matrix.verify import blt_mismatch

#: the optimiser's iteration cap (its ``max_iter`` default)
MAX_ITER = 500


def blt_stream(f: Factorization, noise: RoundNoise, shape: Any) -> BLTStream:
    """``s_i <- theta_i s_i + y`` over ``f``'s weights and thetas."""
    return BLTStream(f.n, f.params["weights"], f.params["thetas"], noise, shape)


def _file_problems(spec: Any, f: Factorization) -> list[str]:
    if np.shape(f.params.get("weights")) != (spec.buffers,):
        return [f"not {spec.buffers} BLT buffers"]
    return []


BLT = Kind(
    name="blt",
    build=lambda spec, progress: blt(
        spec.rounds, spec.buffers, spec.participation, progress=progress
    ),
    stream=blt_stream,
    mismatch=blt_mismatch,
    cost=lambda spec: Cost(MAX_ITER, 10.0 * spec.rounds**2, 8.0 * 4 * spec.rounds**2),
    file_problems=_file_problems,
)
