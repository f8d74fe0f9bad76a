"""Which compute stretches of a sandbox worker run on its event loop instead of its compute thread.

Why: a stretch on the compute thread costs two wake-ups, the thread's when the loop hands it the work
and the loop's when the result comes back, and each waits for a free core. A value's trip between two
stages takes both of them on the critical path: the receiver's loop reads the frame, wakes its thread,
which computes and wakes the loop, which sends. On machines whose cores the stages share (3 stages on
2 cores, or many compnodes on one host) a wake-up waits for a core often, and with stretches of a few
milliseconds (small models, serving's decode batches) those waits were a large share of the step.
torch's pipeline ranks compute and call gloo's send and recv on one thread.

A sandbox worker runs one job and nothing else: its loop only carries that job's frames and its
daemon's calls, both of which wait in the socket buffers while a stretch runs. The daemon's own loop
(heartbeats, RPCs) is another process and never computes (design decision). So a stretch runs inline
on the worker's loop when all of these hold, and on the compute thread otherwise:

- every one of the last ``RECENT`` stretches of its phase (FP, BP or Update) took at most the limit
  (``--inline-compute-ms``, 20 ms by default), so the loop is never held long: a drop or close call
  waits at most about that long; the first stretch of each phase goes to the thread, to be timed;
- every send the executor started is in the kernel already (``Outbox.idle``): a frame larger than the
  socket's buffer keeps the loop free to write the rest while the next stretch computes;
- the compute thread has nothing queued or running (``TrackedPool.idle``: a failover snapshot's copy,
  a batch's output packing), so the two never compute at once and keep their order.

The same ops run in the same order either way: the bits do not depend on the route.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

RECENT = 8  # stretches of a phase whose longest decides

T = TypeVar("T")


class TrackedPool(Executor):
    """A compute pool that knows whether it has work queued or running (``idle``)."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = self.pool.submit(fn, *args, **kwargs)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(future)
        return future

    def idle(self) -> bool:
        return all(f.done() for f in self._pending)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class ShortStretches:
    """The timings of the recent stretches per phase, and the limit under which one runs inline."""

    def __init__(self, limit_seconds: float) -> None:
        if not limit_seconds >= 0:
            raise ValueError(f"the inline limit must be >= 0 seconds, got {limit_seconds}")
        self.limit = limit_seconds
        self._recent: dict[str, deque[float]] = {}
        self.inline = 0  # stretches run inline so far (and on the thread), for the worker's log
        self.threaded = 0

    def short(self, phase: str) -> bool:
        """Whether ``phase``'s recent stretches all took at most the limit (none timed yet: no)."""
        recent = self._recent.get(phase)
        return self.limit > 0 and bool(recent) and max(recent) <= self.limit  # type: ignore[type-var]

    def observe(self, phase: str, seconds: float) -> None:
        self._recent.setdefault(phase, deque(maxlen=RECENT)).append(seconds)

    def timed(self, phase: str, call: Callable[[], T]) -> T:
        """``call``, its seconds noted for the choice of ``phase``'s next stretches' route."""
        started = time.perf_counter()
        try:
            return call()
        finally:
            self.observe(phase, time.perf_counter() - started)

    def count(self, inline: bool) -> None:
        if inline:
            self.inline += 1
        else:
            self.threaded += 1
