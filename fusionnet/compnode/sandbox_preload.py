"""What the sandbox fork server imports before it forks any worker (``sandbox_pool.PRELOAD``): the
worker's modules and what torch would import lazily inside a worker's first assignment.

It first lowers its own CPU priority, which every worker inherits: importing torch (seconds) while
other daemons on the machine profile their hardware must not skew their measurements, and a job's
compute must not starve the daemon's event loop (heartbeats, RPCs, the data path) nor, on a
volunteer's machine, its owner's programs. Alone on a core a niced process runs at full speed.

Then, before torch loads, it asks torch's CPU allocator for transparent huge pages (``THP_MEM_ALLOC_
ENABLE``: tensors of 2 MiB and more aligned to 2 MiB and ``madvise(MADV_HUGEPAGE)``; read once, when
torch's C library loads). A worker keeps its freed memory for the next step (``daemon.memory``), so the
pages it gets at its first step serve every step: with 4 KiB pages its weights, gradients and
activations walk the TLB page by page, which on a virtual machine (nested page tables) costs the most.
Measured on the 2-core VM (3-stage 1F1B of the 27M GPT-2, 11-13 swarm runs each): median step 690 ms
against 722, and 653-775 against 621-846. Kernels that set THP to ``never`` ignore the advice; a
compnode started with ``THP_MEM_ALLOC_ENABLE=0`` keeps 4 KiB pages. Tensors under 2 MiB and CUDA
memory are not affected.
"""

from __future__ import annotations

import contextlib
import os

NICENESS = 10
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # c10's switch (``c10/core/alloc_cpu``)

with contextlib.suppress(OSError):
    os.nice(NICENESS)

os.environ.setdefault(HUGE_PAGES_ENV, "1")  # before torch's C library loads (below), which reads it once

# torch imports its compiler stack the first time any optimizer is built (``Optimizer.__init__`` goes
# through ``torch._disable_dynamo``): about 1 s on an idle core and 2-3 s on a busy 2-core machine, paid
# by every train job's worker inside its assignment (py-spy on a 125M Llama job: the largest share of
# its setup). Imported here, once per compnode, and shared copy-on-write by every worker forked after.
import torch._dynamo  # noqa: E402, F401

import fusionnet.compnode.sandbox_worker  # noqa: E402, F401  (the worker's modules: the point of this module)
