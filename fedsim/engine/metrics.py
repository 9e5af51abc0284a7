"""A worker process's own resource metrics."""

from __future__ import annotations


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (``VmHWM``, which unlike
    ``ru_maxrss`` does not carry a parent's peak across ``exec``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
