"""One writer per run directory: ``DIR/run.lock``, held while a run writes ``DIR``.

A run takes the lock before anything in its directory is read for writing or changed, and
gives it up when it ends (finished, failed or interrupted). A second run into the same
directory (``--out`` or ``--resume``) is refused at once with a :class:`RunLocked` error that
names the holder: its process id, host and start time, as the holder wrote them in the file.

The lock is an advisory ``flock(2)`` on the file, which the kernel drops when the holding
process dies, however it dies (``kill -9`` included). A lock file left behind by a dead run is
therefore stale by construction: the next run takes it over (and says so in the log) — no pid
guessing, and no window in which two live runs both hold it. The file is unlinked on release;
an acquirer checks, after locking, that the path still names the file it locked (else another
run removed and recreated it in between) and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLocked(ConfigError):
    """Another live run holds the directory's lock."""

    def __init__(self, key: str, out: Path, holder: dict[str, Any]) -> None:
        self.holder = holder
        super().__init__(
            key,
            str(out),
            f"a directory no other run is writing; {describe_holder(holder)} holds it "
            f"({out / LOCK_FILE}); wait for it to end or stop it, or choose another directory",
        )


def describe_holder(holder: dict[str, Any]) -> str:
    """``run pid 123 on host h, started 2026-12-02 10:50:01 UTC (fedsim run)``."""
    if not holder:
        return "a run that has not yet written its details"
    started = holder.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        if isinstance(started, (int, float))
        else "at an unknown time"
    )
    command = f" ({holder['command']})" if holder.get("command") else ""
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    return f"run pid {pid} on host {host}, started {when}{command}"


def _read_holder(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        holder = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


@dataclass
class RunLock:
    """The held lock of one run directory (:meth:`acquire`; :meth:`release` gives it up)."""

    path: Path
    fd: int
    holder: dict[str, Any]
    #: the outermost directory :meth:`acquire` made (None: the directory was there)
    created: Path | None = None

    @classmethod
    def acquire(cls, out: str | Path, key: str = "--out", command: str = "") -> RunLock:
        """Lock ``out`` (created if missing) for this process; raise :class:`RunLocked` on
        ``key`` naming the holder when another live run holds it. A stale lock file (its
        process has ended) is taken over."""
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise ConfigError(key, str(out), "a directory path (a file has this name)")
        created = next((d for d in reversed((out, *out.parents)) if not d.exists()), None)
        path = out / LOCK_FILE
        while True:
            out.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # an ending run removed the empty directory it made
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLocked(key, out, holder) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:  # its holder removed it as we opened it
                same = False
            if same:
                break
            os.close(fd)  # a lock on a file no longer in the directory: try again
        previous = _read_holder(fd)
        if previous:
            log.warning(
                "%s: took over a stale lock of %s, which has ended", path, describe_holder(previous)
            )
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": command,
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(holder, sort_keys=True).encode("utf-8") + b"\n")
        os.fsync(fd)
        return cls(path, fd, holder, created)

    def release(self) -> None:
        """Remove the lock file and unlock it (in that order: a waiting acquirer then finds
        it gone and opens a new one), then the directories :meth:`acquire` made if they are
        still empty (a run refused before it wrote anything leaves nothing). Idempotent."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        if self.created is None:
            return
        directory = self.path.parent
        while True:
            try:
                directory.rmdir()  # only an empty one
            except OSError:
                return
            if directory == self.created:
                return
            directory = directory.parent


@contextlib.contextmanager
def locked(out: str | Path, key: str = "--out", command: str = "") -> Iterator[RunLock]:
    """Hold ``out``'s lock for the block (see :meth:`RunLock.acquire`)."""
    lock = RunLock.acquire(out, key, command)
    try:
        yield lock
    finally:
        lock.release()
