"""Replicas of sub-DAG state on compnodes, so that failover checkpoints never pass through the broker
(FusionAI 3.2: supernodes keep parameter copies; issue 11: the broker's memory and traffic stay
independent of the model's size).

When the broker asks for a snapshot in a ``step`` request, the compnode packs its sub-DAG's state and
optimizer state right after that step, on the compute thread (so before any later Update can change
them; the step's reply does not wait for it), keeps the blobs on its own disk and sends them in the
background to the compnode the assignment names as the sub-DAG's replica holder (``replicate``). The
holder keeps them on its disk. A snapshot is named by the checkpoint step it is: the step to run next.
The owner reports the latest snapshot its holder confirmed in its next step replies; the broker asks
for a new one only when every sub-DAG confirmed the last (``broker.replicas``), and says in
``keep_from`` which older ones may go.

After a SIGKILL the broker asks the survivors which snapshots they keep (``replicas``) and fetches, one
sub-DAG at a time, the newest step every sub-DAG has somewhere (``fetch_replica``): the lost sub-DAG's
from its holder, the others' from their own disks.

Files: ``<state dir>/replicas/<job id>/a<attempt>-s<sub-DAG>-<step>.<state|optim>.safetensors``, each
written to a temporary name and renamed; a snapshot is complete when both parts are there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fusionnet.errors import JobError

log = logging.getLogger("fusionnet.compnode.replicas")

PARTS = ("state", "optim")
_NAME = re.compile(r"^a(\d+)-s(\d+)-(\d+)\.(state|optim)\.safetensors$")


class ReplicaStore:
    """Snapshots on this compnode's disk, by job, attempt, sub-DAG and step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _job(self, job_id: str) -> Path:
        return self.folder / job_id

    def _path(self, job_id: str, attempt: int, subdag: int, step: int, part: str) -> Path:
        if part not in PARTS:
            raise JobError(f"replica part must be one of {PARTS}, got {part!r}")
        return self._job(job_id) / f"a{attempt}-s{subdag}-{step}.{part}.safetensors"

    def put(self, job_id: str, attempt: int, subdag: int, step: int, part: str, blob: bytes) -> bool:
        """Writes one part (atomically); True when the snapshot is complete."""
        path = self._path(job_id, attempt, subdag, step, part)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            f.write(blob)
        os.replace(tmp, path)
        return all(self._path(job_id, attempt, subdag, step, p).is_file() for p in PARTS)

    def read(self, job_id: str, attempt: int, subdag: int, step: int, part: str) -> bytes:
        path = self._path(job_id, attempt, subdag, step, part)
        if not path.is_file():
            raise JobError(f"job {job_id}: no snapshot of sub-DAG {subdag} at step {step} here")
        return path.read_bytes()

    def held(self, job_id: str, attempt: int) -> dict[int, list[int]]:
        """Complete snapshots of ``attempt``: sub-DAG -> steps (ascending)."""
        parts: dict[tuple[int, int], set[str]] = {}
        folder = self._job(job_id)
        for path in folder.iterdir() if folder.is_dir() else ():
            m = _NAME.match(path.name)
            if m and int(m[1]) == attempt:
                parts.setdefault((int(m[2]), int(m[3])), set()).add(m[4])
        out: dict[int, list[int]] = {}
        for (subdag, step), have in sorted(parts.items()):
            if have == set(PARTS):
                out.setdefault(subdag, []).append(step)
        return out

    def prune(self, job_id: str, keep_from: int) -> None:
        """Drops every snapshot of a step before ``keep_from`` (the broker no longer needs them)."""
        folder = self._job(job_id)
        for path in folder.iterdir() if folder.is_dir() else ():
            m = _NAME.match(path.name)
            if m and int(m[3]) < keep_from:
                path.unlink(missing_ok=True)

    def drop(self, job_id: str) -> None:
        shutil.rmtree(self._job(job_id), ignore_errors=True)


Pack = Awaitable[tuple[bytes, bytes, float]]  # -> state blob, optim blob, compute-thread seconds
Send = Callable[[int, str, bytes], Awaitable[bool]]  # step, part, blob -> complete at the holder


class Replicator:
    """One job's snapshots leaving this compnode: at most one in flight, in step order."""

    def __init__(
        self,
        store: ReplicaStore,
        job_id: str,
        attempt: int,
        subdag: int,
        send: Send,
        fault: Callable[[], None],
    ) -> None:
        self.store, self.job_id, self.attempt, self.subdag = store, job_id, attempt, subdag
        self._send, self._fault = send, fault
        self.confirmed: int | None = None  # the latest step the holder has complete
        self.seconds = 0.0  # compute-thread time of the latest snapshot
        self._task: asyncio.Task[None] | None = None

    def start(self, step: int, pack: Pack) -> None:
        """Snapshot before ``step`` (the state after ``step - 1``): ``pack`` was queued on the compute
        thread by the caller before it answered the step, so no later Update can run before it."""
        previous = self._task
        self._task = asyncio.ensure_future(self._replicate(step, pack, previous))

    async def _replicate(self, step: int, pack: Pack, previous: asyncio.Task[None] | None) -> None:
        try:
            state, optim, seconds = await pack
            self.seconds = seconds
            if previous is not None:  # in step order: the holder's newest is the owner's newest
                await asyncio.gather(previous, return_exceptions=True)
            self._fault()
            started = time.perf_counter()
            for part, blob in (("state", state), ("optim", optim)):
                await asyncio.to_thread(
                    self.store.put, self.job_id, self.attempt, self.subdag, step, part, blob
                )
            complete = False
            for part, blob in (("state", state), ("optim", optim)):
                complete = await self._send(step, part, blob)
            del state, optim
            if complete:
                self.confirmed = step if self.confirmed is None else max(self.confirmed, step)
                log.debug(
                    "job %s: snapshot of sub-DAG %d before step %d replicated in %.2f s",
                    self.job_id, self.subdag, step, time.perf_counter() - started,
                )  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the broker sees no confirmation and keeps the older replica
            log.warning("job %s: snapshot before step %d not replicated: %s", self.job_id, step, e)

    def take_seconds(self) -> float:
        """The latest snapshot's compute-thread time, reported once (the step's checkpoint overhead)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
