"""Replicas of sub-DAG state on compnodes, so that failover checkpoints never pass through the broker
(FusionAI 3.2: supernodes keep parameter copies; issue 11: the broker's memory and traffic stay
independent of the model's size).

When the broker asks for a snapshot in a ``step`` request, the compnode copies its sub-DAG's state
and optimizer state as that step left them (``compnode.snapshots``: on the compute thread right after
the step, before any later Update can change them; on CUDA the copy runs beside the next step's FP and
BP; the step's reply does not wait for it), keeps the blobs on its own disk and sends them in the
background to the compnode the assignment names as the sub-DAG's replica holder (``replicate``). A
compnode holding interleaved chunks does so for each of them: one ``Replicator`` per sub-DAG, each
towards its own holder. The holder keeps them on its disk. A snapshot is named by the checkpoint
step it is: the step to run next. The owner reports the latest snapshot its holder confirmed in its
next step replies; the broker asks for a new one only when every sub-DAG confirmed the last
(``broker.replicas``), and says in ``keep_from`` which older ones may go.

After a SIGKILL the broker asks the survivors which snapshots they keep (``replicas``) and fetches, one
sub-DAG at a time, the newest step every sub-DAG has somewhere (``fetch_replica``): the lost sub-DAG's
from its holder, the others' from their own disks.

Files: ``<state dir>/replicas/<job id>/a<attempt>-s<sub-DAG>-<step>.<i>of<n>.<state|optim>.safetensors``,
a snapshot in chunks of at most ``CHUNK_BYTES`` of tensors (so no message, on either side, holds a
whole sub-DAG), each written to a temporary name and renamed; complete when all ``n`` are there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import torch

from fusionnet.errors import JobError
from fusionnet.results.slice_stream import SliceStream

log = logging.getLogger("fusionnet.compnode.replicas")

PARTS = ("state", "optim")
# Free disk a chunk must leave (the smaller of 1 GiB and 5 % of the disk): the owner of a sub-DAG may send
# any number of chunks, and a full disk would take the daemon's state, logs and other jobs with it.
DISK_RESERVE_BYTES = 1 << 30
DISK_RESERVE_SHARE = 0.05
CHUNK_BYTES = 64 << 20  # tensors per ``replicate`` message (one bigger tensor goes alone)
FETCH_BYTES = 32 << 20  # what one ``fetch_replica`` answer carries at most (a byte range of a chunk)
Chunk = tuple[str, bytes | bytearray | memoryview]  # (part, safetensors blob)
_NAME = re.compile(r"^a(\d+)-s(\d+)-(\d+)\.(\d+)of(\d+)\.(state|optim)\.safetensors$")


def pack_chunks(part: str, tensors: Mapping[str, torch.Tensor], limit: int = CHUNK_BYTES) -> list[Chunk]:
    """``tensors`` as safetensors blobs of at most ``limit`` bytes of tensors each (in key order), each
    tensor copied once (``SliceStream.packed``)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return [(part, SliceStream(tensors, g).packed()) for g in groups if g or part == "state"]


