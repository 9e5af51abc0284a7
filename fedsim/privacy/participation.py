"""Who may train when: the one participation type of fedsim.

A :class:`Participation` is a promise about how often, and how far apart, one client takes
part in a run's rounds: ``single`` (at most once), ``min_sep`` (b-min-separation: any two
participations at least ``min_sep`` rounds apart, at most ``max_participations`` of them;
Choquette-Choo et al. 2023, "Multi-Epoch Matrix Factorization Mechanisms") or ``fixed_epoch``
(``epochs`` passes in a fixed order). The same value is read by

- the accountant (:mod:`fedsim.privacy.round_events`, :mod:`fedsim.privacy.epsilon`,
  :class:`~fedsim.privacy.ledger.PrivacyLedger`): a deterministic schedule without
  subsampling, a client seen by at most :meth:`Participation.participations` rounds;
- the matrix mechanism's sensitivity (:mod:`fedsim.privacy.matrix.sensitivity`);
- the cohort: :meth:`fedsim.engine.participation.MinSeparationCohort.accounting` is the
  participation of the schedule it draws;
- the guard that enforces it (:class:`strategies.plumbing.participation_guard.ParticipationGuard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsim.config import require

_KINDS = ("single", "min_sep", "fixed_epoch")


def _is_count(value: Any, minimum: int = 1) -> bool:
    """An integer (not a bool) ``>= minimum``."""
    return (
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum
    )


def rounds_per_epoch(n: int, epochs: int) -> int:
    """``n / epochs`` rounds per epoch, else :class:`~fedsim.config.ConfigError`."""
    require(n % int(epochs) == 0, "epochs", epochs, f"a divisor of the number of rounds n = {n}")
    return n // int(epochs)


@dataclass(frozen=True)
class Participation:
    """How often, and how far apart, one user may take part in the n rounds.

    ``kind`` is one of ``single``, ``min_sep`` (``min_sep`` >= 1 rounds apart, at most
    ``max_participations`` times; None means as many as fit: ceil(n / min_sep)) or
    ``fixed_epoch`` (``epochs`` passes over the data in a fixed order; n must be a multiple
    of ``epochs``).
    """

    kind: str = "single"
    min_sep: int = 1
    max_participations: int | None = None
    epochs: int = 1

    def __post_init__(self) -> None:
        require(self.kind in _KINDS, "kind", self.kind, f"one of {_KINDS}")
        require(
            _is_count(self.min_sep),
            "min_separation",
            self.min_sep,
            "an integer >= 1 (rounds between two participations of a client)",
        )
        require(
            self.max_participations is None or _is_count(self.max_participations),
            "max_participations",
            self.max_participations,
            "None or an integer >= 1",
        )
        require(_is_count(self.epochs), "epochs", self.epochs, "an integer >= 1")

    @classmethod
    def single(cls) -> Participation:
        """Every user takes part in at most one round."""
        return cls("single")

    @classmethod
    def separated(cls, min_sep: int, max_participations: int | None = None) -> Participation:
        """b-min-separation: at most ``max_participations`` rounds, ``min_sep`` apart."""
        return cls("min_sep", min_sep=min_sep, max_participations=max_participations)

    @classmethod
    def fixed(cls, epochs: int) -> Participation:
        """Fixed-epoch order: rounds r, r + n/epochs, r + 2n/epochs, ..."""
        return cls("fixed_epoch", epochs=epochs)

    def participations(self, n: int) -> int:
        """The largest number of rounds one user can take part in, over n rounds."""
        if self.kind == "single":
            return 1
        if self.kind == "fixed_epoch":
            return int(self.epochs)
        fit = -(-n // int(self.min_sep))
        k = self.max_participations
        return fit if k is None else min(int(k), fit)

    def patterns(self, n: int) -> list[tuple[int, ...]]:
        """Every maximal pattern (tuple of rounds) for n rounds; for brute-force checks.

        Under ``min_sep`` every pattern of up to k rounds is listed (subsets of a pattern are
        patterns too, and with ``X >= 0`` they never give more).
        """
        if self.kind == "single":
            return [(j,) for j in range(n)]
        if self.kind == "fixed_epoch":
            b = rounds_per_epoch(n, self.epochs)
            return [tuple(range(r, n, b)) for r in range(b)]
        k, sep = self.participations(n), int(self.min_sep)
        out: list[tuple[int, ...]] = []

        def extend(prefix: tuple[int, ...], first: int) -> None:
            for j in range(first, n):
                pattern = (*prefix, j)
                out.append(pattern)
                if len(pattern) < k:
                    extend(pattern, j + sep)

        extend((), 0)
        return sorted(out, key=lambda p: (len(p), p))


