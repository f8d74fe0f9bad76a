"""What the sandbox fork server imports before it forks any worker (``sandbox_pool.PRELOAD``): the
worker's modules and what torch would import lazily inside a worker's first assignment.

It first lowers its own CPU priority, which every worker inherits: importing torch (seconds) while
other daemons on the machine profile their hardware must not skew their measurements, and a job's
compute must not starve the daemon's event loop (heartbeats, RPCs, the data path) nor, on a
volunteer's machine, its owner's programs. Alone on a core a niced process runs at full speed.
"""

from __future__ import annotations

import contextlib
import os

NICENESS = 10

with contextlib.suppress(OSError):
    os.nice(NICENESS)

# torch imports its compiler stack the first time any optimizer is built (``Optimizer.__init__`` goes
# through ``torch._disable_dynamo``): about 1 s on an idle core and 2-3 s on a busy 2-core machine, paid
# by every train job's worker inside its assignment (py-spy on a 125M Llama job: the largest share of
# its setup). Imported here, once per compnode, and shared copy-on-write by every worker forked after.
import torch._dynamo  # noqa: E402, F401

import fusionnet.compnode.sandbox_worker  # noqa: E402, F401  (the worker's modules: the point of this module)
