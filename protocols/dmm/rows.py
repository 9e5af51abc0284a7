"""Reading sealed rows of field elements without parsing their .npy header each time."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from protocols.channels import decode_array, encode_array


@lru_cache(maxsize=64)
def _header(width: int) -> bytes:
    """The .npy header :func:`protocols.channels.encode_array` writes for an int64 row of
    ``width`` elements, computed once with the running numpy."""
    return encode_array(np.zeros(width, dtype="<i8"))[: -8 * width or None]


@lru_cache(maxsize=64)
def row_decoder(width: int) -> Callable[[bytes], np.ndarray]:
    """A decoder (:meth:`protocols.channels.Endpoint.open_array`'s ``decode``) for bytes that
    are mostly an int64 row of ``width`` elements: that row, read past the known header;
    anything else goes through :func:`protocols.channels.decode_array` (same checks, same
    result)."""
    width = int(width)
    header = _header(width)
    size = len(header) + 8 * width

    def decode(payload: bytes) -> np.ndarray:
        if isinstance(payload, bytes) and len(payload) == size and payload.startswith(header):
            return np.frombuffer(payload, dtype="<i8", offset=len(header)).copy()
        return decode_array(payload)

    return decode
