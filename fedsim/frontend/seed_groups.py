"""Runs that differ only in their seed, as one group: what ``fedsim plot`` draws as a mean
with a band and ``fedsim compare`` summarises as mean ± sd with paired differences.

A *seed key* is a config key whose last dotted part is ``seed`` or ends in ``_seed`` /
``-seed`` (``seed``, ``data.seed``, ``client.seed``, ``faults.seed``, a Flower app's
``run_config.seed``). Two runs are in one group when their flattened configs
(:mod:`fedsim.frontend.run_series`) are equal once the seed keys are left out; a run whose directory
holds no config is a group of its own (what it ran is unknown). A run's *seed* is the values
of its seed keys; two groups are *paired* on the seeds both of them ran.

Statistics over the n runs of a group (or the n paired differences of two groups):

* the mean ``x̄``; the sample standard deviation ``s = sqrt(Σ (x_i − x̄)² / (n − 1))``
  (``ddof=1``; undefined for n = 1);
* the 95 % t-interval of the mean, ``x̄ ± t_{0.975, n−1} · s / sqrt(n)`` (Student's t with
  n − 1 degrees of freedom; for paired differences this is the paired t-interval).

Values that are not finite (an infinite epsilon) give no sd and no interval.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedsim.frontend.run_series import RunSeries, format_value, run_labels

#: the level of every interval
LEVEL = 0.95
#: what the sd is, said wherever one is shown
SD_TEXT = "sample sd (ddof=1)"
#: what the interval is, said wherever one is shown
INTERVAL_TEXT = "95 % t-interval of the mean"


def is_seed_key(key: str) -> bool:
    """Whether the dotted config key ``key`` names a seed (see the module docstring)."""
    leaf = key.rsplit(".", 1)[-1].lower()
    return leaf == "seed" or leaf.endswith(("_seed", "-seed"))


def seed_of(run: RunSeries) -> dict[str, Any]:
    """The values of ``run``'s seed keys, by key."""
    return {k: v for k, v in sorted(run.config.items()) if is_seed_key(k)}


def seed_texts(seeds: Sequence[dict[str, Any]]) -> list[str]:
    """Each seed (:func:`seed_of`) as tables and legends show it, told apart from the others
    of ``seeds`` by the seed keys whose values vary between them: the run seed's value when
    those keys follow it (``data.seed`` = ``seed``), else each varying key with its value; a
    lone seed shows its ``seed``; ``?`` for a run with no seed key."""
    keys = sorted({k for seed in seeds for k in seed})
    varying = [k for k in keys if len({json.dumps(s.get(k), sort_keys=True) for s in seeds}) > 1]
    out = []
    for seed in seeds:
        shown = [k for k in varying if k in seed] or (["seed"] if "seed" in seed else list(seed))
        if not shown:
            out.append("?")
        elif "seed" in shown and all(_same(seed[k], seed["seed"]) for k in shown):
            out.append(format_value(seed["seed"]))
        else:
            out.append(", ".join(f"{k}={format_value(seed[k])}" for k in shown))
    return out


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _group_key(run: RunSeries, index: int) -> str:
    if not run.config:
        return f"\0no config {index}"
    rest = {k: v for k, v in run.config.items() if not is_seed_key(k)}
    return json.dumps(rest, sort_keys=True, default=str)


@dataclass(frozen=True)
class Group:
    """Runs whose configs differ only in their seed keys, in the order they were given."""

    runs: tuple[RunSeries, ...]

    @property
    def seeds(self) -> list[dict[str, Any]]:
        return [seed_of(run) for run in self.runs]

    @property
    def seed_texts(self) -> list[str]:
        return seed_texts(self.seeds)


