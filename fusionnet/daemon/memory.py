"""Large buffers go back to the operating system when a daemon frees them.

A daemon handles messages of tens of MB (assignment parts, collect chunks, replica chunks). glibc
serves an allocation that large with ``mmap`` and unmaps it on ``free``, but only up to a threshold
that it raises to the size of every mapped block freed (up to 32 MB): after the first 32 MB message,
every later one comes from the heap, whose freed memory stays in the process. Measured on the broker
of a 125M-parameter job: 200 MB of resident memory kept for good after the first assignment's parts.
Fixing the threshold at 1 MB (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic raise off)
keeps every buffer of a MB or more mapped and returned when freed; smaller ones stay on the heap as
before. Not glibc (musl, macOS): nothing to do, the call is skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("fusionnet.daemon")

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 20


def return_large_buffers(threshold: int = MMAP_THRESHOLD) -> bool:
    """Sets glibc's mmap threshold; True if it took (False off glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return ok
