"""Federated datasets in a client-contiguous layout.

A :class:`ClientArrays` holds the rows of all clients in one array each for
features and labels, sorted by client, plus an ``offsets`` array: client ``k``
owns rows ``offsets[k]:offsets[k+1]``. A client's data is then a zero-copy
slice, the whole dataset can be shipped as a handful of arrays (through Ray's
object store or as ``.npy`` files read with ``mmap``), and 10^6 clients cost one
``int64`` per client.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config import ConfigError, require
from fedsim.data._summary import owner_stats
from fedsim.data.sources import MAX_CLASSES

_FORMAT = "fedsim.FederatedDataset"
_VERSION = 1
_ARRAY_KEYS = ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets")


@dataclass(frozen=True, eq=False)
class ClientArrays:
    """Rows of all clients, contiguous per client.

    x: (n, *feature_shape) features; y: (n,) int64 labels; offsets:
    (num_clients + 1,) int64 with offsets[0] = 0, non-decreasing, offsets[-1] = n.
    Client ``k`` owns rows ``offsets[k]:offsets[k+1]`` (possibly none).
    """

    x: np.ndarray
    y: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        x, y, off = self.x, self.y, self.offsets
        for key, arr in (("x", x), ("y", y), ("offsets", off)):
            require(isinstance(arr, np.ndarray), key, type(arr).__name__, "a numpy array")
        require(x.ndim >= 1, "x", x.shape, "an array of shape (n, *feature_shape)")
        require(
            y.ndim == 1 and y.dtype == np.int64, "y", (y.shape, str(y.dtype)), "a 1-D int64 array"
        )
        require(len(x) == len(y), "y", y.shape, f"as many labels as rows of x ({len(x)})")
        require(
            off.ndim == 1 and off.size >= 1 and off.dtype == np.int64,
            "offsets",
            (off.shape, str(off.dtype)),
            "a 1-D int64 array of length num_clients + 1",
        )
        require(
            int(off[0]) == 0 and int(off[-1]) == len(y),
            "offsets",
            (int(off[0]), int(off[-1])),
            f"offsets[0] = 0 and offsets[-1] = n = {len(y)}",
        )
        require(
            bool(np.all(off[1:] >= off[:-1])),
            "offsets",
            "decreasing entries",
            "non-decreasing offsets",
        )

    @property
    def num_clients(self) -> int:
        """Number of clients (``len(offsets) - 1``)."""
        return int(self.offsets.size - 1)

    def sizes(self) -> np.ndarray:
        """Rows per client, shape (num_clients,), int64."""
        return np.diff(self.offsets)

    def client(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``k``'s rows ``(x_k, y_k)``: zero-copy views of in-memory
        arrays; read from the file for memory-mapped ones (see :func:`read_rows`)."""
        ok = isinstance(k, (int, np.integer)) and not isinstance(k, bool)
        ok = ok and 0 <= int(k) < self.num_clients
        require(ok, "client", k, f"an integer client index in [0, {self.num_clients})")
        lo, hi = int(self.offsets[k]), int(self.offsets[int(k) + 1])
        return read_rows(self.x, lo, hi), read_rows(self.y, lo, hi)

    def head(self, num_clients: int) -> ClientArrays:
        """The first ``num_clients`` clients, as zero-copy views."""
        require(
            0 <= num_clients <= self.num_clients,
            "num_clients",
            num_clients,
            f"at most the {self.num_clients} clients present",
        )
        end = int(self.offsets[num_clients])
        return ClientArrays(self.x[:end], self.y[:end], np.array(self.offsets[: num_clients + 1]))


_FILES: dict[str, int] = {}  # memory-mapped file -> a descriptor open for reading


