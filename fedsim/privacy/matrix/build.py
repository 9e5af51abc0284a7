"""Factorizations by name, and an on-disk cache of optimised ones.

:func:`build` maps a kind (one of :data:`fedsim.privacy.matrix.kinds.REGISTERED`) and the
run's shape (rounds, bands, participation, the kind's own options) to the optimiser of that
family for the prefix-sum workload. :func:`cached` keeps the result in an ``.npz``
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
from fedsim.privacy.matrix.factorization import Factorization, Progress
from fedsim.privacy.matrix.kind import Cost
from fedsim.privacy.matrix.kinds import NAMES, kind
from fedsim.privacy.participation import Participation

#: version of the cache key; bump when an optimiser's result changes
CACHE_FORMAT = "fedsim.factorize/1"


@dataclass(frozen=True)
class Spec:
    """What a factorization is built from (all of it goes into the cache key).

    ``participations`` and ``min_sep`` come together (b-min-separation, at most k rounds
    ``min_sep`` apart) or not at all (single participation). ``bands`` is required by
    the banded kinds (default: ``min_sep``); ``buffers`` is BLT's; ``options`` are the
    integer parameters of the kind's own (:attr:`fedsim.privacy.matrix.kind.Kind.options`),
    as ``(name, value)`` pairs.
    """

    kind: str
    rounds: int
    bands: int | None = None
    participations: int | None = None
    min_sep: int | None = None
    buffers: int = 3
    options: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        require(self.kind in NAMES, "kind", self.kind, f"one of {', '.join(NAMES)}")
        self._check_options()
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
        if kind(self.kind).banded and self.bands is None:
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

    def _check_options(self) -> None:
        """``options``: distinct names the kind declares, each an integer >= 1."""
        pairs = tuple((str(name), value) for name, value in self.options)
        object.__setattr__(self, "options", tuple(sorted(pairs)))
        declared = kind(self.kind).options
        for name, value in self.options:
            require(
                name in declared,
                f"kind_options.{name}",
                value,
                f"one of {', '.join(declared)}" if declared else f"nothing for kind {self.kind}",
            )
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"kind_options.{name}",
                value,
                "an integer >= 1",
            )
        names = [name for name, _ in self.options]
        require(len(set(names)) == len(names), "kind_options", names, "distinct names")

    def option(self, name: str) -> int | None:
        """The kind's option ``name`` (None: unset)."""
        return dict(self.options).get(name)

    @property
    def band_count(self) -> int | None:
        """Bands used: ``bands``, else ``min(min_sep, rounds)`` for the banded kinds."""
        if self.bands is not None:
            return int(self.bands)
        if kind(self.kind).banded and self.min_sep is not None:
            return min(int(self.min_sep), self.rounds)
        return None

    @property
    def participation(self) -> Participation:
        if self.min_sep is None:
            return Participation.single()
        return Participation.separated(int(self.min_sep), self.participations)

    def key(self) -> str:
        """The cache key: this spec as sorted JSON, with the format version (``options``
        only when there are any, so that the keys of files without stay as they were)."""
        fields = asdict(self)
        if not fields["options"]:
            del fields["options"]
        return json.dumps({"format": CACHE_FORMAT, **fields}, sort_keys=True)


#: rounds above which ``dense`` is refused unless forced (:func:`check_cost`)
DENSE_LIMIT = 1024


def cost(spec: Spec) -> Cost | None:
    """The cost of optimising ``spec`` (its kind's; None for the closed forms)."""
    estimate = kind(spec.kind).cost
    return None if estimate is None else estimate(spec)


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
    """The optimised (or closed-form) factorization of prefix sums that ``spec`` names
    (its kind's :attr:`~fedsim.privacy.matrix.kind.Kind.build`; ``progress`` hears of each
    optimiser iteration)."""
    return kind(spec.kind).build(spec, progress)


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
    declared = kind(spec.kind)
    if f.kind != declared.saved_as or f.n != spec.rounds:
        problems.append(f"it holds {f.kind} for n = {f.n}")
    if spec.band_count is not None and declared.banded:
        if f.params.get("bands") != spec.band_count:
            problems.append(f"bands {f.params.get('bands')!r}, not {spec.band_count}")
    problems.extend(declared.file_problems(spec, f))
    if not problems and declared.closed_form:
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
        if "options" in data:
            data["options"] = tuple(tuple(pair) for pair in data["options"])
        return Spec(**data)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            "factorization", path, f"a file whose cache_key is a fedsim factorize spec ({err})"
        ) from None
