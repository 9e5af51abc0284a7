"""Client-metric bookkeeping for run records: additive weighted sums.

Each worker adds the scalar metrics of the replies it produced, weighted by
their ``num-examples`` (1 when absent), before any reduction; the grid merges
the sums of all workers, so the run record shows the same client-weighted means
whether or not replies were folded on the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import MetricRecord

WEIGHT_KEY = "num-examples"


@dataclass
class MetricSums:
    """``sum_i w_i m_i`` and ``sum_i w_i`` per scalar metric key."""

    weighted: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    examples: float = 0.0

    def add(self, record: MetricRecord) -> None:
        weight = record.get(WEIGHT_KEY, 1)
        weight = float(weight) if isinstance(weight, (int, float)) else 1.0
        self.examples += weight
        for key, value in record.items():
            if key == WEIGHT_KEY or isinstance(value, list):
                continue
            self.weighted[key] = self.weighted.get(key, 0.0) + weight * float(value)
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def merge(self, other: MetricSums) -> None:
        self.examples += other.examples
        for key, value in other.weighted.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value
            self.weights[key] = self.weights.get(key, 0.0) + other.weights[key]

    def means(self) -> dict[str, float]:
        """Weighted mean of each metric (keys with zero total weight are left out)."""
        return {k: v / self.weights[k] for k, v in self.weighted.items() if self.weights[k] > 0}
