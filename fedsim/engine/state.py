"""Per-client persistent state: each client's Flower ``context.state``.

States are kept as pickled bytes, keyed by node id. A client's state travels
with its batch to whichever worker runs it and comes back with the result, so
it follows the client across workers, rounds and machines; clients without
state cost nothing.

:class:`ClientStateStore` holds the states in memory up to ``memory_budget``
bytes; past that (or from the start, when given a ``path``) it writes them to a
SQLite file and keeps only the most recently used ones in memory, so memory
stays flat however many clients have state. Writes to the file are held back within a
round: the round's newest state per client goes to the file in one transaction when the round
changes, before anything reads the file, before a cached state is evicted, and at
:meth:`close`, so a state rewritten between the exchanges of one round (a protocol's stage
state) costs one row, not one per exchange; the file's rows at every round boundary are the
same as with every write applied at once.

**Custody.** A state is the client's own: in the file each one is sealed with
that client's secret (``secrets.client(partition_id).seal``, ChaCha20-Poly1305,
label = store identity, node id and round), so whoever holds only the run
directory opens nothing, and a crafted or swapped blob fails authentication
before anything is unpickled. The file's identity (a random store id, the run
tag it belongs to) is MACed with the run's file key; a file that is empty, not a
SQLite database, damaged, of another run or of another secret root is refused
with an error naming it.

**Versions.** Every write carries the round it happened in. :meth:`mark` syncs
the file to disk and returns what a checkpoint records of it (store id, round,
checksum of the states as of that round); :meth:`checkpoint` then drops versions
no longer needed to restore that checkpoint or the one before it, so
:meth:`rollback` can return the store exactly to either of the last two
checkpoints (a resumed run continues from their states).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sqlite3
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fedsim.checkpoint import StateMark
from fedsim.config import require
from fedsim.engine.client_registry import NODE_ID_OFFSET
from fedsim.randomness import RunSecret
from fedsim.runfiles import RunFileError, fsync_directory

DEFAULT_BUDGET = 256 * 1024 * 1024
FORMAT = b"fedsim-client-states/2"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    node_id INTEGER NOT NULL,
    version INTEGER NOT NULL,
    digest BLOB,
    blob BLOB,
    PRIMARY KEY (node_id, version)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID;
"""
_NO_DIGEST = bytes(32)  # a cleared state (NULL blob) in checksums


