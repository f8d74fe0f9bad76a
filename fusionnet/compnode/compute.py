"""The compnode's compute thread: where FP, BP and Update of every sub-task run, and the executor
calibration of a first start-up, never on the event loop (design decision "compute never runs on an
event loop").

One thread per compnode, not one per job: a stretch of compute never waits for the network (receives
happen on the loop between stretches), so jobs sharing it cannot deadlock, and torch's intra-op threads
(``--threads``) already use the cores; two compute threads would only fight over them. The calibration
runs there too, so a job's compute and the calibration's timings never overlap.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

GIL_SWITCH_INTERVAL = 0.001  # seconds; CPython's default is 0.005
# A sandbox worker runs stretches at most this long on its loop (``dag.short_stretches``)
INLINE_COMPUTE_MS = 20.0


def compute_pool(threads: int | None) -> ThreadPoolExecutor:
    """The compute thread. torch keeps the intra-op thread count per process, but set it on the new
    thread too (``--threads``) in case the backend reads it per thread.

    torch releases the GIL inside its kernels, but an fx module's Python between ops holds it, and the
    event loop waits up to the switch interval each time it wants it back; a ping takes several such
    turns. A 1 ms interval keeps heartbeat round trips short while a sub-task runs; it costs the compute
    thread nothing while the loop is idle (the interval only matters when another thread asks)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)

    def init() -> None:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusionnet-compute", initializer=init)
