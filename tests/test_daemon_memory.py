"""glibc's allocator settings of ``fusionnet.daemon.memory``, each checked in a fresh process (they are
process-wide and cannot be undone): what the kernel has to fault in when the same large tensors are
freed and allocated again, step after step, on a compute thread as a sandbox worker does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt"),
]

# A step's worth of tensors (4 to 24 MB, under glibc's 32 MB mmap ceiling, 124 MB in all), allocated,
# touched and freed on a worker thread ten times; the page faults of the last four are what a step pays.
STEPS = textwrap.dedent(
    """
    import json, resource, sys, threading
    import torch
    from fusionnet.daemon import memory

    took = {"default": None, "kept": memory.keep_freed_memory, "returned": memory.return_large_buffers}[
        sys.argv[1]]
    ok = took() if took else None
    faults = []

    def steps():
        for _ in range(10):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            held = [torch.ones(n << 18) for n in (4, 8, 4, 8, 4, 8, 16, 24)]
            held.extend(torch.ones(n << 18) for n in (24, 16, 8))
            del held
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    print(json.dumps({"took": ok, "faults": sum(faults[6:]) / 4}))
    """
)


def _faults_per_step(mode: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=100, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_memory_serves_each_step_from_the_last_ones_pages() -> None:
    default, kept = _faults_per_step("default"), _faults_per_step("kept")
    assert kept["took"] is True
    # glibc's defaults give some of each step's pages back and fault them in again (4 KiB each)
    assert default["faults"] > 2_000, default
    assert kept["faults"] < 200, kept


def test_returned_buffers_leave_the_process_when_freed() -> None:
    """A daemon's setting, the opposite trade: every MB-sized buffer is mapped afresh (and so faulted in)."""
    returned = _faults_per_step("returned")
    assert returned["took"] is True
    assert returned["faults"] > 10_000, returned
