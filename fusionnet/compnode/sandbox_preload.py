"""What the sandbox fork server imports before it forks any worker (``sandbox_client.PRELOAD``).

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

import fusionnet.compnode.sandbox_worker  # noqa: E402, F401  (the point of this module)
