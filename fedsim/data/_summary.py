"""Per-client summaries of a partition: sizes, classes per client and label skew.

Shared by :func:`fedsim.data.partition.partition_stats` and
:meth:`fedsim.data.dataset.FederatedDataset.stats`. Everything is computed from
an ``owner`` array (client id of each assigned sample) in O(n log n) numpy
operations and returns plain Python numbers, so the result is JSON-ready and
its size does not grow with the number of clients (except the label histogram,
which has one entry per class).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _summary(values: np.ndarray) -> dict[str, float]:
    """min / median / mean / max / std of a 1-D array (all zeros when empty)."""
    if values.size == 0:
        return {"min": 0.0, "median": 0.0, "mean": 0.0, "max": 0.0, "std": 0.0}
    v = np.asarray(values, dtype=np.float64)
    return {
        "min": float(v.min()),
        "median": float(np.median(v)),
        "mean": float(v.mean()),
        "max": float(v.max()),
        "std": float(v.std()),
    }


def owner_stats(
    owner: np.ndarray, labels: np.ndarray, num_clients: int, num_classes: int
) -> dict[str, Any]:
    """Statistics of samples ``labels[i]`` owned by client ``owner[i]``.

    ``owner`` and ``labels`` are 1-D integer arrays of equal length with
    ``0 <= owner < num_clients`` and ``0 <= labels < num_classes``.

    Returns sizes (min/median/mean/max/std over clients), classes per client
    (mean/min/max), the global label histogram (counts per class plus its
    min/max), the number of empty clients, the total number of samples and the
    mean total-variation distance between each non-empty client's label
    distribution and the global one (0 = IID labels, close to 1 = disjoint).
    """
    owner = np.asarray(owner, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    n = int(owner.size)
    sizes = np.bincount(owner, minlength=num_clients)
    hist = np.bincount(labels, minlength=num_classes)
    # one entry per (client, class) pair that occurs, with its count
    pair_keys, pair_counts = np.unique(owner * num_classes + labels, return_counts=True)
    pair_client = pair_keys // num_classes
    pair_class = pair_keys % num_classes
    classes_per_client = np.bincount(pair_client, minlength=num_clients)
    nonempty = sizes > 0
    if n > 0:
        p_global = hist / n
        p_local = pair_counts / sizes[pair_client]
        diff = np.abs(p_local - p_global[pair_class]) - p_global[pair_class]
        # sum_c |p_kc - p_c| = 1 + sum_{present c} (|p_kc - p_c| - p_c)
        l1 = 1.0 + np.bincount(pair_client, weights=diff, minlength=num_clients)
        tv = 0.5 * l1[nonempty]
        mean_tv = float(tv.mean()) if tv.size else 0.0
    else:
        mean_tv = 0.0
    cpc = classes_per_client[nonempty]
    return {
        "num_clients": int(num_clients),
        "num_classes": int(num_classes),
        "total_samples": n,
        "empty_clients": int(num_clients - int(nonempty.sum())),
        "sizes": _summary(sizes),
        "classes_per_client": {
            "mean": float(cpc.mean()) if cpc.size else 0.0,
            "min": int(cpc.min()) if cpc.size else 0,
            "max": int(cpc.max()) if cpc.size else 0,
        },
        "label_histogram": {
            "counts": [int(c) for c in hist],
            "min": int(hist.min()) if hist.size else 0,
            "max": int(hist.max()) if hist.size else 0,
        },
        "mean_label_tv_distance": mean_tv,
    }
