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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.privacy.matrix.banded import banded
from fedsim.privacy.matrix.blt import blt
from fedsim.privacy.matrix.dense import dense
from fedsim.privacy.matrix.factorization import Factorization, Progress
from fedsim.privacy.matrix.toeplitz import banded_toeplitz, sqrt_factorization
from fedsim.privacy.matrix.tree import binary_tree, honaker_tree
from fedsim.privacy.participation import Participation

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


#: rounds above which ``dense`` is refused unless forced (:func:`check_cost`)
DENSE_LIMIT = 1024
#: the optimisers' iteration caps (their ``max_iter`` defaults)
MAX_ITER = {"dense": 1000, "banded": 500, "toeplitz": 500, "blt": 500}


@dataclass(frozen=True)
class Cost:
    """What building a spec costs, before it starts: the optimiser's iteration cap, the
    floating-point operations of one loss-and-gradient evaluation and the memory it holds."""

    iterations: int
    flops_per_iteration: float
    memory_bytes: float

    @property
    def total_flops(self) -> float:
        return self.iterations * self.flops_per_iteration

    def describe(self) -> str:
        return (
            f"up to {self.iterations} iterations of about {self.flops_per_iteration:.2g} "
            f"floating-point operations each, about {self.memory_bytes / 2**30:.2g} GiB of memory"
        )


def cost(spec: Spec) -> Cost | None:
    """The cost of optimising ``spec`` (None for the closed forms: tree, honaker, sqrt).

    Per evaluation: dense ``~4.3 n^3`` (Cholesky of the n x n Gram matrix and two solves)
    with ``~(8 + 20) n^2`` float64 held (the n x n work arrays and L-BFGS's 20 pairs of
    ``~n^2 / 2`` parameters); banded ``~4 n^2 bands``; Toeplitz and BLT ``~n^2``."""
    n, kind = spec.rounds, spec.kind
    if kind not in MAX_ITER:
        return None
    if kind == "dense":
        return Cost(MAX_ITER[kind], 4.3 * n**3, 8.0 * (8 + 20) * n**2)
    if kind == "banded":
        return Cost(MAX_ITER[kind], 4.0 * n**2 * spec.band_count, 8.0 * 6 * n**2)
    return Cost(MAX_ITER[kind], 10.0 * n**2, 8.0 * 4 * n**2)


def check_cost(spec: Spec, force: bool = False) -> Cost | None:
    """:func:`cost`, refusing ``dense`` above :data:`DENSE_LIMIT` rounds unless ``force``."""
    estimate = cost(spec)
    if spec.kind == "dense" and spec.rounds > DENSE_LIMIT and not force:
        raise ConfigError(
            "rounds",
            spec.rounds,
            f"at most {DENSE_LIMIT} for kind dense unless --force is given: it costs "
            f"{estimate.describe()} (banded or blt scale to many more rounds)",
        )
    return estimate


def build(spec: Spec, progress: Progress | None = None) -> Factorization:
    """The optimised (or closed-form) factorization of prefix sums that ``spec`` names.

    ``dense`` optimises for ``participations`` fixed epochs (rounds must be a multiple); the
    other optimisers take the min-separation schema directly (banded C needs
    ``bands <= min_sep`` for its columns to be orthogonal where a user can reappear).
    ``progress`` hears of each optimiser iteration.
    """
    n, kind, p = spec.rounds, spec.kind, spec.participation
    if kind == "tree":
        return binary_tree(n)
    if kind == "honaker":
        return honaker_tree(n)
    if kind == "sqrt":
        return sqrt_factorization(n)
    if kind == "toeplitz":
        return banded_toeplitz(n, spec.band_count, p, progress=progress)
    if kind == "banded":
        if spec.min_sep is not None and spec.participations and spec.participations > 1:
            require(
                spec.band_count <= spec.min_sep,
                "bands",
                spec.band_count,
                f"at most min_sep = {spec.min_sep} (columns one user shares orthogonal)",
            )
        return banded(n, spec.band_count, progress=progress)
    if kind == "dense":
        epochs = p.participations(n)
        require(
            n % epochs == 0,
            "participations",
            spec.participations,
            f"a number of epochs dividing rounds = {n} (dense optimises fixed-epoch order)",
        )
        return dense(n, epochs, progress=progress)
    return blt(n, spec.buffers, p, progress=progress)


