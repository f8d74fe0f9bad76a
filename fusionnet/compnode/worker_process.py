"""A sandbox worker process's settings and limits, set before any of its job runs: its configuration
from the daemon (``WorkerConfig``), death with its parent (``PR_SET_PDEATHSIG``: the fork server, which
dies with the daemon) and the memory budget (``RLIMIT_DATA`` over what it maps at start, CPU devices;
``--sandbox-memory-gb``). ``sandbox_worker`` is what runs in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
import signal
from dataclasses import dataclass

from fusionnet.compnode.faults import FaultPoint
from fusionnet.compnode.tcp_down import Down

PR_SET_PDEATHSIG = 1
EXIT_NO_ANSWER = 70  # the worker could not answer a call (``sandbox_pool.describe_exit``)


@dataclass(frozen=True)
class WorkerConfig:
    peer_id: str
    job_id: str
    subdag: int
    threads: int | None
    slowdown: float
    memory_bytes: int | None  # RLIMIT_DATA budget above what the worker uses at start (None: none)
    daemon_pid: int
    fault: FaultPoint | None  # test fault injection: its step count is shared with the daemon
    log_level: int
    direct_sends: bool = True  # values to peers over the worker's own TCP (``worker_sends``)
    direct_receives: bool = False  # values from peers read by the worker (``worker_receives``)
    inline_seconds: float = 0.0  # stretches this short run on the worker's loop (``dag.short_stretches``)
    tcp_down: tuple[Down, ...] = ()  # peers the daemon found TCP down to: not dialled (``tcp_down``)


def die_with_parent() -> None:
    # Not Linux: no prctl; the socket's end still stops an idle worker.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _data_in_use() -> int:
    """Bytes of private writable memory this process maps now (``VmData``), what RLIMIT_DATA counts."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def apply_limits(config: WorkerConfig, device: str | None = None) -> None:
    """The memory budget (the lower CPU priority comes from the fork server: ``sandbox_preload``)."""
    if config.memory_bytes is not None and (device is None or device == "cpu"):
        # CUDA maps its address space as private writable memory: a data limit would break it.
        limit = _data_in_use() + config.memory_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
