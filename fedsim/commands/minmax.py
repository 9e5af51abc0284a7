"""``fedsim minmax CONFIG.toml``: QODA (Nguyen et al., ICML 2025, Alg. 1) on a min-max game.

The config has two tables, checked before anything runs::

    [game]                  # the game split over workers (fedsim.workloads.minmax.LinearGame)
    kind = "linear"         # min_x max_y mu/2|x|^2 + x^T A y + b^T x - c^T y - mu/2|y|^2
    x_dim = 6
    y_dim = 6
    workers = 4
    mu = 0.0                # >= 0; > 0 is strongly monotone
    spread = 0.5            # workers' matrices scattered around the shared A
    seed = 1                # draws the game

    [qoda]
    steps = 1000            # exchanges (one upload per worker each)
    lr = 2.0                # gamma_t = lr / sqrt(1 + sum ||V_{s+1/2} - V_{s-1/2}||^2)
    optimistic = true       # false: plain dual averaging

    [qoda.compression]      # omit for exact float32 uploads
    bits = 4                # fedsim.workloads.compression.Quantization
    bits_by_type = {bias = 4}
    levels = "uniform"
    seed = 0                # the quantisation draws

Every worker's operator block is a vector, so its layer type is ``bias``. The run
starts from ``z = 0`` and writes ``steps.jsonl`` (step 0 is the start) and
``summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedsim.config import ConfigError, from_mapping, load_toml, positive_int, require, to_mapping
from fedsim.workloads.compression import Quantization
from fedsim.workloads.minmax import LinearGame, Point, qoda


@dataclass(frozen=True, kw_only=True)
class GameConfig:
    """``[game]``: a :class:`LinearGame` drawn by ``LinearGame.random`` from ``seed``."""

    kind: Literal["linear"] = "linear"
    x_dim: int = 6
    y_dim: int = 6
    workers: int = 4
    mu: float = 0.0
    spread: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("x_dim", "y_dim", "workers"):
            positive_int(getattr(self, key), f"game.{key}")
        require(self.mu >= 0, "game.mu", self.mu, "a number >= 0")
        require(self.spread >= 0, "game.spread", self.spread, "a number >= 0")

    def build(self) -> LinearGame:
        rng = np.random.default_rng(self.seed)
        return LinearGame.random(
            rng, self.x_dim, self.y_dim, self.workers, mu=self.mu, spread=self.spread
        )


@dataclass(frozen=True, kw_only=True)
class QODAConfig:
    """``[qoda]``: the arguments of :func:`fedsim.workloads.minmax.qoda`."""

    steps: int = 1000
    lr: float = 1.0
    optimistic: bool = True
    compression: Quantization | None = None

    def __post_init__(self) -> None:
        positive_int(self.steps, "qoda.steps")
        require(self.lr > 0, "qoda.lr", self.lr, "a number > 0")
        if self.compression is not None:
            require(
                self.compression.levels == "uniform",
                "qoda.compression.levels",
                self.compression.levels,
                "'uniform' (QODA's workers quantise with uniform levels)",
            )

    def rng(self) -> np.random.Generator:
        """The quantisation draws' generator (seeded by ``compression.seed``, else 0)."""
        return np.random.default_rng(0 if self.compression is None else self.compression.seed)


@dataclass(frozen=True)
class MinmaxConfig:
    """A whole ``fedsim minmax`` config file."""

    game: GameConfig
    qoda: QODAConfig

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> MinmaxConfig:
        """Check every key of ``mapping`` (errors name ``game.<key>`` / ``qoda.<key>``)."""
        for key, value in mapping.items():
            require(key in ("game", "qoda"), key, value, "a known table; known are game, qoda")
        for key in ("game", "qoda"):
            value = mapping.get(key, {})
            require(isinstance(value, Mapping), key, value, "a table")
        game = from_mapping(GameConfig, mapping.get("game", {}), "game")
        table = dict(mapping.get("qoda", {}))
        compression = table.pop("compression", None)
        qoda_config = from_mapping(QODAConfig, table, "qoda")
        if compression is not None:
            require(isinstance(compression, Mapping), "qoda.compression", compression, "a table")
            try:
                quantization = from_mapping(Quantization, compression, "qoda.compression")
            except ConfigError as err:  # Quantization names its keys client.compression.*
                key = err.key.replace("client.compression", "qoda.compression", 1)
                raise ConfigError(key, err.value, err.allowed) from err
            qoda_config = dataclasses.replace(qoda_config, compression=quantization)
        return cls(game, qoda_config)

    @classmethod
    def load(cls, path: str | Path) -> MinmaxConfig:
        return cls.from_mapping(load_toml(path))


