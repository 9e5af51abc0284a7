"""Run directories read back as per-round series: what ``fedsim plot``, ``fedsim compare`` and
a run's TensorBoard events show.

A run directory (``fedsim run`` or ``fedsim flwr-run``) holds ``rounds.jsonl``, one line per
round (:mod:`fedsim.frontend.results`). A *metric* is one number of those lines, named by its path
in the line joined with ``/``:

* ``train/<m>``, ``evaluate/<m>`` (and ``query/<m>``): the client-weighted mean of the phase's
  clients' metric ``<m>`` (``train.metrics.<m>`` in the line; absent in private runs unless
  ``[privacy] metrics_in_clear``);
* ``aggregated/<m>``, ``aggregated_evaluate/<m>``: what the strategy's aggregation returned;
  ``central/<m>``: the server's evaluation on its own held-out rows (round 0: the initial model);
* ``privacy/epsilon``: the run's epsilon so far, at ``privacy.delta`` (a ledger's accountant);
  ``client_privacy/max_epsilon``: the largest epsilon a client of the round reports for itself
  (DP-SGD clients), at ``client_privacy.delta``;
* ``bytes_up``, ``bytes_down`` (payload bytes of the round), ``seconds`` (wall time of the
  round), ``clients_per_s``: the costs of rounds >= 1 (round 0 evaluates the initial model; it
  is not a round).

An infinite epsilon (no noise) reads back as ``math.inf``. The config of a run is its
``config.json`` (``fedsim run``), or the Flower app's run config and node count from
``summary.json`` (``fedsim flwr-run``), flattened to dotted keys
(``strategy.options.noise_multiplier``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedsim.config import ConfigError
from fedsim.results_json import ROUNDS_FILE, SUMMARY_FILE
from fedsim.runfiles import CONFIG_FILE, RunFileError

#: sections of a round line holding the phases' clients' metrics (under ``metrics``)
PHASES = ("train", "evaluate", "query")
#: sections of a round line that are themselves metric mappings
AGGREGATES = ("aggregated", "aggregated_evaluate", "central")
#: the epsilon metrics and the section whose ``delta`` they are at
EPSILONS = {"privacy/epsilon": "privacy", "client_privacy/max_epsilon": "client_privacy"}
#: per-round costs, recorded for rounds >= 1
COSTS = ("bytes_up", "bytes_down", "seconds", "clients_per_s")
#: an aggregate that repeats a phase's client-weighted means (shown by default only without them)
REPEATS = {"aggregated": "train", "aggregated_evaluate": "evaluate"}
#: a config key one run has and another lacks
ABSENT = "(absent)"
#: round numbers a run can have (a config's rounds is a 64-bit integer)
MAX_ROUND = 2**63 - 1

Best = Literal["max", "min"]


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def round_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The metrics of one round line, by name (see the module docstring)."""
    out: dict[str, float] = {}
    for phase in PHASES:
        out.update(_numbers(phase, _mapping(_mapping(record.get(phase)).get("metrics"))))
    for section in AGGREGATES:
        out.update(_numbers(section, _mapping(record.get(section))))
    for name, section in EPSILONS.items():
        value = as_number(_mapping(record.get(section)).get(name.split("/")[1]))
        if value is not None:
            out[name] = value
    if int(record.get("round", 0)) >= 1:
        out.update((key, v) for key in COSTS if (v := as_number(record.get(key))) is not None)
    return out


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one (a line's file is not trusted)."""
    return value if isinstance(value, Mapping) else {}


def _numbers(section: str, mapping: Mapping[str, Any]) -> dict[str, float]:
    return {
        f"{section}/{key}": value
        for key, item in mapping.items()
        if (value := as_number(item)) is not None
    }


def best_is(metric: str) -> Best | None:
    """Which way a metric improves: "max" for accuracy-like, "min" for loss-like, else None."""
    leaf = metric.rsplit("/", 1)[-1].lower()
    if "accuracy" in leaf or leaf == "acc" or leaf.endswith("_acc") or leaf.startswith("acc_"):
        return "max"
    if any(word in leaf for word in ("loss", "perplexity", "error", "mse")):
        return "min"
    return None


@dataclass(frozen=True)
class Series:
    """One metric of one run: its value at each round that recorded it (rounds ascending)."""

    rounds: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def final(self) -> tuple[int, float]:
        """(round, value) of the last round that recorded it."""
        return self.rounds[-1], self.values[-1]

    def best(self, direction: Best) -> tuple[int, float]:
        """(round, value) of the largest (``max``) or smallest (``min``) finite value (the
        first such round on ties); the final value when no value is finite."""
        finite = [(r, v) for r, v in zip(self.rounds, self.values) if math.isfinite(v)]
        if not finite:
            return self.final
        pick = max if direction == "max" else min
        return pick(finite, key=lambda rv: rv[1])


@dataclass(frozen=True)
class RunSeries:
    """A run directory read back.

    Attributes:
        path: the directory, as given.
        records: its round lines (``rounds.jsonl``), in order.
        summary: ``summary.json`` (None while the run has not finished).
        config: its config, flattened to dotted keys (empty when the directory holds none).
        series: every metric the run recorded (see the module docstring).
    """

    path: Path
    records: tuple[dict[str, Any], ...]
    summary: dict[str, Any] | None
    config: dict[str, Any]
    series: dict[str, Series]

    @property
    def name(self) -> str:
        return self.path.resolve().name

    def final(self, metric: str) -> float | None:
        """The last recorded value of ``metric`` (None: the run has none)."""
        return self.series[metric].final[1] if metric in self.series else None

    def delta(self, epsilon: str) -> float | None:
        """The delta of the epsilon metric ``epsilon`` (:data:`EPSILONS`) in the last round
        line that has its section (None: none has, or it holds no number)."""
        for record in reversed(self.records):
            section = record.get(EPSILONS[epsilon])
            if isinstance(section, Mapping):
                return as_number(section.get("delta"))
        return None


def load_run(path: str | Path, key: str = "RUN_DIR") -> RunSeries:
    """Read the run in ``path``; ConfigError (naming ``key`` and the path) when it is not a
    run directory, RunFileError (naming the file, and the line of rounds.jsonl) when one of
    its files is damaged (:func:`read_round_lines`, :func:`check_record`)."""
    path = Path(path)
    what = "a run directory written by `fedsim run` or `fedsim flwr-run`"
    if not path.is_dir():
        raise ConfigError(key, str(path), f"{what} (no such directory)")
    rounds_path = path / ROUNDS_FILE
    if not rounds_path.is_file():
        raise ConfigError(key, str(path), f"{what} (it has no {ROUNDS_FILE})")
    records = read_round_lines(rounds_path)
    if not records:
        raise ConfigError(
            key, str(path), f"{what} with at least one round ({ROUNDS_FILE} is empty)"
        )
    summary = _read_json(path / SUMMARY_FILE)
    return RunSeries(path, tuple(records), summary, _config(path, summary), _series(records))


def load_runs(paths: Sequence[str | Path], key: str = "RUN_DIR") -> list[RunSeries]:
    if not paths:
        raise ConfigError(key, None, "one or more run directories")
    return [load_run(p, key) for p in paths]


def read_round_lines(path: Path) -> list[dict[str, Any]]:
    """Every round line of ``path``, each checked by :func:`check_record`; a line that is not
    one is refused naming the file and the line (1-based). Only a last line without its
    newline that is not JSON is left out: the process died while writing it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RunFileError(path, f"cannot be read as UTF-8 text ({type(err).__name__})") from None
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise RunFileError(path, f"line {number} is not JSON") from None
        problem = check_record(record)
        if problem:
            raise RunFileError(path, f"line {number} is not a round record: {problem}")
        records.append(record)
    if torn:
        try:
            record = json.loads(torn)
        except ValueError:
            return records  # torn while being written
        problem = check_record(record)
        if problem:
            raise RunFileError(path, f"line {len(lines) + 1} is not a round record: {problem}")
        records.append(record)
    return records


def check_record(record: Any) -> str | None:
    """None when ``record`` can be a line of rounds.jsonl (:mod:`fedsim.frontend.results`); else
    what is wrong: the round is an integer in ``[0, MAX_ROUND]``, sections are mappings, epsilon a
    number >= 0 or Infinity (never NaN), delta in ``[0, 1]``, costs finite numbers >= 0."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    number = record.get("round")
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_ROUND:
        return f"round = {_short(number)} (an integer in [0, 2^63))"
    for section in (*PHASES, *AGGREGATES, *EPSILONS.values()):
        if section in record and record[section] is not None:
            if not isinstance(record[section], Mapping):
                return f"{section} = {_short(record[section])} (a JSON object)"
    for phase in PHASES:
        metrics = _mapping(record.get(phase)).get("metrics")
        if metrics is not None and not isinstance(metrics, Mapping):
            return f"{phase}.metrics = {_short(metrics)} (a JSON object)"
    for section in EPSILONS.values():
        values = _mapping(record.get(section))
        for name, low, high in (("epsilon", 0.0, math.inf), ("delta", 0.0, 1.0)):
            if name not in values or values[name] is None:
                continue
            value = as_number(values[name])
            if value is None or not low <= value <= high:
                allowed = "a number >= 0 or Infinity" if name == "epsilon" else "a number in [0, 1]"
                return f"{section}.{name} = {_short(values[name])} ({allowed})"
    for cost in COSTS:
        if cost in record and record[cost] is not None:
            value = as_number(record[cost])
            if value is None or not 0 <= value < math.inf:
                return f"{cost} = {_short(record[cost])} (a finite number >= 0)"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such path; RunFileError when there
    is, but it is not a file holding a JSON object."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():
        raise RunFileError(path, "is not a file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError) as err:
        raise RunFileError(path, f"is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise RunFileError(path, "does not hold a JSON object")
    return value


def _config(path: Path, summary: dict[str, Any] | None) -> dict[str, Any]:
    """The run's flattened config: config.json, else a Flower app's run config."""
    config = _read_json(path / CONFIG_FILE)
    if config is None and summary is not None and "run_config" in summary:
        keys = ("app_dir", "num_supernodes", "run_config")
        config = {k: summary[k] for k in keys if k in summary}
    return flatten(config or {})


def _series(records: Sequence[dict[str, Any]]) -> dict[str, Series]:
    points: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for name, value in round_values(record).items():
            points.setdefault(name, []).append((record["round"], value))
    return {
        name: Series(tuple(r for r, _ in pts), tuple(v for _, v in pts))
        for name, pts in points.items()
    }


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one mapping with dotted keys (lists and scalars are values; an
    empty table holds no key)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def metric_names(runs: Sequence[RunSeries]) -> list[str]:
    """Every metric any of ``runs`` recorded, sorted."""
    return sorted({name for run in runs for name in run.series})


def default_metrics(runs: Sequence[RunSeries]) -> list[str]:
    """What ``fedsim plot`` shows without ``--metric``: accuracy- and loss-like metrics,
    epsilon, bytes and seconds per round. An aggregate that repeats a phase's metric
    (``aggregated/train_loss`` next to ``train/train_loss``) is left out."""
    shown = []
    for name in metric_names(runs):
        section, _, leaf = name.rpartition("/")
        if section in REPEATS and any(f"{REPEATS[section]}/{leaf}" in r.series for r in runs):
            continue
        if best_is(name) or name in EPSILONS or name in ("bytes_up", "bytes_down", "seconds"):
            shown.append(name)
    return shown


def check_metrics(runs: Sequence[RunSeries], wanted: Sequence[str], key: str) -> None:
    """Refuse a metric that none of ``runs`` recorded, listing those they did."""
    available = metric_names(runs)
    for name in wanted:
        if name not in available:
            raise ConfigError(key, name, f"a metric these runs recorded: {', '.join(available)}")


def config_differences(runs: Sequence[RunSeries]) -> dict[str, list[Any]]:
    """Every config key whose value is not the same in all ``runs``: key -> each run's value
    (:data:`ABSENT` where a run's config lacks the key), keys sorted."""
    keys = sorted({k for run in runs for k in run.config})
    out = {}
    for key in keys:
        values = [run.config.get(key, ABSENT) for run in runs]
        if not all(_same(values[0], v) for v in values[1:]):
            out[key] = values
    return out


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def format_value(value: Any) -> str:
    """A config value as a legend or table shows it."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value)


def run_names(runs: Sequence[RunSeries]) -> list[str]:
    """The runs' directory names, or the paths as given when two names are the same."""
    names = [run.name for run in runs]
    if len(set(names)) == len(names):
        return names
    return [str(run.path) for run in runs]


def run_labels(runs: Sequence[RunSeries], most: int = 4) -> list[str]:
    """A legend label per run from the config keys that differ between them
    ("noise_multiplier=1.2, seed=3"); the directory names when the configs do not tell the
    runs apart (or a run has none).

    Keys that follow another with the same last name and the same values in every run
    (``data.seed`` after ``seed``) are named once, each key by its shortest unambiguous
    suffix. At most ``most`` keys are named (more when fewer do not tell the runs apart;
    ``...`` says some were left out), top-level keys first and ``engine.*`` keys last;
    ``fedsim compare`` lists them all."""
    differences = config_differences(runs)
    if len(runs) < 2 or not differences or any(not run.config for run in runs):
        return run_names(runs)
    kept: dict[tuple[str, str], str] = {}
    for key in sorted(differences, key=lambda k: (k.count("."), k)):
        group = (key.rsplit(".", 1)[-1], json.dumps(differences[key], sort_keys=True))
        kept.setdefault(group, key)
    keys = sorted(kept.values(), key=lambda k: (k.startswith("engine."), k.count("."), k))
    short = _short_names(keys)
    for count in range(min(most, len(keys)), len(keys) + 1):
        named = keys[:count]
        labels = [
            ", ".join(f"{short[k]}={format_value(differences[k][i])}" for k in named)
            + (", ..." if count < len(keys) else "")
            for i in range(len(runs))
        ]
        if len(set(labels)) == len(labels):
            return labels
    return run_names(runs)


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each dotted key's shortest suffix that no other key in ``keys`` ends with."""
    out = {}
    for key in keys:
        parts = key.split(".")
        out[key] = key  # a key that is another's suffix ("seed", "data.seed") stays whole
        for n in range(1, len(parts)):
            suffix = parts[-n:]
            if not any(o != key and o.split(".")[-n:] == suffix for o in keys):
                out[key] = ".".join(suffix)
                break
    return out
