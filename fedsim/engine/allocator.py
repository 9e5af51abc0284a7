"""A worker process's heap: freed blocks kept for the next client, not handed back to the OS.

Every client a worker runs allocates and frees the same large temporaries (its update, its
rotation and noise, its shares, its masks: megabytes each). glibc's malloc serves a block above
its mmap threshold (128 KiB, raised adaptively) by a fresh mapping and gives the heap's free top
back to the OS above its trim threshold, so the next client touches new pages again and pays a
page fault per 4 KiB page. :func:`keep_freed_memory` raises both thresholds with ``mallopt``
(glibc, mallopt(3)), so those blocks are reused warm: the worker keeps up to
:data:`TRIM_THRESHOLD_BYTES` of freed heap in exchange. Where the C library is not glibc nothing
changes.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
"""mallopt(3)'s parameter number of the trim threshold (glibc's malloc.h)."""
M_MMAP_THRESHOLD = -3
"""mallopt(3)'s parameter number of the mmap threshold (glibc's malloc.h)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below 32 MiB come from the heap: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
systems, the most its own adaptive threshold reaches."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Free heap kept before glibc returns its top to the OS."""


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Set this process's mmap and trim thresholds (bytes); True when glibc took both, False
    when this C library is not glibc (nothing changed)."""
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise ValueError(f"{name}={value!r}; allowed: an integer of bytes in [1, 2^31)")
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc's own symbol: present only under glibc
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took_mmap = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    return took_mmap and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
