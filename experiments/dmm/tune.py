"""The DMM study's server learning rates, chosen per (method, epsilon) on validation.

Every method of :mod:`experiments.dmm.run` (non-private included) runs at every server
learning rate of ``--grid`` with the tuning seeds (``--seeds``, default 100 and 101: never the
reported seeds 0..9), each run under its own root and nonce like a study point, stored as
``{setting}/tuning/{method}_eps{e}_lr{lr}_seed{s}.json`` (skipped when already there, so the
tuning resumes). Then :func:`experiments.dmm.table.choose_rates` picks, per (method, epsilon),
the rate with the highest mean final *validation* accuracy (half of the dataset's test rows,
never reported; :func:`experiments.dmm.run.split_rows`) and writes it to
``{setting}/lr_choice.json``, which :mod:`experiments.dmm.run` reads. The rate is applied after
each release (post-processing): the noise multipliers and the epsilons do not depend on it.

    python experiments/dmm/tune.py --source digits [--grid 0.5 1 2 4] [--seeds 100 101]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.dmm.run import (  # noqa: E402
    add_study_arguments,
    finished_point,
    open_study,
    plan,
    run_one,
    write_json,
)
from experiments.dmm.table import CHOICE_FILE, choose_rates  # noqa: E402
from fedsim.engine import Engine, EngineConfig  # noqa: E402
from fedsim.randomness import new_nonce  # noqa: E402

GRID = (0.5, 1.0, 2.0, 4.0)
TUNING_SEEDS = (100, 101)
CRITERION = (
    "chosen: the highest mean final validation accuracy over the tuning seeds (ties: the "
    "smaller rate); validation is half of the dataset's test rows, disjoint from the reported "
    "test half."
)


def tuning_path(directory: Path, method: str, eps: float | None, lr: float, seed: int) -> Path:
    cell = method if eps is None else f"{method}_eps{eps:g}"
    return directory / "tuning" / f"{cell}_lr{lr:g}_seed{seed}.json"


def load_tuning(directory: Path) -> list[dict]:
    """Every stored tuning run of one setting directory."""
    return [json.loads(p.read_text()) for p in sorted((directory / "tuning").glob("*.json"))]


def write_choice(directory: Path, grid, seeds) -> dict:
    """Choose the rates from the stored tuning runs and store the choice."""
    choice = {
        "grid": sorted(grid),
        "seeds": sorted(seeds),
        "criterion": CRITERION,
        "choices": choose_rates(load_tuning(directory)),
    }
    write_json(directory / CHOICE_FILE, choice)
    return choice


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_arguments(parser, list(TUNING_SEEDS))
    parser.add_argument("--grid", type=float, nargs="+", default=list(GRID))
    args = parser.parse_args(argv)
    if set(args.seeds) & set(range(10)):
        parser.error(f"--seeds {args.seeds}: the reported seeds 0..9 never tune")
    if any(not lr > 0 for lr in args.grid):
        parser.error(f"--grid {args.grid}: every server learning rate must be > 0")
    st, directory, _, setup = open_study(parser, args)
    with Engine(EngineConfig(backend="local")) as engine:
        for method, eps, seed in plan(args):
            for lr in args.grid:
                path = tuning_path(directory, method, eps, lr, seed)
                if finished_point(path):
                    continue
                row = run_one(engine, setup, method, eps, seed, st, new_nonce(), lr=lr)
                write_json(path, row)
                keys = ("method", "target_epsilon", "server_learning_rate", "seed", "seconds")
                print(json.dumps({k: row[k] for k in keys}), flush=True)
    choice = write_choice(directory, args.grid, args.seeds)
    print(json.dumps(choice["choices"], indent=1), flush=True)
    return choice


if __name__ == "__main__":
    main()
