"""The sandbox fork server's preload (``compnode.sandbox_preload``): its workers' torch advises huge pages
for large tensors (unless the compnode's environment says otherwise), and runs at a lower priority.

Each case runs in a fresh interpreter that imports the preload as the fork server does, then sets the
worker's allocator (``keep_freed_memory``) and allocates as a step would: the advice is read from
``/proc/self/smaps`` (the ``hg`` flag of the mapping that holds the tensor's data), which the kernel
keeps whether or not it has a huge page free at that moment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os
import fusionnet.compnode.sandbox_preload  # as the fork server does, before anything imports torch
from fusionnet.daemon.memory import keep_freed_memory
keep_freed_memory()  # as each worker does
import torch

def advised(t):
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return None

big, small = torch.ones(1 << 20), torch.ones(1 << 12)  # 4 MiB and 16 KiB of float32
print(json.dumps({"big": advised(big), "small": advised(small), "nice": os.nice(0)}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_linux_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")


@needs_linux_smaps
@pytest.mark.timeout(120)
def test_a_workers_large_tensors_are_advised_huge_pages_and_small_ones_are_not() -> None:
    seen = _probe()
    assert seen["big"] is True  # 2 MiB and more: aligned and advised
    assert seen["small"] is False  # below: the heap as it is, no bloat
    assert seen["nice"] >= 10  # the preload's lower priority, inherited by every worker


@needs_linux_smaps
@pytest.mark.timeout(120)
def test_a_compnode_started_with_the_switch_off_keeps_small_pages() -> None:
    assert _probe(THP_MEM_ALLOC_ENABLE="0")["big"] is False