class ClientStateStore:
    """Pickled ``context.state`` per node id: memory up to a budget, then SQLite, sealed.

    Args:
        path: SQLite file for the states (created if missing; an existing one must be this
            run's). None keeps them in memory until the budget is exceeded, then spills to a
            temporary file.
        memory_budget: bytes of states kept in memory (least recently used go first).
        secrets: the run's secret root: client ``k``'s state is sealed with
            ``secrets.client(k)`` and the file's identity is MACed with
            ``secrets.mac_key()``. None: a fresh root (the file opens only in this process).
        run_tag: what the file belongs to (fedsim: the SHA-256 of the run's config.json); an
            existing file with another tag is refused.
        run_tag_source: what ``run_tag`` is taken from, for that error (fedsim: the path of
            config.json).
        must_exist: refuse a missing ``path`` instead of creating it (resuming a run).
    """

    def __init__(
        self,
        path: str | Path | None = None,
        memory_budget: int = DEFAULT_BUDGET,
        secrets: RunSecret | None = None,
        *,
        run_tag: str = "",
        run_tag_source: str = "its run tag",
        must_exist: bool = False,
    ) -> None:
        require(memory_budget >= 0, "memory_budget", memory_budget, "a number of bytes >= 0")
        self.memory_budget = memory_budget
        self._secrets = secrets if secrets is not None else RunSecret.fresh()
        self.run_tag, self.run_tag_source = run_tag, run_tag_source
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._db: sqlite3.Connection | None = None
        self.path: Path | None = None
        self.store_id = ""
        self._written: set[int] = set()  # nodes written since the last checkpoint
        self._pending: dict[int, bytes | None] = {}  # held-back writes of one round
        self._pending_version = 0
        self._since_previous: set[int] = set()  # nodes written between the last two
        self._last_checkpoint = -1
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if path is not None:
            self._open(Path(path), must_exist)

    # -- the file ----------------------------------------------------------------
    def _open(self, path: Path, must_exist: bool) -> None:
        self.path = path
        created = not path.exists()
        if created and must_exist:
            raise RunFileError(
                path,
                "is missing: the run's client states are gone (resuming without them would "
                "silently restart every client's state)",
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._db_errors("is not a fedsim client-state database"):
                self._db = sqlite3.connect(path, isolation_level=None)
                if not created:  # read before anything is written to it
                    self._check_identity()
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                if created:
                    self._create()
        except RunFileError:
            self.close()
            raise

    def _identity_tag(self, store_id: bytes, run_tag: bytes) -> bytes:
        message = b"\x00".join((FORMAT, store_id, run_tag))
        return hmac.new(self._secrets.mac_key(), message, hashlib.sha256).digest()

    def _create(self) -> None:
        assert self._db is not None
        store_id = os.urandom(16)
        run_tag = self.run_tag.encode()
        with self._db:
            self._db.execute("BEGIN")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            self._db.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("format", FORMAT),
                    ("store", store_id),
                    ("run", run_tag),
                    ("tag", self._identity_tag(store_id, run_tag)),
                ],
            )
        self.store_id = store_id.hex()
        self._sync()

    def _check_identity(self) -> None:
        assert self._db is not None
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master")}
        if not {"states", "meta"} <= tables:
            raise RunFileError(
                self.path,
                "holds no fedsim client states (it is empty or was not written by fedsim)",
            )
        meta = {
            key: value if isinstance(value, bytes) else b""
            for key, value in self._db.execute("SELECT key, value FROM meta").fetchall()
        }
        if meta.get("format") != FORMAT:
            raise RunFileError(self.path, f"is not in fedsim's client-state format {FORMAT!r}")
        store_id, run_tag = meta.get("store", b""), meta.get("run", b"")
        if not hmac.compare_digest(meta.get("tag", b""), self._identity_tag(store_id, run_tag)):
            raise RunFileError(
                self.path,
                "fails authentication under the run's secret root: it belongs to a run with "
                "another root, or its identity was altered; nothing in it was loaded",
            )
        if run_tag != self.run_tag.encode():
            raise RunFileError(
                self.path,
                f"belongs to another run than {self.run_tag_source}: either this database or "
                f"{self.run_tag_source} was replaced or edited",
            )
        problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise RunFileError(self.path, f"is damaged: {'; '.join(map(str, problems[:3]))}")
        self.store_id = store_id.hex()

    @contextmanager
    def _db_errors(self, what: str = "is damaged") -> Iterator[None]:
        """Turn SQLite's errors about the file into an error that names it."""
        try:
            yield
        except sqlite3.DatabaseError as err:
            raise RunFileError(self.path, f"{what} ({err})") from None

    def _sync(self) -> None:
        """Everything committed so far is in the database file, on disk."""
        assert self._db is not None
        busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise RunFileError(self.path, "could not be synced: another connection holds it")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_directory(self.path.parent)

    def _spill(self, version: int) -> None:
        """Move everything to a temporary file (the memory budget ran out)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="fedsim-state-")
        cached = list(self._cache.items())
        self._open(Path(self._tmp.name) / "state.sqlite", must_exist=False)
        self._write(cached, version)

    @property
    def spilled(self) -> bool:
        """True when the states live in a file."""
        return self._db is not None

    # -- sealing -------------------------------------------------------------------
    def _label(self, node: int, version: int) -> bytes:
        return b"fedsim-client-state\x00" + bytes.fromhex(self.store_id) + struct.pack(
            ">qq", node, version
        )

    def _seal(self, node: int, version: int, blob: bytes) -> bytes:
        party = self._secrets.client(node - NODE_ID_OFFSET)
        return party.seal(blob, self._label(node, version))

    def _unseal(self, node: int, version: int, sealed: bytes) -> bytes:
        party = self._secrets.client(node - NODE_ID_OFFSET)
        try:
            return party.open(bytes(sealed), self._label(node, version))
        except ValueError:
            raise RunFileError(
                self.path,
                f"the state of client {node - NODE_ID_OFFSET} (round {version}) fails "
                "authentication: it was altered, or sealed by another run or secret root; "
                "it was not loaded",
            ) from None

    def _flush(self) -> None:
        """Write the held-back states of the current round to the file."""
        if self._pending:
            items, self._pending = list(self._pending.items()), {}
            self._write(items, self._pending_version)

    def _write(self, items: list[tuple[int, bytes | None]], version: int) -> None:
        assert self._db is not None
        rows = []
        for node, blob in items:
            if blob is None:
                rows.append((node, version, None, None))
            else:
                sealed = self._seal(node, version, blob)
                rows.append((node, version, hashlib.sha256(sealed).digest(), sealed))
        with self._db_errors(), self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO states (node_id, version, digest, blob)"
                " VALUES (?, ?, ?, ?)",
                rows,
            )

    # -- the memory cache ------------------------------------------------------------
    def _remember(self, node: int, blob: bytes) -> None:
        old = self._cache.pop(node, None)
        if old is not None:
            self._cached_bytes -= len(old)
        self._cache[node] = blob
        self._cached_bytes += len(blob)

    def _forget(self, node: int) -> None:
        old = self._cache.pop(node, None)
        if old is not None:
            self._cached_bytes -= len(old)

    def _trim(self) -> None:
        if self._pending and self._cached_bytes > self.memory_budget:
            self._flush()  # a held-back state leaves memory only once it is in the file
        while self._cached_bytes > self.memory_budget and self._cache:
            _, blob = self._cache.popitem(last=False)
            self._cached_bytes -= len(blob)

    # -- the interface the grid uses ---------------------------------------------
    def get_many(self, node_ids: Iterable[int]) -> dict[int, bytes]:
        """States of those ``node_ids`` that have one."""
        found: dict[int, bytes] = {}
        missing: list[int] = []
        for node in node_ids:
            blob = self._cache.get(node)
            if blob is not None:
                self._cache.move_to_end(node)
                found[node] = blob
            elif self._db is not None and node not in self._pending:  # pending: cleared
                missing.append(node)
        if missing and self._db is not None:
            for start in range(0, len(missing), 500):
                chunk = missing[start : start + 500]
                marks = ",".join("?" * len(chunk))
                with self._db_errors():
                    rows = self._db.execute(
                        f"SELECT node_id, version, blob FROM states s WHERE node_id IN ({marks})"
                        " AND version = (SELECT MAX(version) FROM states t"
                        " WHERE t.node_id = s.node_id)",
                        chunk,
                    ).fetchall()
                for node, version, sealed in rows:
                    if sealed is not None:
                        found[node] = self._unseal(node, version, sealed)
                        self._remember(node, found[node])
            self._trim()
        return found

    def put_many(self, states: dict[int, bytes | None], version: int = 0) -> None:
        """Store new states (None or empty bytes: the client has no state any more)."""
        if not states:
            return
        items = [(node, blob or None) for node, blob in states.items()]
        for node, blob in items:
            if blob is None:
                self._forget(node)
            else:
                self._remember(node, blob)
        if self._db is None and self._cached_bytes > self.memory_budget:
            self._spill(version)
        elif self._db is not None:
            if self._pending and version != self._pending_version:
                self._flush()
            self._pending.update(items)
            self._pending_version = version
            self._written.update(node for node, _ in items)
        self._trim()

    def __len__(self) -> int:
        if self._db is None:
            return len(self._cache)
        with self._db_errors():
            self._flush()
            row = self._db.execute(
                "SELECT COUNT(*) FROM states s WHERE blob IS NOT NULL AND version ="
                " (SELECT MAX(version) FROM states t WHERE t.node_id = s.node_id)"
            ).fetchone()
        return int(row[0])

    # -- checkpoints ---------------------------------------------------------------
    def _require_file(self, action: str) -> sqlite3.Connection:
        """The file, with every held-back write in it."""
        if self._db is None:
            raise RuntimeError(f"only a file-backed store can be {action}")
        with self._db_errors():
            self._flush()
        return self._db

    def checksum(self, version: int, *, verify: bool = False) -> str:
        """SHA-256 (hex) over every client's newest state up to round ``version``
        (node id, round, SHA-256 of the sealed bytes), in node order. ``verify`` hashes the
        stored bytes themselves instead of the digests recorded when they were written."""
        db = self._require_file("checksummed")
        total = hashlib.sha256(
            b"fedsim-client-states/checksum\x00"
            + bytes.fromhex(self.store_id)
            + struct.pack(">q", version)
        )
        column = "blob" if verify else "digest"
        with self._db_errors():
            # SQLite takes bare columns from the row with the MAX(): each node's newest state
            rows = db.execute(
                f"SELECT node_id, MAX(version), {column} FROM states WHERE version <= ?"
                " GROUP BY node_id ORDER BY node_id",
                (version,),
            )
            for node, at, value in rows:
                if value is None:
                    value = _NO_DIGEST
                elif verify:
                    value = hashlib.sha256(value).digest()
                total.update(struct.pack(">qq", node, at) + bytes(value))
        return total.hexdigest()

    def mark(self, version: int) -> StateMark:
        """Sync the file to disk and describe the states as of round ``version`` (what a
        checkpoint of that round records, written only after this returns)."""
        self._require_file("checkpointed")
        with self._db_errors():
            self._sync()
        return StateMark(self.store_id, version, self.checksum(version))

    def verify(self, mark: StateMark, checkpoint: str | Path) -> None:
        """Refuse, naming the file, unless the states as of ``mark.version`` are exactly the
        ones the checkpoint file ``checkpoint`` recorded."""
        if mark.store != self.store_id:
            raise RunFileError(
                self.path,
                f"belongs to another run than {checkpoint} (its store identity differs)",
            )
        if not hmac.compare_digest(self.checksum(mark.version, verify=True), mark.checksum):
            raise RunFileError(
                self.path,
                f"does not hold the client states {checkpoint} recorded for round "
                f"{mark.version}: states were altered, lost or replaced",
            )

    def checkpoint(self, version: int) -> None:
        """The checkpoint of round ``version`` is on disk: keep, for every client, only its
        newest version up to ``version`` and its newest up to the previous checkpoint (so
        :meth:`rollback` can restore either)."""
        db = self._require_file("checkpointed")
        nodes = list(self._written | self._since_previous)
        with self._db_errors(), db:
            db.execute("BEGIN")
            for start in range(0, len(nodes), 500):
                chunk = nodes[start : start + 500]
                marks = ",".join("?" * len(chunk))
                db.execute(
                    f"DELETE FROM states WHERE node_id IN ({marks}) AND version <= ?"
                    " AND version != COALESCE((SELECT MAX(t.version) FROM states t"
                    "  WHERE t.node_id = states.node_id AND t.version <= ?), -1)"
                    " AND version != (SELECT MAX(t.version) FROM states t"
                    "  WHERE t.node_id = states.node_id AND t.version <= ?)",
                    [*chunk, version, self._last_checkpoint, version],
                )
        self._since_previous, self._written = self._written, set()
        self._last_checkpoint = version

    def rollback(self, version: int) -> None:
        """Forget every write made after round ``version`` (the checkpoint resumed from)."""
        db = self._require_file("rolled back")
        with self._db_errors(), db:
            db.execute("BEGIN")
            db.execute("DELETE FROM states WHERE version > ?", (version,))
        with self._db_errors():
            several = db.execute(
                "SELECT node_id FROM states GROUP BY node_id HAVING COUNT(*) > 1"
            ).fetchall()
        self._cache.clear()
        self._cached_bytes = 0
        self._written.clear()
        self._since_previous = {node for (node,) in several}
        self._last_checkpoint = version

    def close(self) -> None:
        if self._db is not None:
            try:
                with self._db_errors():
                    self._flush()
            finally:
                self._db.close()
                self._db = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @staticmethod
    def is_state_file(path: str | Path) -> bool:
        """Whether ``path`` is a fedsim state database (by its recorded format; read only)."""
        try:
            db = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
            try:
                row = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return False
        return row is not None and row[0] == FORMAT
