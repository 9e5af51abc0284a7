"""Fast conversions between Flower records and numpy arrays.

Flower's :class:`flwr.app.Array` stores an array as the bytes of ``np.save``
(``stype == "numpy.ndarray"``). Building and reading those bytes through
``np.save``/``np.load`` costs tens of microseconds per array, which dominates
the per-client overhead of small models. The functions here produce and read
exactly the same bytes (``np.load`` reads what :func:`to_record` writes and
:func:`to_numpy` reads what ``np.save`` writes) with the header parsed once per
(dtype, shape) and the payload viewed in place.
"""

from __future__ import annotations

import ast
import io
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

NUMPY_STYPE = "numpy.ndarray"
R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)
_MAGIC = b"\x93NUMPY"


@lru_cache(maxsize=4096)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, str, tuple[int, ...]]:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array (NEP 1
    format), with the dtype name and shape an :class:`Array` records."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue(), str(dtype), tuple(int(s) for s in shape)


@lru_cache(maxsize=4096)
def _parse_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool]:
    info = ast.literal_eval(header.decode("latin1"))
    return np.dtype(info["descr"]), tuple(info["shape"]), bool(info["fortran_order"])


def array_to_numpy(array: Array) -> np.ndarray:
    """A read-only numpy view of ``array``'s payload (no copy)."""
    if array.stype != NUMPY_STYPE:
        return array.numpy()  # let Flower raise for unknown serialisations
    data = array.data
    if data[:6] != _MAGIC:
        raise ValueError(f"Array payload is not in .npy format (starts with {data[:8]!r})")
    major = data[6]
    if major == 1:
        start, length = 10, int.from_bytes(data[8:10], "little")
    else:
        start, length = 12, int.from_bytes(data[8:12], "little")
    dtype, shape, fortran = _parse_header(bytes(data[start : start + length]))
    flat = np.frombuffer(data, dtype=dtype, offset=start + length)
    flat.flags.writeable = False  # (a bytearray payload, :func:`array_to_fill`, would allow it)
    if fortran:
        return flat.reshape(shape[::-1]).T
    return flat.reshape(shape)


def numpy_to_array(value: np.ndarray) -> Array:
    """An :class:`Array` holding ``value`` as ``np.save`` would write it."""
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)  # (never for 0-d arrays, which it would make 1-d)
    if value.dtype.hasobject:
        raise TypeError("object arrays cannot be sent in an ArrayRecord")
    header, dtype, shape = _npy_header(value.dtype, value.shape)
    # Equivalent to Array(dtype=..., shape=..., stype=..., data=...) for fields
    # already validated here; Flower's constructor checks every field again and
    # costs more than the copy of the payload for a small model.
    array = Array.__new__(Array)
    payload = value.reshape(-1).view(np.uint8)  # a view: the join below is the one copy
    array.__dict__.update(
        dtype=dtype, shape=shape, stype=NUMPY_STYPE, data=b"".join([header, payload])
    )
    return array


def array_to_fill(dtype, shape: tuple[int, ...]) -> tuple[Array, np.ndarray]:
    """An :class:`Array` of ``shape`` and ``dtype`` whose payload is still to be written, and
    a writable C-ordered numpy view of that payload: what the caller writes into the view is
    the Array's content, with no copy (its bytes are then what ``np.save`` writes for the
    view). The Array's ``data`` is a ``bytearray`` rather than ``bytes``: for a reply read in
    the same process (a worker's fold, :mod:`fedsim.worker_reduce`), where copying a large
    payload into immutable bytes would cost more than computing it; :func:`array_to_numpy`
    reads it read-only, and pickling and ``len`` treat it as bytes."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError("object arrays cannot be sent in an ArrayRecord")
    header, name, shape = _npy_header(dtype, tuple(shape))
    data = bytearray(len(header) + dtype.itemsize * math.prod(shape))
    data[: len(header)] = header
    view = np.frombuffer(data, dtype=dtype, offset=len(header)).reshape(shape)
    array = Array.__new__(Array)
    array.__dict__.update(dtype=name, shape=shape, stype=NUMPY_STYPE, data=data)
    return array, view


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Every array of ``record`` as a read-only numpy view, keyed as in the record."""
    return {key: array_to_numpy(array) for key, array in record.items()}


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An :class:`ArrayRecord` with one :class:`Array` per entry of ``arrays``."""
    record = ArrayRecord()  # item assignment keeps the Arrays (the dict constructor copies them)
    for key, value in arrays.items():
        record[key] = numpy_to_array(np.asarray(value))
    return record


def records_of(content: RecordDict, kind: type[R]) -> list[tuple[str, R]]:
    """The ``(key, record)`` pairs of one record type in a message's content.

    Equivalent to ``content.array_records.items()`` (etc.) without building
    Flower's typed view of the content on every call.
    """
    return [(key, record) for key, record in content.items() if isinstance(record, kind)]


def content_nbytes(content: RecordDict) -> int:
    """Payload bytes of a message's content: array bytes, the length of each bytes or str
    value (in lists too), and 8 bytes per other scalar.

    This is the size a deployment would ship, not Ray's internal traffic; it is
    what rounds.jsonl reports as bytes sent and received.
    """
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(a.data) for a in record.values())
        elif isinstance(record, (ConfigRecord, MetricRecord)):
            for value in record.values():
                for item in value if isinstance(value, list) else [value]:
                    total += len(item) if isinstance(item, (bytes, str)) else 8
    return total
