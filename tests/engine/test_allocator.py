"""A worker's (and a committee actor's) heap keeps freed blocks: the next client's
temporaries reuse warm pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fedsim.engine.allocator import keep_freed_memory

_REUSE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    if sys.argv[1] == "worker":
        from fedsim.engine.worker_reset import ResettableWorker
        ResettableWorker()
    if sys.argv[1] == "committee":
        from fedsim.engine.committee_host import HostProcess
        HostProcess(own_process=True)
    faults = []
    for _ in range(4):  # one client's temporaries: six of 8 MiB, written, then all freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [np.ones(1 << 20) for _ in range(6)]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del blocks
    print(min(faults[1:]))
    """
)


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_a_warmed_worker_reuses_a_freed_block_without_faulting_its_pages_again():
    pages = (48 << 20) // 4096
    assert _faults("plain") > pages // 10  # glibc's defaults: the freed heap top trimmed
    assert _faults("worker") < pages // 100
    assert _faults("committee") < pages // 100  # a committee actor's process, likewise


def test_thresholds_out_of_range_are_refused_by_name():
    with pytest.raises(ValueError, match=r"mmap_threshold=0; allowed"):
        keep_freed_memory(mmap_threshold=0)
    with pytest.raises(ValueError, match=r"trim_threshold=True; allowed"):
        keep_freed_memory(trim_threshold=True)
    with pytest.raises(ValueError, match=r"trim_threshold=4294967296; allowed"):
        keep_freed_memory(trim_threshold=1 << 32)
