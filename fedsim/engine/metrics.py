"""Weighted metric sums: additive, so they can be split and merged freely.

Used twice: each worker adds the metrics of the replies it produced (weighted by
``num-examples``) so run records show client-weighted means whether or not
replies were folded on the workers; and reducers fold metrics the way Flower's
``aggregate_metricrecords`` does (scalars and lists, weighted means).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import MetricRecord

WEIGHT_KEY = "num-examples"


@dataclass
class MetricSums:
    """``sum_i w_i m_i`` and ``sum_i w_i`` per metric key (scalars and lists)."""

    weighted: dict[str, float | np.ndarray] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    total: float = 0.0

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
            previous = self.weighted.get(key)
            self.weighted[key] = term if previous is None else previous + term
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def merge(self, other: MetricSums) -> None:
        self.total += other.total
        for key, value in other.weighted.items():
            previous = self.weighted.get(key)
            self.weighted[key] = value if previous is None else previous + value
            self.weights[key] = self.weights.get(key, 0.0) + other.weights[key]

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
