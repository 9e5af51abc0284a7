"""Checkpoints of a run, so an interrupted run continues exactly where it stopped.

After every ``checkpoint_every`` rounds fedsim writes ``DIR/checkpoint.pkl``:
the last completed round, the global arrays and the strategy object itself
(which carries everything a strategy keeps between rounds: server-optimiser
moments, DP noise generators, privacy ledgers). Client states live in
``DIR/client_state.sqlite``, whose versions are confirmed at the same moment
(:meth:`~fedsim.engine.state.ClientStateStore.checkpoint`). Everything else a
round depends on is drawn from ``(seed, round, ...)`` (cohorts, faults, client
shuffling), so nothing more is needed to replay the following rounds exactly.

The file is written to a temporary name and renamed, so a crash while writing
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
from flwr.serverapp.strategy import Strategy

CHECKPOINT_FILE = "checkpoint.pkl"
STATE_FILE = "client_state.sqlite"
CONFIG_FILE = "config.json"


@dataclass
class Checkpoint:
    """What a run needs to continue after round ``server_round``."""

    server_round: int
    arrays: dict[str, np.ndarray]
    strategy: Strategy
    extra: dict[str, Any]


def save_checkpoint(directory: str | Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` atomically into ``directory``."""
    path = Path(directory) / CHECKPOINT_FILE
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as fh:
        cloudpickle.dump(checkpoint, fh, protocol=pickle.HIGHEST_PROTOCOL)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None if the run never completed a round."""
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        return None
    with path.open("rb") as fh:
        checkpoint = pickle.load(fh)
    if not isinstance(checkpoint, Checkpoint):
        raise ValueError(f"{path} does not hold a fedsim checkpoint")
    return checkpoint