def distance(point: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray]) -> float:
    """Euclidean distance between two points with the same blocks."""
    return float(np.sqrt(sum(np.sum((point[k] - target[k]) ** 2) for k in target)))


def operator_norm(game: LinearGame, z: Mapping[str, np.ndarray]) -> float:
    """``||A(z)||`` of the game's (mean) operator, exact."""
    values = [game.operator(k)(z) for k in range(game.workers)]
    return float(
        np.sqrt(sum(np.sum(np.mean([v[n] for v in values], axis=0) ** 2) for n in values[0]))
    )


def run_minmax(config: MinmaxConfig, out: str | Path) -> dict[str, Any]:
    """Run QODA on the configured game; write ``out/steps.jsonl`` and ``out/summary.json``.

    Each line of ``steps.jsonl``: ``step``, ``distance`` (``||Z_{t+1} - z*||``),
    ``relative_distance`` (over the start's), ``operator_norm`` (``||A(Z_{t+1})||``),
    ``bits_per_worker`` and ``bits_total`` (cumulative, on the wire).
    """
    out = Path(out)
    if (out / "steps.jsonl").exists() or (out / "summary.json").exists():
        raise ConfigError(
            "--out", str(out), "a directory without a previous run (its results are kept)"
        )
    out.mkdir(parents=True, exist_ok=True)
    game = config.game.build()
    star = game.equilibrium()
    start: Point = {"x": np.zeros(config.game.x_dim), "y": np.zeros(config.game.y_dim)}
    initial = distance(start, star)
    workers = game.workers
    started = time.perf_counter()
    with (out / "steps.jsonl").open("w") as steps_file:

        def record(step: int, z: Point, bits: int) -> None:
            gap = distance(z, star)
            row = {
                "step": step,
                "distance": gap,
                "relative_distance": gap / initial if initial > 0 else 0.0,
                "operator_norm": operator_norm(game, z),
                "bits_per_worker": bits,
                "bits_total": bits * workers,
            }
            steps_file.write(json.dumps(row) + "\n")

        record(0, start, 0)
        result = qoda(
            [game.operator(k) for k in range(workers)],
            start,
            config.qoda.steps,
            lr=config.qoda.lr,
            quantization=config.qoda.compression,
            rng=config.qoda.rng(),
            optimistic=config.qoda.optimistic,
            on_step=record,
        )
    summary = {
        "config": to_mapping(config),
        "steps": result.steps,
        "initial_distance": initial,
        "last_distance": distance(result.last, star),
        "average_distance": distance(result.average, star),
        "last_operator_norm": operator_norm(game, result.last),
        "average_operator_norm": operator_norm(game, result.average),
        "bits_per_worker": result.bits_per_worker,
        "bits_total": result.bits_per_worker * workers,
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``minmax`` subcommand to ``fedsim``'s subparsers."""
    minmax = subparsers.add_parser("minmax", help="QODA on a min-max game from a TOML config")
    minmax.add_argument("config", help="TOML file with [game] and [qoda] tables")
    minmax.add_argument(
        "--out", default=None, help="results directory (default: results/minmax/<config stem>)"
    )
    return minmax


def run(args: argparse.Namespace) -> int:
    """Run ``fedsim minmax``; errors print ``fedsim: error: ...`` and return 2."""
    try:
        config = MinmaxConfig.load(args.config)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("results/minmax") / Path(args.config).stem
    try:
        summary = run_minmax(config, out)
    except ConfigError as err:
        print(f"fedsim: error: {err}", file=sys.stderr)
        return 2
    compression = config.qoda.compression
    uploads = "float32" if compression is None else f"{compression.bits_of('bias')}-bit"
    print(
        f"fedsim: {summary['steps']} QODA steps ({uploads} uploads, {config.game.workers} "
        f"workers): distance to z* {summary['initial_distance']:.4g} -> "
        f"{summary['last_distance']:.4g} (last), {summary['average_distance']:.4g} (average); "
        f"{summary['bits_per_worker']} bits per worker; results in {out / 'steps.jsonl'} "
        f"and {out / 'summary.json'}"
    )
    return 0
