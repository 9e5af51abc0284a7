"""Kind ``banded``: BandMF, a column-normalised banded C (:mod:`fedsim.privacy.matrix.banded`),
streamed by forward substitution over its bands."""

from __future__ import annotations

from typing import Any

from fedsim.config import require
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.factorization import Factorization, Progress
from fedsim.privacy.matrix.kind import Cost, Kind
from fedsim.privacy.matrix.streaming import BandedStream, RoundNoise
from fedsim.privacy.matrix.verify import banded_mismatch

#: the optimiser's iteration cap (its ``max_iter`` default)
MAX_ITER = 500


def banded_stream(f: Factorization, noise: RoundNoise, shape: Any) -> BandedStream:
    """Forward substitution over the ``bands`` diagonals of ``f``'s C."""
    return BandedStream(f.encoder, f.params["bands"], noise, shape)


def _build(spec: Any, progress: Progress | None) -> Factorization:
    """BandMF; under several participations ``bands <= min_sep`` (columns one user shares
    orthogonal)."""
    if spec.min_sep is not None and spec.participations and spec.participations > 1:
        require(
            spec.band_count <= spec.min_sep,
            "bands",
            spec.band_count,
            f"at most min_sep = {spec.min_sep} (columns one user shares orthogonal)",
        )
    return banded(spec.rounds, spec.band_count, progress=progress)


BANDED = Kind(
    name="banded",
    build=_build,
    stream=banded_stream,
    mismatch=banded_mismatch,
    banded=True,
    cost=lambda spec: Cost(
        MAX_ITER, 4.0 * spec.rounds**2 * spec.band_count, 8.0 * 6 * spec.rounds**2
    ),
)