def group_runs(runs: Sequence[RunSeries]) -> list[Group]:
    """``runs`` grouped by their config without the seed keys; groups in the order of their
    first run."""
    members: dict[str, list[RunSeries]] = {}
    for i, run in enumerate(runs):
        members.setdefault(_group_key(run, i), []).append(run)
    return [Group(tuple(group)) for group in members.values()]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """n, mean, sample sd (ddof=1) and the 95 % t-interval (low, high) of ``values``; sd and
    interval are None for n < 2 or when a value is not finite."""
    from scipy.stats import t as student_t  # noqa: PLC0415

    x = np.asarray(values, dtype=float)
    n = int(x.size)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "low": None, "high": None}
    mean = float(np.mean(x))
    if n < 2 or not np.all(np.isfinite(x)):
        return {"n": n, "mean": mean, "sd": None, "low": None, "high": None}
    sd = float(np.std(x, ddof=1)) if np.ptp(x) > 0 else 0.0  # equal values: exactly 0
    half = float(student_t.ppf(0.5 + LEVEL / 2, n - 1)) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def paired_seeds(a: Group, b: Group) -> list[tuple[RunSeries, RunSeries, str]]:
    """(run of ``a``, run of ``b``, seed text) for each seed that each group ran exactly once
    (a run without seed keys pairs with nothing), in ``a``'s order."""

    def once(group: Group) -> dict[str, RunSeries]:
        keys = [json.dumps(seed_of(run), sort_keys=True) for run in group.runs]
        return {k: r for k, r in zip(keys, group.runs) if keys.count(k) == 1 and k != "{}"}

    in_a, in_b = once(a), once(b)
    runs = [*a.runs, *b.runs]
    text = dict(zip(map(id, runs), seed_texts([seed_of(run) for run in runs])))
    return [(run, in_b[k], text[id(run)]) for k, run in in_a.items() if k in in_b]


def group_labels(groups: Sequence[Group]) -> list[str]:
    """A label per group: the config keys that differ between the groups (seed keys left
    out; :func:`~fedsim.frontend.run_series.run_labels`), then "(mean of n seeds)", or the seed of a
    group of one run."""
    if len(groups) == 1:
        bases = [""]
    else:
        representatives = [
            replace(
                g.runs[0], config={k: v for k, v in g.runs[0].config.items() if not is_seed_key(k)}
            )
            for g in groups
        ]
        bases = run_labels(representatives)
    labels = []
    for base, group in zip(bases, groups):
        if len(group.runs) > 1:
            tail = f"mean of {len(group.runs)} seeds"
        else:
            seed = seed_of(group.runs[0])
            tail = f"seed {seed_texts([seed])[0]}" if seed else ""
        labels.append(f"{base} ({tail})" if base and tail else base or tail or "run")
    return labels


def band_of(values: np.ndarray, band: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, low and high per column of ``values`` (runs × rounds): ``band`` ``"sd"`` is
    mean ± one sample sd, ``"ci95"`` the 95 % t-interval of the mean (NaN for one run)."""
    from scipy.stats import t as student_t  # noqa: PLC0415

    n = values.shape[0]
    mean = values.mean(axis=0)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan
    sd = np.where(np.ptp(values, axis=0) > 0, values.std(axis=0, ddof=1), 0.0)
    half = sd if band == "sd" else float(student_t.ppf(0.5 + LEVEL / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def mean_curve(
    group: Group, metric: str, band: str
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray] | None:
    """The group's curve of ``metric``: the rounds every run of the group recorded it at, and
    the mean, low and high there (:func:`band_of`); None when no round is common to all."""
    if any(metric not in run.series for run in group.runs):
        return None
    common = set(group.runs[0].series[metric].rounds)
    for run in group.runs[1:]:
        common &= set(run.series[metric].rounds)
    rounds = sorted(common)
    if not rounds:
        return None
    table = np.array(
        [
            [dict(zip(s.rounds, s.values))[r] for r in rounds]
            for s in (run.series[metric] for run in group.runs)
        ],
        dtype=float,
    )
    mean, low, high = band_of(table, band)
    return rounds, mean, low, high
