"""Slices of state that arrive ahead of their ``assign``, part by part (``stage_state``).

A broker sends a sub-DAG's state (or optimizer state) over ``results.slice_stream.PART_BYTES`` in parts
instead of inline, so that it never holds a whole slice (issue 11); here the parts are put together
into one buffer, which the ``assign`` that names the slice's size then takes. Only trusted brokers
stage (the caller checks), and what they stage is bounded: a slice must fit the memory this machine
has available, at most ``MAX_STAGINGS`` are open per broker, parts must come in order (a repeated
part, a retry whose answer was lost, is accepted again), and a staging nobody takes within ``ttl``
seconds of its last part is dropped. An ``assign`` whose staged slice is missing or incomplete is
refused with a message that says which.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from fusionnet.errors import JobError
from fusionnet.messages.compnode_rpc import AssignRequest, StageStateRequest

MAX_STAGINGS = 8  # open stagings per broker (state + optimizer of a few sub-DAGs)
MEMORY_SHARE = 0.9  # a slice may take at most this share of the memory available when it starts

StagingKey = tuple[str, str, int, int, str]  # broker, job, attempt, sub-DAG, kind


def available_memory() -> int:
    """Bytes of memory this machine can still give (``MemAvailable``: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # not Linux: free pages only
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


@dataclass
class _Staging:
    buffer: bytearray
    received: int = 0
    touched: float = field(default_factory=time.monotonic)


def _describe(key: StagingKey) -> str:
    _, job, attempt, subdag, kind = key
    return f"job {job} (attempt {attempt}) sub-DAG {subdag} {kind}"


class StateStaging:
    """Staged slices by (broker, job, attempt, sub-DAG, kind)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._open: dict[StagingKey, _Staging] = {}

    def add(self, broker: str, request: StageStateRequest) -> int:
        """Takes one part; returns the bytes of the slice received so far."""
        key = (broker, request.job_id, request.attempt, request.subdag, request.kind)
        staging = self._open.get(key)
        if staging is None:
            if request.offset:
                raise JobError(f"stage_state: {_describe(key)}: first part at offset {request.offset}, not 0")
            self._make_room(broker, request.total, key)
            staging = self._open[key] = _Staging(bytearray(request.total))
        if len(staging.buffer) != request.total:
            raise JobError(
                f"stage_state: {_describe(key)}: total {request.total} bytes, "
                f"but the staging began with {len(staging.buffer)}"
            )
        end = request.offset + len(request.data)
        if request.offset > staging.received:
            raise JobError(
                f"stage_state: {_describe(key)}: part at offset {request.offset} "
                f"but only {staging.received} bytes in (parts come in order)"
            )
        staging.buffer[request.offset : end] = request.data  # a repeated part rewrites the same bytes
        staging.received = max(staging.received, end)
        staging.touched = time.monotonic()
        return staging.received

    def _make_room(self, broker: str, total: int, key: StagingKey) -> None:
        self.expire()
        if sum(1 for k in self._open if k[0] == broker) >= MAX_STAGINGS:
            raise JobError(
                f"stage_state: {_describe(key)}: {MAX_STAGINGS} stagings of this broker already open"
            )
        available = available_memory() * MEMORY_SHARE
        if total > available:
            raise JobError(
                f"stage_state: {_describe(key)}: a slice of {total / 1e9:.2f} GB does not fit the "
                f"{available / 1e9:.2f} GB of memory available here"
            )

    def resolve(self, broker: str, request: AssignRequest) -> AssignRequest:
        """``request`` with its staged slices put in (taken out of the store); unchanged if none."""
        update: dict[str, bytearray] = {}
        for kind, size in (("state", request.staged_state), ("optim", request.staged_optim)):
            if size is None:
                continue
            key = (broker, request.job_id, request.attempt, request.subdag, kind)
            staging = self._open.get(key)
            if staging is None:
                raise JobError(f"assign: {_describe(key)} was to be staged first, but nothing was staged")
            if len(staging.buffer) != size or staging.received != size:
                raise JobError(
                    f"assign: {_describe(key)}: {staging.received} of {len(staging.buffer)} bytes staged, "
                    f"the assignment names {size}"
                )
            update[kind] = staging.buffer
        for kind in update:
            del self._open[(broker, request.job_id, request.attempt, request.subdag, kind)]
        return request.model_copy(update=update) if update else request

    def drop_job(self, job_id: str, up_to_attempt: int | None = None) -> None:
        """Drops the job's stagings (only those of attempts up to ``up_to_attempt`` if given)."""
        for key in [
            k for k in self._open if k[1] == job_id and (up_to_attempt is None or k[2] <= up_to_attempt)
        ]:
            del self._open[key]

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._open.items() if now - s.touched > self.ttl]:
            del self._open[key]

    @property
    def staged_bytes(self) -> int:
        return sum(len(s.buffer) for s in self._open.values())
