"""Per-client persistent state: each client's Flower ``context.state``.

States are kept as pickled bytes, keyed by node id. A client's state travels
with its batch to whichever worker runs it and comes back with the result, so
it follows the client across workers, rounds and machines; clients without
state cost nothing.

:class:`ClientStateStore` holds the states in memory up to ``memory_budget``
bytes; past that (or from the start, when given a ``path``) it writes them to a
SQLite file and keeps only the most recently used ones in memory, so memory
stays flat however many clients have state. Every write carries the round it
happened in; with a file, older versions are kept until :meth:`checkpoint`
confirms a round, so :meth:`rollback` can later return the store to exactly
that round (a resumed run continues from the states of its last checkpoint).
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from fedsim.config import require

DEFAULT_BUDGET = 256 * 1024 * 1024
_SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    node_id INTEGER NOT NULL,
    version INTEGER NOT NULL,
    blob BLOB,
    PRIMARY KEY (node_id, version)
) WITHOUT ROWID
"""


class ClientStateStore:
    """Pickled ``context.state`` per node id: memory up to a budget, then SQLite.

    Args:
        path: SQLite file for the states (created if missing). None keeps them
            in memory until the budget is exceeded, then spills to a temporary
            file.
        memory_budget: bytes of states kept in memory (least recently used go first).
    """

    def __init__(self, path: str | Path | None = None, memory_budget: int = DEFAULT_BUDGET) -> None:
        require(memory_budget >= 0, "memory_budget", memory_budget, "a number of bytes >= 0")
        self.memory_budget = memory_budget
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._db: sqlite3.Connection | None = None
        self._written: set[int] = set()  # nodes written since the last checkpoint
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if path is not None:
            self._open(Path(path))

    # -- storage -----------------------------------------------------------------
    def _open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)

    def _spill(self, version: int) -> None:
        """Move everything to a temporary file (the memory budget ran out)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="fedsim-state-")
        cached = list(self._cache.items())
        self._open(Path(self._tmp.name) / "state.sqlite")
        self._write(cached, version)

    @property
    def spilled(self) -> bool:
        """True when the states live in a file."""
        return self._db is not None

    def _write(self, items: list[tuple[int, bytes | None]], version: int) -> None:
        assert self._db is not None
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO states (node_id, version, blob) VALUES (?, ?, ?)",
                [(node, version, blob) for node, blob in items],
            )

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
            elif self._db is not None:
                missing.append(node)
        if missing and self._db is not None:
            for start in range(0, len(missing), 500):
                chunk = missing[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT node_id, blob FROM states s WHERE node_id IN ({marks}) AND version ="
                    " (SELECT MAX(version) FROM states t WHERE t.node_id = s.node_id)",
                    chunk,
                ).fetchall()
                for node, blob in rows:
                    if blob is not None:
                        found[node] = blob
                        self._remember(node, blob)
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
            self._write(items, version)
            self._written.update(node for node, _ in items)
        self._trim()

    def __len__(self) -> int:
        if self._db is None:
            return len(self._cache)
        row = self._db.execute(
            "SELECT COUNT(*) FROM states s WHERE blob IS NOT NULL AND version ="
            " (SELECT MAX(version) FROM states t WHERE t.node_id = s.node_id)"
        ).fetchone()
        return int(row[0])

    # -- checkpoints ---------------------------------------------------------------
    def checkpoint(self, version: int) -> None:
        """Make round ``version`` restorable: keep, for every client written since
        the last checkpoint, only its newest version up to ``version``."""
        if self._db is None or not self._written:
            return
        nodes = list(self._written)
        with self._db:
            self._db.execute("BEGIN")
            for start in range(0, len(nodes), 500):
                chunk = nodes[start : start + 500]
                marks = ",".join("?" * len(chunk))
                self._db.execute(
                    f"DELETE FROM states WHERE node_id IN ({marks}) AND version <"
                    " (SELECT MAX(version) FROM states t WHERE t.node_id = states.node_id"
                    " AND t.version <= ?)",
                    [*chunk, version],
                )
        self._written.clear()

    def rollback(self, version: int) -> None:
        """Forget every write made after round ``version`` (the last checkpoint)."""
        if self._db is None:
            raise RuntimeError("only a file-backed store can be rolled back")
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM states WHERE version > ?", (version,))
        self._cache.clear()
        self._cached_bytes = 0
        self._written.clear()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
