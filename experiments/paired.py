"""Paired differences over seeds: the 95 % t interval of their mean and what it supports."""

from __future__ import annotations

import math
import statistics

from scipy import stats


def interval(differences: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t interval of the mean of paired ``differences``,
    ``mean ± t_{0.975, n−1} · s / √n`` with ``s`` the sample sd (ddof = 1)."""
    n = len(differences)
    mean = statistics.mean(differences)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(differences: list[float]) -> str | None:
    """ "ahead" / "behind" where the 95 % interval of the paired mean excludes zero, "level"
    where it contains it; None with fewer than two pairs."""
    if len(differences) < 2:
        return None
    _, low, high = interval(differences)
    return "ahead" if low > 0 else "behind" if high < 0 else "level"
