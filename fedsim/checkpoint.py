"""Checkpoints of a run, so an interrupted run continues exactly where it stopped.

After every ``checkpoint_every`` rounds fedsim writes ``DIR/checkpoint-NNNNNN.ckpt`` (``N`` the
last completed round): the global arrays and the strategy object itself (which carries
everything a strategy keeps between rounds: server-optimiser moments, DP noise generators,
privacy ledgers). Client states live in ``DIR/client_state.sqlite``
(:class:`~fedsim.engine.state.ClientStateStore`); everything else a round depends on is drawn
from ``(seed, round, ...)`` or from the parties' own secrets, so nothing more is needed to replay
the following rounds exactly.

A checkpoint is data, not code, until it is authenticated: the pickled :class:`Checkpoint` is the
payload of a record (:func:`fedsim.runfiles.seal_record`) whose header and payload are MACed with
a key derived from the run's secret root, kept outside the run directory. Nothing is unpickled
before the magic, schema version, lengths and MAC check out. The header binds the checkpoint to
the rest of the run directory: the round, the client-state store it belongs to with the store's
version and a checksum of the states at that version (:class:`StateMark`), and the SHA-256 of
``config.json``.

The file is written atomically (:func:`fedsim.runfiles.write_atomic`); the last :data:`KEEP`
checkpoints are kept, so a damaged newest one can fall back to the one before it.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
from flwr.serverapp.strategy import Strategy

from fedsim.randomness import RunKeys, RunSecret
from fedsim.runfiles import (
    CONFIG_FILE,
    RunFileError,
    fsync_directory,
    open_record,
    seal_record,
    write_atomic,
)

STATE_FILE = "client_state.sqlite"
LEGACY_CHECKPOINT_FILE = "checkpoint.pkl"
"""What fedsim before authenticated checkpoints wrote: a bare pickle, never loaded now."""
KEEP = 2
"""Checkpoints kept in a run directory (the newest and the one before it)."""
KIND = "ckpt"
SCHEMA = 1
_NAME = re.compile(r"^checkpoint-(\d{6,})\.ckpt$")


@dataclass
class Checkpoint:
    """What a run needs to continue after round ``server_round``."""

    server_round: int
    arrays: dict[str, np.ndarray]
    strategy: Strategy
    extra: dict[str, Any]


@dataclass(frozen=True)
class StateMark:
    """The client-state store as a checkpoint saw it.

    Attributes:
        store: the store's identity (32 hex digits, random per run directory).
        version: the round the store was synced at; resuming rolls it back to this.
        checksum: SHA-256 (hex) over the states as of ``version``
            (:meth:`~fedsim.engine.state.ClientStateStore.checksum`).
    """

    store: str
    version: int
    checksum: str


@dataclass(frozen=True)
class CheckpointHeader:
    """The authenticated header of a checkpoint file."""

    server_round: int
    state: StateMark
    config_digest: str
    parties: dict[str, StateMark] = field(default_factory=dict)
    """Further party-state stores (file name -> mark), e.g. DMM members' states."""


def checkpoint_path(directory: str | Path, server_round: int) -> Path:
    """The file of round ``server_round``'s checkpoint."""
    return Path(directory) / f"checkpoint-{server_round:06d}.ckpt"


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The checkpoint files in ``directory``, newest round first."""
    found = [
        (int(match.group(1)), p)
        for p in Path(directory).glob("checkpoint-*.ckpt")
        if (match := _NAME.match(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def round_of(path: Path) -> int:
    """The round a checkpoint file's name announces."""
    match = _NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not a checkpoint file name")
    return int(match.group(1))


def save_checkpoint(
    directory: str | Path,
    checkpoint: Checkpoint,
    *,
    secrets: RunKeys | RunSecret,
    state: StateMark,
    config_digest: str,
    parties: dict[str, StateMark] | None = None,
) -> Path:
    """Write ``checkpoint`` atomically as an authenticated record, then drop all but the
    :data:`KEEP` newest checkpoints. Returns the new file."""
    path = checkpoint_path(directory, checkpoint.server_round)
    header = {
        "server_round": checkpoint.server_round,
        "state": {"store": state.store, "version": state.version, "checksum": state.checksum},
        "config": config_digest,
        "parties": {
            name: {"store": m.store, "version": m.version, "checksum": m.checksum}
            for name, m in sorted((parties or {}).items())
        },
    }
    payload = cloudpickle.dumps(checkpoint, protocol=pickle.HIGHEST_PROTOCOL)
    write_atomic(path, seal_record(KIND, SCHEMA, header, payload, secrets.mac_key()))
    older = [p for p in checkpoint_files(directory) if round_of(p) < checkpoint.server_round]
    for stale in older[KEEP - 1 :]:
        stale.unlink()
    if older[KEEP - 1 :]:
        fsync_directory(directory)
    return path


def read_checkpoint(
    path: str | Path,
    secrets: RunKeys | RunSecret,
    *,
    store_id: str | None = None,
    config_digest: str | None = None,
) -> tuple[CheckpointHeader, Checkpoint]:
    """The checkpoint in ``path``, unpickled only after its record authenticates and its header
    matches the run (``store_id``: the state store's identity; ``config_digest``: SHA-256 of
    config.json; None skips that check).

    Raises :class:`~fedsim.runfiles.RunFileError` naming ``path`` when the file is empty,
    truncated, garbage, of another schema, not authentic under ``secrets``, of another round than
    its file name says, or of another run.
    """
    path = Path(path)
    raw, payload = open_record(path, KIND, SCHEMA, secrets.mac_key(), "a fedsim checkpoint")
    def mark(entry: dict[str, Any]) -> StateMark:
        return StateMark(str(entry["store"]), int(entry["version"]), str(entry["checksum"]))

    try:
        header = CheckpointHeader(
            server_round=int(raw["server_round"]),
            state=mark(raw["state"]),
            config_digest=str(raw["config"]),
            parties={str(k): mark(v) for k, v in raw.get("parties", {}).items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise RunFileError(path, "has an authentic header of the wrong shape") from None
    if _NAME.match(path.name) and round_of(path) != header.server_round:
        raise RunFileError(
            path, f"holds the checkpoint of round {header.server_round}, not of its file name's"
        )
    if any(m.version != header.server_round for m in (header.state, *header.parties.values())):
        raise RunFileError(path, "records client states of another round than its own")
    if store_id is not None and header.state.store != store_id:
        raise RunFileError(
            path, f"belongs to another run: it records another client-state store than {STATE_FILE}"
        )
    if config_digest is not None and header.config_digest != config_digest:
        raise RunFileError(
            path,
            f"belongs to another run: it was written for another {CONFIG_FILE} "
            "(the config or this checkpoint was replaced)",
        )
    checkpoint = pickle.loads(payload)  # authentic, and this run's: its own server wrote it
    if not isinstance(checkpoint, Checkpoint) or checkpoint.server_round != header.server_round:
        raise RunFileError(path, "does not hold the checkpoint its header describes")
    return header, checkpoint