def read_rows(arr: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``arr[lo:hi]``; for a C-contiguous memory map, a copy read with ``pread``.

    Touching a memory map maps whole neighbourhoods of pages into the process
    (read-ahead and fault-around, 64 kB or more per client), so a worker that
    trains scattered clients of a large file would see its resident memory grow
    with the file rather than with the clients it trains. Reading exactly the
    rows' bytes keeps it proportional to the cohort.
    """
    region = getattr(arr, "_mmap", None)
    if region is None or not arr.flags.c_contiguous or arr.filename is None:
        return arr[lo:hi]
    out = np.empty((hi - lo, *arr.shape[1:]), dtype=arr.dtype)
    if out.nbytes == 0:
        return out
    # Where arr[0] lies in the file: the map's own file offset plus arr's
    # distance from the start of the map.
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data
    position = arr.offset - arr.offset % mmap.ALLOCATIONGRANULARITY
    position += arr.ctypes.data - base + lo * (arr.nbytes // max(len(arr), 1))
    fd = _FILES.get(arr.filename)
    if fd is None:
        fd = _FILES[arr.filename] = os.open(arr.filename, os.O_RDONLY)
    view = memoryview(out).cast("B")
    done = 0
    while done < out.nbytes:
        n = os.preadv(fd, [view[done:]], position + done)
        if n <= 0:
            raise OSError(f"short read from {arr.filename} at byte {position + done}")
        done += n
    return out


def concat_clients(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], feature_shape: tuple[int, ...], dtype: np.dtype
) -> ClientArrays:
    """Stack per-client ``(x_k, y_k)`` pairs into one :class:`ClientArrays`."""
    sizes = np.array([len(y) for _, y in parts], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if parts and offsets[-1] > 0:
        x = np.concatenate(
            [np.asarray(x, dtype=dtype).reshape(-1, *feature_shape) for x, _ in parts]
        )
        y = np.concatenate([np.asarray(y, dtype=np.int64).reshape(-1) for _, y in parts])
    else:
        x = np.zeros((0, *feature_shape), dtype=dtype)
        y = np.zeros(0, dtype=np.int64)
    return ClientArrays(x, y, offsets)


@dataclass(frozen=True, eq=False)
class FederatedDataset:
    """Train and test rows of the same clients, with the number of classes.

    ``train`` and ``test`` have the same clients in the same order; a client's
    test part may be empty. Labels lie in ``[0, num_classes)``.
    """

    train: ClientArrays
    test: ClientArrays
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        require(
            isinstance(self.train, ClientArrays),
            "train",
            type(self.train).__name__,
            "a ClientArrays",
        )
        require(
            isinstance(self.test, ClientArrays), "test", type(self.test).__name__, "a ClientArrays"
        )
        require(
            self.test.num_clients == self.train.num_clients,
            "test.num_clients",
            self.test.num_clients,
            f"the train split's {self.train.num_clients} clients",
        )
        require(
            self.test.x.shape[1:] == self.train.x.shape[1:],
            "test.x",
            self.test.x.shape,
            f"feature shape {self.train.x.shape[1:]} as in train.x",
        )
        require(
            isinstance(self.num_classes, (int, np.integer))
            and not isinstance(self.num_classes, bool)
            and 1 <= self.num_classes <= MAX_CLASSES,
            "num_classes",
            self.num_classes,
            f"an integer in [1, {MAX_CLASSES}] (the model gets one output per class)",
        )
        for key, y in (("train.y", self.train.y), ("test.y", self.test.y)):
            if y.size:
                lo, hi = int(y.min()), int(y.max())
                require(
                    lo >= 0 and hi < self.num_classes,
                    key,
                    (lo, hi),
                    f"labels in [0, {self.num_classes})",
                )

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return self.train.num_clients

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one example's features."""
        return tuple(self.train.x.shape[1:])

    @property
    def central_test(self) -> tuple[np.ndarray, np.ndarray]:
        """All clients' test rows pooled: ``(test.x, test.y)`` themselves (no copy)."""
        return self.test.x, self.test.y

    def stats(self) -> dict[str, Any]:
        """JSON-ready per-client statistics of the train and test splits.

        Sizes (min/median/mean/max/std over clients), classes per client
        (mean/min/max), label histogram, empty clients, mean label
        total-variation distance to the pooled distribution, total samples.
        """
        out: dict[str, Any] = {
            "name": self.name,
            "num_clients": self.num_clients,
            "num_classes": int(self.num_classes),
            "feature_shape": list(self.feature_shape),
            "total_samples": int(len(self.train.y) + len(self.test.y)),
        }
        for split, arrays in (("train", self.train), ("test", self.test)):
            owner = np.repeat(np.arange(arrays.num_clients, dtype=np.int64), arrays.sizes())
            out[split] = owner_stats(
                owner, np.asarray(arrays.y), arrays.num_clients, int(self.num_classes)
            )
        return out

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The six arrays that define the dataset (no copies): ``train_x`` ... ``test_offsets``."""
        return {
            "train_x": self.train.x,
            "train_y": self.train.y,
            "train_offsets": self.train.offsets,
            "test_x": self.test.x,
            "test_y": self.test.y,
            "test_offsets": self.test.offsets,
        }

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, np.ndarray], num_classes: int, name: str
    ) -> FederatedDataset:
        """Rebuild a dataset from :meth:`to_arrays` output without copying the arrays."""
        missing = [k for k in _ARRAY_KEYS if k not in arrays]
        require(not missing, "arrays", sorted(arrays), f"the keys {', '.join(_ARRAY_KEYS)}")
        return cls(
            ClientArrays(arrays["train_x"], arrays["train_y"], arrays["train_offsets"]),
            ClientArrays(arrays["test_x"], arrays["test_y"], arrays["test_offsets"]),
            int(num_classes),
            name,
        )

    def save(self, directory: str | Path) -> Path:
        """Write one ``<key>.npy`` per array plus ``meta.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for key, arr in self.to_arrays().items():
            np.save(directory / f"{key}.npy", np.asarray(arr), allow_pickle=False)
        meta = {
            "format": _FORMAT,
            "version": _VERSION,
            "name": self.name,
            "num_classes": int(self.num_classes),
            "num_clients": self.num_clients,
            "feature_shape": list(self.feature_shape),
            "arrays": list(_ARRAY_KEYS),
        }
        (directory / "meta.json").write_text(json.dumps(meta, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, mmap: bool = True) -> FederatedDataset:
        """Read a directory written by :meth:`save`.

        With ``mmap`` the feature and label arrays are ``np.memmap`` (read-only),
        so a client's rows are read from disk only when used; offsets are loaded.
        """
        directory = Path(directory)
        meta_path = directory / "meta.json"
        require(
            meta_path.is_file(),
            "path",
            str(directory),
            "a directory written by FederatedDataset.save (with meta.json)",
        )
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError("path", str(meta_path), f"valid JSON ({err})") from err
        require(
            isinstance(meta, dict) and meta.get("format") == _FORMAT,
            "path",
            str(meta_path),
            f"a meta.json with format {_FORMAT!r}",
        )
        arrays: dict[str, np.ndarray] = {}
        for key in _ARRAY_KEYS:
            file = directory / f"{key}.npy"
            require(file.is_file(), "path", str(directory), f"a directory containing {key}.npy")
            lazy = mmap and not key.endswith("offsets")
            arrays[key] = np.load(file, mmap_mode="r" if lazy else None, allow_pickle=False)
        classes, name = meta.get("num_classes"), meta.get("name")
        require(
            isinstance(classes, int) and not isinstance(classes, bool) and isinstance(name, str),
            "path",
            str(meta_path),
            "a meta.json with an integer num_classes and a string name",
        )
        return cls.from_arrays(arrays, classes, name)


def release_pages(dataset: FederatedDataset) -> None:
    """Unmap the pages of ``dataset``'s memory maps that have been read so far
    (validation reads every label); they stay in the page cache, so nothing is
    read again from disk, but they no longer count in this process's memory."""
    for arr in dataset.to_arrays().values():
        region = getattr(arr, "_mmap", None)
        if region is not None and hasattr(mmap, "MADV_DONTNEED"):
            region.madvise(mmap.MADV_DONTNEED)


def _part_rows(parts: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The clients' row indices, concatenated client by client, and each client's count; a
    ConfigError unless there is a client and the parts are disjoint indices in ``[0, n)``."""
    require(len(parts) >= 1, "parts", len(parts), "at least one client")
    sizes = np.array([np.size(p) for p in parts], dtype=np.int64)
    rows = (
        np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
        if sizes.sum()
        else np.zeros(0, dtype=np.int64)
    )
    if rows.size:
        require(
            int(rows.min()) >= 0 and int(rows.max()) < n,
            "parts",
            (int(rows.min()), int(rows.max())),
            f"row indices in [0, {n})",
        )
        require(
            int(np.bincount(rows, minlength=n).max()) <= 1,
            "parts",
            "overlapping parts",
            "disjoint index arrays (no row in two clients)",
        )
    return rows, sizes


def from_partition(
    x: np.ndarray,
    y: np.ndarray,
    parts: Sequence[np.ndarray],
    test_fraction: float,
    rng: np.random.Generator,
    num_classes: int,
    name: str,
) -> FederatedDataset:
    """Build a :class:`FederatedDataset` from row indices per client.

    ``parts[k]`` holds the row indices of ``x`` / ``y`` owned by client ``k``
    (disjoint; rows in no part are dropped). Each client's rows are split at
    random into test (``round(test_fraction * n_k)`` rows, but at most
    ``n_k - 1`` so that every non-empty client keeps at least one train row)
    and train; both splits keep the original row order within a client.
    Costs one sort of the assigned rows and one gather of ``x``.
    """
    x = np.asarray(x)
    y = np.asarray(y)
    require(
        x.ndim >= 1 and y.ndim == 1 and len(x) == len(y),
        "y",
        (x.shape, y.shape),
        "x of shape (n, ...) and y of shape (n,)",
    )
    require(
        isinstance(test_fraction, (int, float)) and 0.0 <= test_fraction < 1.0,
        "test_fraction",
        test_fraction,
        "a number in [0, 1)",
    )
    rows, sizes = _part_rows(parts, len(y))
    num_clients = len(parts)
    owner = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
    n_test = np.minimum(
        np.floor(test_fraction * sizes + 0.5).astype(np.int64), np.maximum(sizes - 1, 0)
    )
    # random rank of each row within its client: sort by owner + U[0, 1)
    order = np.argsort(owner + rng.random(rows.size), kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rank = np.empty(rows.size, dtype=np.int64)
    rank[order] = np.arange(rows.size, dtype=np.int64) - np.repeat(starts, sizes)
    is_test = rank < n_test[owner]
    train_rows, test_rows = rows[~is_test], rows[is_test]
    y64 = y.astype(np.int64, copy=False)
    train = ClientArrays(
        x[train_rows],
        y64[train_rows],
        np.concatenate([[0], np.cumsum(sizes - n_test)]).astype(np.int64),
    )
    test = ClientArrays(
        x[test_rows], y64[test_rows], np.concatenate([[0], np.cumsum(n_test)]).astype(np.int64)
    )
    return FederatedDataset(train, test, int(num_classes), name)
