"""Weighted metric sums: additive, so they can be split and merged freely.

Used twice: each worker adds the metrics of the replies it produced (weighted by
``num-examples``) so run records show client-weighted means whether or not
replies were folded on the workers; and reducers fold metrics the way Flower's
``aggregate_metricrecords`` does (scalars and lists, weighted means).

A metric whose values disagree in shape between replies (a list of 3 where
others sent 2) cannot be averaged: it is left out of the means from then on
(``conflicts``, logged once) rather than failing the fold for everyone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from flwr.app import MetricRecord

WEIGHT_KEY = "num-examples"

log = logging.getLogger(__name__)


@dataclass
class MetricSums:
    """``sum_i w_i m_i`` and ``sum_i w_i`` per metric key (scalars and lists)."""

    weighted: dict[str, float | np.ndarray] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    conflicts: set[str] = field(default_factory=set)

    def _accumulate(self, key: str, term: float | np.ndarray, weight: float) -> None:
        if key in self.conflicts:
            return
        previous = self.weighted.get(key)
        if previous is not None and np.shape(previous) != np.shape(term):
            log.warning(
                "metric %r has shape %s in one reply and %s in another; it is left out",
                key,
                np.shape(term),
                np.shape(previous),
            )
            self.conflicts.add(key)
            del self.weighted[key], self.weights[key]
            return
        self.weighted[key] = term if previous is None else previous + term
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def add(
        self, record: MetricRecord, weight: float | None = None, skip: tuple[str, ...] = ()
    ) -> None:
        """Add a record with ``weight`` (default: its ``num-examples``, else 1)."""
        if weight is None:
            value = record.get(WEIGHT_KEY, 1)
            weight = float(value) if isinstance(value, (int, float)) else 1.0
        self.total += weight
        for key, value in record.items():
            if key == WEIGHT_KEY or key in skip:
                continue
            term = weight * (
                np.asarray(value, dtype=np.float64) if isinstance(value, list) else float(value)
            )
            self._accumulate(key, term, weight)

    def merge(self, other: MetricSums) -> None:
        self.total += other.total
        for key in other.conflicts - self.conflicts:
            self.conflicts.add(key)
            self.weighted.pop(key, None)
            self.weights.pop(key, None)
        for key, value in other.weighted.items():
            self._accumulate(key, value, other.weights[key])

    def means(self) -> dict[str, float | list[float]]:
        """Weighted mean of each metric (keys with zero total weight are left out)."""
        out: dict[str, float | list[float]] = {}
        for key, value in self.weighted.items():
            if self.weights[key] > 0:
                mean = value / self.weights[key]
                out[key] = mean.tolist() if isinstance(mean, np.ndarray) else float(mean)
        return out

    def record(self, weight_key: str) -> MetricRecord:
        """The means as a MetricRecord with ``weight_key`` set to the total weight."""
        record = MetricRecord(self.means())
        total = self.total
        record[weight_key] = int(total) if float(total).is_integer() else total
        return record


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (``VmHWM``, which unlike
    ``ru_maxrss`` does not carry a parent's peak across ``exec``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
