"""Factorizations by name, and an on-disk cache of optimised ones.

:func:`build` maps a kind (``tree``, ``honaker``, ``sqrt``, ``toeplitz``, ``banded``, ``dense``,
``blt``) and the run's shape (rounds, bands, participation) to the optimiser of that family
for the prefix-sum workload. :func:`cached` keeps the result in an ``.npz``
(:meth:`Factorization.save`) together with the arguments it was built from and the seconds it
took, and returns the file's factorization when those arguments match.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError, require
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.blt import blt
from fedsim.privacy.matrix.dense import dense
from fedsim.privacy.matrix.factorization import Factorization
from fedsim.privacy.matrix.sensitivity import Participation
from fedsim.privacy.matrix.toeplitz import banded_toeplitz, sqrt_factorization
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree

KINDS = ("tree", "honaker", "sqrt", "toeplitz", "banded", "dense", "blt")
#: version of the cache key; bump when an optimiser's result changes
CACHE_FORMAT = "fedsim.factorize/1"


@dataclass(frozen=True)
class Spec:
    """What a factorization is built from (all of it goes into the cache key).

    ``participations`` and ``min_sep`` come together (b-min-separation, at most k rounds
    ``min_sep`` apart) or not at all (single participation). ``bands`` is required by
    ``banded`` and ``toeplitz`` (default: ``min_sep``); ``buffers`` is BLT's.
    """

    kind: str
    rounds: int
    bands: int | None = None
    participations: int | None = None
    min_sep: int | None = None
    buffers: int = 3

    def __post_init__(self) -> None:
        require(self.kind in KINDS, "kind", self.kind, f"one of {', '.join(KINDS)}")
        require(
            isinstance(self.rounds, int) and self.rounds >= 1, "rounds", self.rounds, "an int >= 1"
        )
        if (self.participations is None) != (self.min_sep is None):
            missing = "min_sep" if self.min_sep is None else "participations"
            raise ConfigError(
                missing, None, "an integer >= 1: participations and min_sep come together"
            )
        for key in ("participations", "min_sep"):
            value = getattr(self, key)
            require(value is None or value >= 1, key, value, "an integer >= 1")
        if self.kind in ("banded", "toeplitz") and self.bands is None:
            require(
                self.min_sep is not None,
                "bands",
                None,
                f"an integer in [1, {self.rounds}] (required by kind {self.kind} without min_sep)",
            )
        band_count = self.band_count
        require(
            band_count is None or 1 <= band_count <= self.rounds,
            "bands",
            band_count,
            f"an integer in [1, rounds = {self.rounds}]",
        )
        require(1 <= self.buffers <= 16, "buffers", self.buffers, "an integer in [1, 16]")

    @property
    def band_count(self) -> int | None:
        """Bands used: ``bands``, else ``min(min_sep, rounds)`` for the banded kinds."""
        if self.bands is not None:
            return int(self.bands)
        if self.kind in ("banded", "toeplitz") and self.min_sep is not None:
            return min(int(self.min_sep), self.rounds)
        return None

    @property
    def participation(self) -> Participation:
        if self.min_sep is None:
            return Participation.single()
        return Participation.separated(int(self.min_sep), self.participations)

    def key(self) -> str:
        """The cache key: this spec as sorted JSON, with the format version."""
        return json.dumps({"format": CACHE_FORMAT, **asdict(self)}, sort_keys=True)


def build(spec: Spec) -> Factorization:
    """The optimised (or closed-form) factorization of prefix sums that ``spec`` names.

    ``dense`` optimises for ``participations`` fixed epochs (rounds must be a multiple); the
    other optimisers take the min-separation schema directly (banded C needs
    ``bands <= min_sep`` for its columns to be orthogonal where a user can reappear).
    """
    n, kind, p = spec.rounds, spec.kind, spec.participation
    if kind == "tree":
        return binary_tree(n)
    if kind == "honaker":
        return honaker_tree(n)
    if kind == "sqrt":
        return sqrt_factorization(n)
    if kind == "toeplitz":
        return banded_toeplitz(n, spec.band_count, p)
    if kind == "banded":
        if spec.min_sep is not None and spec.participations and spec.participations > 1:
            require(
                spec.band_count <= spec.min_sep,
                "bands",
                spec.band_count,
                f"at most min_sep = {spec.min_sep} (columns one user shares orthogonal)",
            )
        return banded(n, spec.band_count)
    if kind == "dense":
        epochs = p.participations(n)
        require(
            n % epochs == 0,
            "participations",
            spec.participations,
            f"a number of epochs dividing rounds = {n} (dense optimises fixed-epoch order)",
        )
        return dense(n, epochs)
    return blt(n, spec.buffers, p)


def cached(spec: Spec, path: str | Path) -> tuple[Factorization, dict[str, Any]]:
    """``build(spec)``, read from ``path`` when it holds the same spec, else built and saved.

    Returns the factorization and ``{"cached": bool, "seconds": build time, "path": ...}``
    (``seconds`` is the original build's when cached).
    """
    path = Path(path)
    require(path.suffix == ".npz", "out", str(path), "a path ending in .npz")
    if path.is_file():
        try:
            f = Factorization.load(path)
        except (ConfigError, OSError, ValueError, KeyError):
            f = None
        if f is not None and f.params.get("cache_key") == spec.key():
            return f, {"cached": True, "seconds": float(f.params["seconds"]), "path": str(path)}
    start = time.perf_counter()
    built = build(spec)
    seconds = time.perf_counter() - start
    params = {**built.params, "cache_key": spec.key(), "seconds": seconds}
    f = Factorization(built.kind, built.workload, built.encoder, built.decoder, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    f.save(path)
    return f, {"cached": False, "seconds": seconds, "path": str(path)}


def spec_of(f: Factorization) -> Spec | None:
    """The :class:`Spec` a factorization written by :func:`cached` was built from."""
    key = f.params.get("cache_key")
    if not isinstance(key, str):
        return None
    data = json.loads(key)
    data.pop("format", None)
    return Spec(**data)
