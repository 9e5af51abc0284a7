"""Files of a run directory: written durably, read back only when authentic.

A run directory is data that anyone may have handled (copied, truncated by a full disk,
swapped with another run's, crafted), so nothing in it is trusted or executed as it is read:

* :func:`write_atomic` writes a file under a temporary name, fsyncs it, renames it into place
  and fsyncs the directory, so a crash or a power loss leaves either the old file or the new
  one, never a torn one, and a rename that was reported done survives.
* :func:`seal_record` / :func:`open_record` frame a payload in an authenticated record::

      magic (8 bytes) | kind (8) | schema version (u32) | header length (u32) |
      payload length (u64) | header (UTF-8 JSON) | payload | tag (32)

  with ``tag = HMAC-SHA256(key, everything before it)`` (RFC 2104). The key is
  :meth:`fedsim.randomness.RunSecret.mac_key`, derived from the run's secret root, which is kept
  *outside* the run directory; whoever holds only the directory can neither forge nor alter a
  record. :func:`open_record` checks magic, kind, version, lengths and tag, in that order, before
  anything is parsed, and refuses with a :class:`RunFileError` that names the file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from pathlib import Path
from typing import Any

from fedsim.config import ConfigError

CONFIG_FILE = "config.json"
"""The run's validated config, written once (what its other files are bound to)."""
MAGIC = b"\x89fedsim\n"
"""First 8 bytes of every authenticated record (not text, not a pickle opcode stream)."""
_FRAME = struct.Struct(">8s8sIIQ")  # magic, kind, schema, header length, payload length
TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 20


class RunFileError(ConfigError):
    """A file of a run directory is missing, damaged, foreign or inconsistent with the others.

    The message names the file and what is wrong with it; nothing from the file was executed.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__("run directory", str(path), problem)
        self.path = Path(path)
        self.problem = problem
        self.args = (str(path), problem)  # what __init__ takes, so the error pickles

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def fsync_directory(directory: str | Path) -> None:
    """Make the entries of ``directory`` (creations, renames, deletions) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(path: Path) -> Path:
    """Where :func:`write_atomic` writes ``path`` before renaming it into place."""
    return path.with_name(path.name + ".tmp")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path``: temporary file, fsync, rename, fsync of the directory."""
    path = Path(path)
    tmp = temporary_path(path)
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def digest(data: bytes) -> str:
    """SHA-256 of ``data`` in hex (how records name the bytes of another file)."""
    return hashlib.sha256(data).hexdigest()


def _kind_bytes(kind: str) -> bytes:
    raw = kind.encode("ascii")
    if not 1 <= len(raw) <= 8:
        raise ValueError(f"record kind {kind!r} must be 1 to 8 ASCII characters")
    return raw.ljust(8, b"\x00")


def seal_record(
    kind: str, schema: int, header: dict[str, Any], payload: bytes, key: bytes
) -> bytes:
    """The bytes of an authenticated record of ``kind`` (see the module docstring)."""
    head = json.dumps(header, sort_keys=True).encode()
    body = _FRAME.pack(MAGIC, _kind_bytes(kind), schema, len(head), len(payload)) + head + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def open_record(
    path: str | Path, kind: str, schema: int, key: bytes, what: str
) -> tuple[dict[str, Any], bytes]:
    """The header and payload of the record in ``path``, after every check has passed.

    ``what`` names the file's role in errors ("a fedsim checkpoint"). Raises
    :class:`RunFileError` naming ``path`` when the file is missing, empty, truncated or
    extended, of another kind or schema version, or fails authentication under ``key``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RunFileError(path, f"cannot be read ({err.strerror})") from None
    if not data:
        raise RunFileError(path, f"is empty; it should hold {what}")
    if data[:8] != MAGIC:
        raise RunFileError(path, f"is not {what} (it does not start with fedsim's record header)")
    if len(data) < _FRAME.size + TAG_BYTES:
        raise RunFileError(path, f"is truncated: {len(data)} bytes, shorter than any record")
    magic, got_kind, got_schema, head_len, payload_len = _FRAME.unpack_from(data)
    if got_kind != _kind_bytes(kind):
        name = got_kind.rstrip(b"\x00").decode("ascii", "replace")
        raise RunFileError(path, f"holds a fedsim {name!r} record, not {what}")
    if got_schema != schema:
        raise RunFileError(
            path, f"has schema version {got_schema}; this fedsim reads version {schema}"
        )
    expected = _FRAME.size + head_len + payload_len + TAG_BYTES
    if head_len > MAX_HEADER_BYTES or expected != len(data):
        raise RunFileError(
            path,
            f"is truncated or damaged: its header announces {expected} bytes, the file has "
            f"{len(data)}",
        )
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        raise RunFileError(
            path,
            "fails authentication (HMAC-SHA256 under the run's secret root): it was altered, "
            "or written by a run with another secret root; it was not loaded",
        )
    head = body[_FRAME.size : _FRAME.size + head_len]
    header = json.loads(head)  # authentic: written by seal_record under this key
    return header, body[_FRAME.size + head_len :]