#: the kind a spec's factorization is saved under
SAVED_KIND = {"toeplitz": "banded_toeplitz"}
#: kinds with a closed form: a cached file of one must equal what :func:`build` gives
CLOSED_FORMS = ("tree", "honaker", "sqrt")


def reuse_refusal(spec: Spec, path: Path) -> tuple[Factorization | None, str | None]:
    """The factorization in ``path`` if it may stand for ``build(spec)``, else why not.

    A file is reused only when :meth:`Factorization.load` accepts it (its ``sha256`` matches
    its content, ``B C = A``, its noise stream generates its C's noise), it carries this spec's
    cache key and its content's digest, and its shape is the spec's (kind, rounds, bands, BLT
    buffers, dense epochs; closed forms are rebuilt and compared). Whatever a reused file
    holds, epsilon is computed from its own C, never read from it."""
    try:
        f = Factorization.load(path)
    except ConfigError as err:
        return None, err.allowed
    with np.load(path, allow_pickle=False) as data:
        if "sha256" not in data.files:
            return None, "it carries no sha256 of its content"
    if f.params.get("cache_key") != spec.key():
        return None, "it was built from other arguments"
    problems = []
    seconds = f.params.get("seconds")
    if not isinstance(seconds, float) or not 0 <= seconds < float("inf"):
        problems.append(f"its build time {seconds!r} is not a number of seconds")
    if f.kind != SAVED_KIND.get(spec.kind, spec.kind) or f.n != spec.rounds:
        problems.append(f"it holds {f.kind} for n = {f.n}")
    if spec.band_count is not None and spec.kind in ("banded", "toeplitz"):
        if f.params.get("bands") != spec.band_count:
            problems.append(f"bands {f.params.get('bands')!r}, not {spec.band_count}")
    if spec.kind == "blt" and np.shape(f.params.get("weights")) != (spec.buffers,):
        problems.append(f"not {spec.buffers} BLT buffers")
    if spec.kind == "dense" and f.params.get("epochs") != spec.participation.participations(
        spec.rounds
    ):
        problems.append("another number of epochs")
    if not problems and spec.kind in CLOSED_FORMS:
        expected = build(spec)
        if not (
            np.array_equal(f.encoder, expected.encoder)
            and np.array_equal(f.decoder, expected.decoder)
        ):
            problems.append("not the closed form of its kind")
    if problems:
        return None, "; ".join(problems)
    return f, None


def cached(
    spec: Spec,
    path: str | Path,
    progress: Progress | None = None,
    before_build: Callable[[], None] | None = None,
) -> tuple[Factorization, dict[str, Any]]:
    """``build(spec)``, read from ``path`` when :func:`reuse_refusal` accepts the file there,
    else built and saved (replacing it); ``before_build`` is called when it is to be built,
    ``progress`` hears of each optimiser iteration.

    Returns the factorization and ``{"cached": bool, "seconds": build time, "path": ...,
    "sha256": the content's digest}``, and ``"replaced"`` (why a file there was not reused);
    ``seconds`` is the original build's when cached.
    """
    path = Path(path)
    require(path.suffix == ".npz", "out", str(path), "a path ending in .npz")
    require(not path.is_dir(), "out", str(path), "a file path (it is a directory)")
    replaced = None
    if path.exists():
        f, replaced = reuse_refusal(spec, path)
        if f is not None:
            info = {"cached": True, "seconds": float(f.params["seconds"]), "path": str(path)}
            return f, {**info, "sha256": f.digest()}
    if before_build is not None:
        before_build()
    start = time.perf_counter()
    built = build(spec, progress)
    seconds = time.perf_counter() - start
    params = {**built.params, "cache_key": spec.key(), "seconds": seconds}
    f = Factorization(built.kind, built.workload, built.encoder, built.decoder, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    f.save(path)
    info = {"cached": False, "seconds": seconds, "path": str(path), "sha256": f.digest()}
    return f, info if replaced is None else {**info, "replaced": replaced}


def spec_of(f: Factorization, path: str = "factorization") -> Spec | None:
    """The :class:`Spec` a factorization written by :func:`cached` was built from (None for
    one without a cache key); ConfigError naming ``path`` when the key is not a spec's."""
    key = f.params.get("cache_key")
    if key is None:
        return None
    try:
        data = json.loads(key) if isinstance(key, str) else None
        if not isinstance(data, dict) or data.pop("format", None) != CACHE_FORMAT:
            raise ValueError("not a cache key of this version")
        return Spec(**data)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            "factorization", path, f"a file whose cache_key is a fedsim factorize spec ({err})"
        ) from None
