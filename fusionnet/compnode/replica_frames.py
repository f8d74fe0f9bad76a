"""Snapshot chunks over the direct data path (``compnode.replicas``).

A replica chunk is tens of MB. Over a hivemind P2P stream (protobuf in the ``p2pd`` daemon, then a
pydantic message) it cost 2.6x the CPU per byte of the direct TCP path, and 5x the wall time at
16 MiB (``benchmarks/transport.py``); on 2 cores that CPU is taken from the next step's compute. So a
chunk travels as one ``param`` tensor frame over the data path when the holder has one, on a
connection of its own (``DataPathClient`` for bulk), so that no activation frame queues behind it.
The ``replicate`` call that follows carries no bytes: it asks the holder to confirm the chunk once it
is on its disk, and its answer says whether the snapshot is complete there, as before.

Frame fields: ``step`` is the snapshot's step, ``microbatch`` the chunk's index, the name is
``replica/<attempt>/<sub-DAG>/<part>/<chunks>`` (the sub-DAG named: a compnode of an interleaved job
holds several, each with its own holder). The holder accepts one only for a sub-DAG whose replica the
assignment gives it, from that sub-DAG's compnode, for the current attempt, as raw bytes of a bounded
size; any other is refused, logged and counted with the job's refused frames, and the job goes on.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from fusionnet.compnode.replicas import PARTS
from fusionnet.errors import JobError, WireError
from fusionnet.wire.frames import TensorFrame

KIND = "param"
MAX_CHUNKS = 1 << 16  # as ``ReplicateRequest.chunks``
MAX_CHUNK_BYTES = 1 << 30  # the data path server's payload limit; a bigger chunk takes the RPC
LANDING_TIMEOUT = 120.0  # from the last byte in the owner's kernel to the chunk on the holder's disk
_NAME = re.compile(r"^replica/(\d{1,9})/(\d{1,6})/(state|optim)/(\d{1,6})$")
Landing = tuple[str, int, int, int, int]  # job id, attempt, sub-DAG, step, chunk


def replica_frame(
    job_id: str, sender: str, attempt: int, subdag: int, step: int, chunk: tuple[int, int, str], blob: object
) -> TensorFrame:
    """Chunk ``(index, count, part)`` of sub-DAG ``subdag``'s snapshot as a frame, without copying
    ``blob``."""
    index, count, part = chunk
    if isinstance(blob, bytes):  # read-only: torch would warn, and the frame may not write into it
        blob = bytearray(blob)
    tensor = torch.frombuffer(blob, dtype=torch.uint8)  # type: ignore[call-overload]
    return TensorFrame(
        job_id=job_id,
        sender=sender,
        kind=KIND,
        step=step,
        microbatch=index,
        name=f"replica/{attempt}/{subdag}/{part}/{count}",
        tensor=tensor,
    )


@dataclass(frozen=True)
class ReplicaChunkFrame:
    """A checked replica frame: where its chunk goes in the ``ReplicaStore``."""

    subdag: int
    attempt: int
    step: int
    chunk: tuple[int, int, str]  # index, count, part
    blob: memoryview


def check_replica_frame(
    frame: TensorFrame,
    attempt: int,
    own: Collection[int],
    peer_of: Sequence[str],
    holders: list[int] | None,
) -> ReplicaChunkFrame:
    """``WireError`` saying what is wrong unless ``frame`` is a chunk this compnode keeps for its sender:
    ``own`` are our sub-DAGs, ``peer_of`` the compnode of each of the job's sub-DAGs."""
    m = _NAME.fullmatch(frame.name)
    if m is None:
        raise WireError(
            f"replica frame name {frame.name[:80]!r} is not replica/<attempt>/<sub-DAG>/<part>/<chunks>"
        )
    frame_attempt, subdag, part, count = int(m[1]), int(m[2]), m[3], int(m[4])
    if subdag >= len(peer_of) or peer_of[subdag] != frame.sender:
        raise WireError(f"peer {frame.sender} does not hold sub-DAG {subdag} of this job")
    if holders is None or subdag >= len(holders) or subdag in own or holders[subdag] not in own:
        raise WireError(f"this compnode keeps no replica of sub-DAG {subdag}")
    if frame_attempt != attempt:
        raise WireError(f"snapshot of attempt {frame_attempt}, this is {attempt}")
    if part not in PARTS or not 0 < count <= MAX_CHUNKS or not 0 <= frame.microbatch < count:
        raise WireError(f"chunk {frame.microbatch} of {count} ({part!r}) is not one")
    t = frame.tensor
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_CHUNK_BYTES:
        got = f"{t.dtype} {list(t.shape)}"
        raise WireError(f"replica chunk must be at most {MAX_CHUNK_BYTES} raw bytes, got {got}")
    chunk = (frame.microbatch, count, part)
    return ReplicaChunkFrame(subdag, attempt, frame.step, chunk, memoryview(t.numpy()))


@dataclass
class Landings:
    """Chunks that came over the data path, until the owner's ``replicate`` call confirms each."""

    _waits: dict[Landing, asyncio.Future[None]] = field(default_factory=dict)

    def _future(self, key: Landing) -> asyncio.Future[None]:
        if key not in self._waits:
            self._waits[key] = asyncio.get_running_loop().create_future()
        return self._waits[key]

    def landed(self, key: Landing, error: BaseException | None = None) -> None:
        """The chunk is on disk (or could not be stored: ``error``)."""
        future = self._future(key)
        if future.done():  # a resent chunk: the newest outcome counts
            future = self._waits[key] = asyncio.get_running_loop().create_future()
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    async def wait(self, key: Landing, timeout: float | None = None) -> None:
        """Until ``key`` has landed; ``JobError`` if it did not within ``timeout`` (default
        ``LANDING_TIMEOUT``) or was not stored."""
        timeout = LANDING_TIMEOUT if timeout is None else timeout
        future = self._future(key)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise JobError(
                f"job {key[0]}: chunk {key[4]} of sub-DAG {key[2]}'s snapshot before step {key[3]} "
                f"did not arrive over the data path within {timeout:g} s"
            ) from None
        finally:
            if self._waits.get(key) is future and future.done():
                del self._waits[key]

    def forget(self, job_id: str) -> None:
        for key in [k for k in self._waits if k[0] == job_id]:
            future = self._waits.pop(key)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # retrieved: no "never retrieved" warning for a failed store
