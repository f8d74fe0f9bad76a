"""No core dumps from processes that run a job's own code (sandbox workers, load checks).

A job whose model crashes the interpreter (a segfault in an op, ``ctypes.string_at(0)`` at import)
would otherwise have the kernel write the process's whole memory, hundreds of MB with torch loaded,
into its working directory (with ``ulimit -c unlimited``) or hand it to a crash handler; and the dying
process keeps its sockets and pipes open until that is done, so whoever waits on it learns of the
crash late. Standard library only: every layer may call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import resource

PR_SET_DUMPABLE = 4


def forbid_core_dumps() -> None:
    """No core file (``RLIMIT_CORE`` 0), and not dumpable: no core piped to a crash handler either,
    which may ignore the limit."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the limit alone
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