class ReplicaStore:
    """Snapshots on this compnode's disk, by job, attempt, sub-DAG, step and chunk."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _job(self, job_id: str) -> Path:
        return self.folder / job_id

    def _chunks(self, job_id: str) -> list[tuple[Path, re.Match[str]]]:
        folder = self._job(job_id)
        out = []
        for path in folder.iterdir() if folder.is_dir() else ():
            m = _NAME.fullmatch(path.name)
            if m:
                out.append((path, m))
        return out

    def put(
        self,
        job_id: str,
        attempt: int,
        subdag: int,
        step: int,
        chunk: tuple[int, int, str],
        blob: bytes | bytearray | memoryview,
    ) -> bool:
        """Writes chunk ``(index, count, part)`` (atomically); True when the snapshot is complete."""
        index, count, part = chunk
        if part not in PARTS or not 0 <= index < count:
            raise JobError(f"replica chunk {index} of {count} ({part!r}) is not one")
        folder = self._job(job_id)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        disk = shutil.disk_usage(folder)
        reserve = min(DISK_RESERVE_BYTES, int(disk.total * DISK_RESERVE_SHARE))
        size = len(memoryview(blob))
        if disk.free - size < reserve:
            raise JobError(
                f"job {job_id}: a replica chunk of {size} bytes would leave {max(disk.free - size, 0)} bytes "
                f"free on the disk of {self.folder}, under the {reserve} kept free"
            )
        path = folder / f"a{attempt}-s{subdag}-{step}.{index:05d}of{count:05d}.{part}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            f.write(blob)
        os.replace(tmp, path)
        return step in self.held(job_id, attempt).get(subdag, [])

    def _snapshot(
        self, job_id: str, attempt: int, subdag: int, step: int
    ) -> dict[int, tuple[Path, str, int]]:
        """Chunk index -> (file, part, count) of one snapshot."""
        return {
            int(m[4]): (path, m[6], int(m[5]))
            for path, m in self._chunks(job_id)
            if (int(m[1]), int(m[2]), int(m[3])) == (attempt, subdag, step)
        }

    def read(
        self, job_id: str, attempt: int, subdag: int, step: int, chunk: int, offset: int = 0
    ) -> tuple[str, int, bytes, int]:
        """(part, chunk count, bytes from ``offset`` on (at most ``FETCH_BYTES``), file size) of one
        chunk: a broker fetching a snapshot gets bounded answers however big one tensor of it is."""
        found = self._snapshot(job_id, attempt, subdag, step).get(chunk)
        if found is None:
            raise JobError(
                f"job {job_id}: no snapshot of sub-DAG {subdag} at step {step} (chunk {chunk}) here"
            )
        path, part, count = found
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if offset > size:
                raise JobError(f"job {job_id}: offset {offset} past the {size} bytes of chunk {chunk}")
            f.seek(offset)
            return part, count, f.read(FETCH_BYTES), size

    def held(self, job_id: str, attempt: int) -> dict[int, list[int]]:
        """Complete snapshots of ``attempt``: sub-DAG -> steps (ascending)."""
        seen: dict[tuple[int, int], tuple[set[int], int]] = {}
        for _path, m in self._chunks(job_id):
            if int(m[1]) == attempt:
                chunks, _ = seen.setdefault((int(m[2]), int(m[3])), (set(), int(m[5])))
                chunks.add(int(m[4]))
        out: dict[int, list[int]] = {}
        for (subdag, step), (chunks, count) in sorted(seen.items()):
            if len(chunks) == count:
                out.setdefault(subdag, []).append(step)
        return out

    def prune(self, job_id: str, keep_from: int) -> None:
        """Drops every snapshot of a step before ``keep_from`` (the broker no longer needs them)."""
        for path, m in self._chunks(job_id):
            if int(m[3]) < keep_from:
                path.unlink(missing_ok=True)

    def drop(self, job_id: str) -> None:
        shutil.rmtree(self._job(job_id), ignore_errors=True)

    def drop_leftovers(self) -> list[str]:
        """Deletes what an earlier process of this state dir left (a SIGKILLed compnode restarted with
        its identity): the jobs it held were released with it, and snapshots answer only for a job
        held now (``replica_rpc``), so nobody could ever ask for them; without this each crash left up
        to two sub-DAGs' parameters and optimizer state on the disk for good. The job ids dropped."""
        if not self.folder.is_dir():
            return []
        gone = sorted(p.name for p in self.folder.iterdir())
        for name in gone:
            path = self.folder / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return gone


Pack = Awaitable[tuple[list[Chunk], float]]  # -> chunks, compute-thread seconds
Send = Callable[[int, int, int, Chunk], Awaitable[bool]]  # step, index, count, chunk -> complete there


class Replicator:
    """One job's snapshots leaving this compnode: in step order, one chunk at a time."""

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
        self.superseded = 0  # snapshots dropped before they left: a newer one took their place
        self._head: asyncio.Task[None] | None = None  # the snapshot on its way (packed, stored, sent)
        self._next: asyncio.Task[None] | None = None  # at most one waiting behind it

    def start(self, step: int, pack: Pack) -> None:
        """Snapshot before ``step`` (the state after ``step - 1``): ``pack`` was queued on the compute
        thread by the caller before it answered the step, so no later Update can run before it.

        Snapshots leave in step order, one at a time; one asked for while another is on its way waits
        behind it, and replaces any that was still waiting there: on a slow (or paced) link a round can
        take longer than the broker waits before asking again, and a queue of full-state copies would
        hold memory and the link for states nobody needs any more (the holder wants the newest)."""
        if self._head is None or self._head.done():
            self._head, self._next = self._next, None
        if self._head is None or self._head.done():
            self._head = asyncio.ensure_future(self._replicate(step, pack, None))
            return
        if self._next is not None and not self._next.done():
            self._next.cancel()
            self.superseded += 1
        self._next = asyncio.ensure_future(self._replicate(step, pack, self._head))

    async def wait(self) -> None:
        """Until the snapshots started so far have left (or failed, or were superseded)."""
        for task in (self._head, self._next):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)

    async def _replicate(self, step: int, pack: Pack, previous: asyncio.Task[None] | None) -> None:
        try:
            chunks, self.seconds = await pack
            if previous is not None:  # in step order: the holder's newest is the owner's newest
                await asyncio.gather(previous, return_exceptions=True)
            self._fault()
            started = time.perf_counter()
            n = len(chunks)
            for i, chunk in enumerate(chunks):
                await asyncio.to_thread(
                    self.store.put, self.job_id, self.attempt, self.subdag, step, (i, n, chunk[0]), chunk[1]
                )
            complete = False
            while chunks:
                chunk = chunks.pop(0)  # each chunk's memory goes once it has left
                complete = await self._send(step, n - len(chunks) - 1, n, chunk)
                del chunk
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
        for task in (self._head, self._next):
            if task is not None:
                task.cancel()
