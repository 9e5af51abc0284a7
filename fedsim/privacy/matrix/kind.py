"""What a factorization kind declares: :class:`Kind` (one per ``fedsim factorize --kind``
and ``strategy.options.kind``, registered in :mod:`fedsim.privacy.matrix.kinds`).

A kind builds its factorization from a :class:`fedsim.privacy.matrix.build.Spec`, says what
building it costs, which streaming noise generator its saved files get
(:mod:`fedsim.privacy.matrix.streaming`) and which check ties that generator's parameters to
its C (:mod:`fedsim.privacy.matrix.verify`), and what a cached file of it must match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def no_problems(spec: Any, f: Any) -> list[str]:
    """A cached file of the kind needs nothing beyond its kind, rounds and cache key."""
    return []


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One factorization kind.

    Attributes:
        name: ``--kind`` / ``strategy.options.kind``.
        build: ``build(spec, progress)`` -> the factorization (``progress`` hears of each
            optimiser iteration).
        stream: ``stream(f, noise, shape)`` -> the bounded-state noise generator of a
            factorization saved under :attr:`saved`.
        mismatch: ``mismatch(f)`` -> None when that generator gives ``G z`` for ``f``'s C,
            else what differs (:mod:`fedsim.privacy.matrix.verify`).
        saved: the kind its factorizations carry ("": :attr:`name`).
        closed_form: a cached file must equal what :attr:`build` gives.
        banded: needs ``bands`` (default ``min(min_sep, rounds)``), and its C is banded by
            construction: DMM takes it with any band count, ``bands >= rounds`` included
            (:class:`fedsim.privacy.dmm.IntegerMechanism`).
        zero_one_encoder: its C is a 0/1 matrix with several rows a round (the tree's): DMM
            releases M = C itself, with no fractional bits, and decodes with A^{-1} B.
        cost: ``cost(spec)`` -> :class:`Cost` of an optimiser (None: a closed form).
        file_problems: ``file_problems(spec, f)`` -> why a cached file does not match the
            spec's shape beyond kind and rounds (bands are checked for banded kinds).
        options: the integer parameters it reads from ``Spec.options`` (``--option``,
            ``strategy.options.kind_options``).
    """

    name: str
    build: Callable[[Any, Any], Any]
    stream: Callable[[Any, Any, Any], Any]
    mismatch: Callable[[Any], str | None]
    saved: str = ""
    closed_form: bool = False
    banded: bool = False
    zero_one_encoder: bool = False
    cost: Callable[[Any], Cost] | None = None
    file_problems: Callable[[Any, Any], list[str]] = no_problems
    options: tuple[str, ...] = ()

    @property
    def saved_as(self) -> str:
        """The kind its factorizations carry."""
        return self.saved or self.name
