"""Kinds ``sqrt`` (the square-root closed form, streamed by forward substitution over its
dense inverse) and ``toeplitz`` (optimised banded Toeplitz, saved as ``banded_toeplitz``),
:mod:`fedsim.privacy.matrix.toeplitz`."""

from __future__ import annotations

from fedsim.privacy.matrix.kind import Cost, Kind
from fedsim.privacy.matrix.kinds.banded import banded_stream
from fedsim.privacy.matrix.kinds.dense import dense_stream
from fedsim.privacy.matrix.toeplitz import banded_toeplitz, sqrt_factorization
from fedsim.privacy.matrix.verify import banded_mismatch, square_mismatch

#: the Toeplitz optimiser's iteration cap (its ``max_iter`` default)
MAX_ITER = 500

SQRT = Kind(
    name="sqrt",
    build=lambda spec, progress: sqrt_factorization(spec.rounds),
    stream=dense_stream,
    mismatch=square_mismatch,
    closed_form=True,
)
TOEPLITZ = Kind(
    name="toeplitz",
    saved="banded_toeplitz",
    build=lambda spec, progress: banded_toeplitz(
        spec.rounds, spec.band_count, spec.participation, progress=progress
    ),
    stream=banded_stream,
    mismatch=banded_mismatch,
    banded=True,
    cost=lambda spec: Cost(MAX_ITER, 10.0 * spec.rounds**2, 8.0 * 4 * spec.rounds**2),
)
