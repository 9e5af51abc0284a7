"""A run directory: how a new run lays it out, how it checkpoints, how ``--resume`` reopens it.

What a run directory holds (``fedsim run --out DIR``)::

    run.json                   the root's kind and fingerprint, the run nonce, config.json's MAC
    config.json                the run's config, as validated (written once, atomically)
    rounds.jsonl, summary.json results (fedsim.frontend.results)
    client_state.sqlite        the clients' states, each sealed under a key of the run's state
                               store (:func:`store_root`), never a client's own secret
    checkpoint-NNNNNN.ckpt     the last two checkpoints, authenticated records
    model.npz                  the final global arrays
    tensorboard/               TensorBoard events of rounds.jsonl ([output] tensorboard = true)

None of it is trusted on ``--resume``. The secret root the run started with (kept outside the
directory) authenticates the checkpoints and the state database's identity and opens the
clients' states; the files are cross-checked before a round runs:

* the state database is bound to ``config.json`` (its SHA-256, MACed in the database);
* a checkpoint's authenticated header names the state store, the round it was synced at and a
  checksum of its states at that round, and ``config.json``'s SHA-256.

``--resume`` continues from the newest checkpoint. If that file is damaged or foreign it says
so and falls back to the one before it, but only if the state store can be rolled back to it
exactly (its checksum matches); in every other case it refuses, naming the file. So a resumed
run either writes what the uninterrupted run would have written, or stops before doing anything.

Order of writes at a checkpoint (so that a kill or a power loss at any point leaves a resumable
directory): the state database is synced to disk first (:meth:`ClientStateStore.mark`), then the
checkpoint is written atomically, then the store drops versions that neither of the last two
checkpoints needs (:meth:`ClientStateStore.checkpoint`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from fedsim.checkpoint import (
    CONFIG_FILE,
    LEGACY_CHECKPOINT_FILE,
    STATE_FILE,
    Checkpoint,
    CheckpointHeader,
    checkpoint_files,
    read_checkpoint,
    save_checkpoint,
)
from fedsim.config import ConfigError
from fedsim.engine.state import ClientStateStore
from fedsim.randomness import RunKeys, RunSecret
from fedsim.runfiles import RunFileError, digest, fsync_directory, write_atomic

log = logging.getLogger(__name__)


def run_keys(secrets: RunKeys | RunSecret) -> RunKeys:
    """The driver's keys of a run (:class:`~fedsim.randomness.RunKeys`); a root given here is
    reduced to them at once (a caller that holds the root keeps it; the directory does not)."""
    if isinstance(secrets, RunKeys):
        return secrets
    if not isinstance(secrets, RunSecret):
        raise ValueError(f"secrets is a {type(secrets).__name__}; allowed: RunKeys or RunSecret")
    return RunKeys.of(secrets)


def store_root(secrets: RunKeys | RunSecret) -> RunSecret:
    """The root the driver's client-state store seals under: derived from the run's root for
    that use alone, so that the store, which the engine grid holds, holds no client's own
    secret (those stay with the workers)."""
    return run_keys(secrets).client_states
DAMAGED_SUFFIX = ".damaged"
"""A checkpoint that failed its checks on resume is renamed aside with this suffix."""


@dataclass
class RunDirectory:
    """The open files of one run: its state store and what checkpoints bind to.

    Attributes:
        out: the directory.
        store: the clients' states (``client_state.sqlite``).
        secrets: the run's keys (:class:`~fedsim.randomness.RunKeys`: the file key that
            authenticates the checkpoints and the state stores' sub-roots), never its root.
        config_digest: SHA-256 (hex) of ``config.json``.
    """

    out: Path
    store: ClientStateStore
    secrets: RunKeys
    config_digest: str
    parties: dict[str, ClientStateStore] = field(default_factory=dict)
    resumed: CheckpointHeader | None = None
    resuming: bool = False

    @classmethod
    def create(
        cls, out: str | Path, config_text: str, secrets: RunKeys | RunSecret, memory_budget: int
    ) -> RunDirectory:
        """Lay out a new run in ``out``: the state database, then ``config.json``.

        A directory holding what a run refused before its first round left (no results, no
        checkpoint: its ``config.json`` and fedsim state databases, which hold nothing yet) is
        taken over; anything else already there is refused."""
        out = Path(out)
        rounds = out / "rounds.jsonl"
        wrote_rounds = rounds.is_file() and rounds.stat().st_size > 0
        results = wrote_rounds or (out / "summary.json").exists()
        if not results and not checkpoint_files(out):
            _clear_unstarted(out)
        taken = [p for p in (out / STATE_FILE, out / CONFIG_FILE) if p.exists()]
        taken += checkpoint_files(out)
        if taken:
            raise ConfigError(
                "--out", str(out), f"a new or empty directory (this one holds {taken[0].name})"
            )
        data = config_text.encode()
        store = ClientStateStore(
            out / STATE_FILE, memory_budget, store_root(secrets), run_tag=digest(data)
        )
        write_atomic(out / CONFIG_FILE, data)
        return cls(out, store, run_keys(secrets), digest(data))

    @classmethod
    def reopen(
        cls, out: str | Path, secrets: RunKeys | RunSecret, memory_budget: int
    ) -> tuple[RunDirectory, Checkpoint | None]:
        """Open the run in ``out`` for ``--resume``: the checkpoint to continue from (None: from
        the start) with the store rolled back to it. Raises
        :class:`~fedsim.runfiles.RunFileError` naming the file when the directory cannot be
        resumed exactly."""
        out = Path(out)
        config_digest = _config_digest(out)
        legacy = out / LEGACY_CHECKPOINT_FILE
        if legacy.exists():
            raise RunFileError(
                legacy,
                "is an unauthenticated pickle (an earlier fedsim's checkpoint format); it is "
                "never loaded, since loading it could run code. Run again from the start",
            )
        store = ClientStateStore(
            out / STATE_FILE,
            memory_budget,
            store_root(secrets),
            run_tag=config_digest,
            run_tag_source=str(out / CONFIG_FILE),
            must_exist=True,
        )
        run_dir = cls(out, store, run_keys(secrets), config_digest, resuming=True)
        try:
            return run_dir, run_dir._resume_point()
        except BaseException:
            store.close()
            raise

    @staticmethod
    def states(out: str | Path, secrets: RunKeys | RunSecret) -> ClientStateStore:
        """The client states of the run in ``out`` (as its last round left them), to read."""
        out = Path(out)
        return ClientStateStore(
            out / STATE_FILE,
            secrets=store_root(secrets),
            run_tag=_config_digest(out),
            run_tag_source=str(out / CONFIG_FILE),
            must_exist=True,
        )

    def _read(self, path: Path) -> tuple[CheckpointHeader, Checkpoint]:
        return read_checkpoint(
            path, self.secrets, store_id=self.store.store_id, config_digest=self.config_digest
        )

    def _resume_point(self) -> Checkpoint | None:
        for partial in self.out.glob("checkpoint-*.ckpt.tmp"):  # never renamed into place
            partial.unlink()
        files = checkpoint_files(self.out)
        if not files:
            self.store.rollback(0)
            return None
        newest = files[0]
        try:
            header, checkpoint = self._read(newest)
        except RunFileError as err:
            header, checkpoint = self._fall_back(err, files[1:])
        else:
            self.store.verify(header.state, newest)
        self.store.rollback(header.server_round)
        self.resumed = header
        return checkpoint

    def _fall_back(
        self, newest: RunFileError, older: list[Path]
    ) -> tuple[CheckpointHeader, Checkpoint]:
        """The checkpoint before a damaged newest one, if the store can return to it exactly."""
        if not older:
            raise RunFileError(
                newest.path, f"{newest.problem}; there is no earlier checkpoint to resume from"
            )
        previous = older[0]
        log.warning("%s; trying the checkpoint before it, %s", newest, previous.name)
        try:
            header, checkpoint = self._read(previous)
        except RunFileError as err:
            raise RunFileError(
                newest.path,
                f"{newest.problem}; and the checkpoint before it, {previous.name}, {err.problem}",
            ) from None
        try:
            self.store.verify(header.state, previous)
        except RunFileError as err:
            raise RunFileError(
                err.path,
                f"{err.problem}; the newest checkpoint {newest.path.name} {newest.problem}, so "
                "the run cannot resume exactly",
            ) from None
        self._set_aside(newest.path)
        return header, checkpoint

    def _set_aside(self, path: Path) -> None:
        """Rename a refused checkpoint out of the way (kept for inspection, never read)."""
        path.rename(path.with_name(path.name + DAMAGED_SUFFIX))
        fsync_directory(self.out)

    def party_store(self, name: str) -> ClientStateStore:
        """Another store of parties' sealed states in the run directory (``name``: its file,
        e.g. DMM committee members' states), bound to ``config.json`` like the client states
        and synced, checkpointed and cross-checked with them. On ``--resume`` it must be the
        store the resumed checkpoint recorded, with exactly the states it recorded; it is
        rolled back to that checkpoint's round."""
        if name in self.parties:
            return self.parties[name]
        path = self.out / name
        recorded = None if self.resumed is None else self.resumed.parties.get(name)
        if self.resumed is not None and recorded is None and path.exists():
            raise RunFileError(
                path,
                "is not recorded by the checkpoint being resumed from (a stale or foreign file)",
            )
        store = ClientStateStore(
            path,
            0,
            self.secrets.party_states,  # a sub-root: the parties seal their own states inside
            run_tag=self.config_digest,
            run_tag_source=str(self.out / CONFIG_FILE),
            must_exist=recorded is not None,
        )
        try:
            if recorded is not None:
                checkpoint = checkpoint_files(self.out)[0]
                if recorded.store != store.store_id:
                    raise RunFileError(
                        path, f"belongs to another run than {checkpoint} (its identity differs)"
                    )
                store.verify(recorded, checkpoint)
                store.rollback(recorded.version)
            elif self.resuming:  # killed before its first checkpoint: back to the start
                store.rollback(0)
        except BaseException:
            store.close()
            raise
        self.parties[name] = store
        return store

    def save(self, checkpoint: Checkpoint) -> Path:
        """Checkpoint the round: sync the states, write the checkpoint, prune the states."""
        version = checkpoint.server_round
        mark = self.store.mark(version)
        parties = {name: store.mark(version) for name, store in self.parties.items()}
        path = save_checkpoint(
            self.out,
            checkpoint,
            secrets=self.secrets,
            state=mark,
            config_digest=self.config_digest,
            parties=parties,
        )
        for store in (self.store, *self.parties.values()):
            store.checkpoint(version)
        return path

    def close(self) -> None:
        for store in (self.store, *self.parties.values()):
            store.close()


def _clear_unstarted(out: Path) -> None:
    """Remove the files of a run that never ran a round from ``out``: fedsim state databases
    (recognised by their format) and, when one was there, the ``config.json`` beside it."""
    stores = [p for p in out.glob("*.sqlite") if ClientStateStore.is_state_file(p)]
    if not stores:
        return
    for store in stores:
        sidecars = (store.with_name(store.name + suffix) for suffix in ("-wal", "-shm"))
        for path in (store, *sidecars):
            path.unlink(missing_ok=True)
    (out / CONFIG_FILE).unlink(missing_ok=True)
    fsync_directory(out)


def _config_digest(out: Path) -> str:
    """SHA-256 (hex) of the run's config.json, what its other files are bound to."""
    path = out / CONFIG_FILE
    if not path.is_file():
        raise RunFileError(path, "is missing: this is not a fedsim run directory")
    return digest(path.read_bytes())
