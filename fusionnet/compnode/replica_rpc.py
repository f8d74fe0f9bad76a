"""The sub-task service's part in state replication (``compnode.replicas``): snapshots after the steps
the broker names, the ``replicate`` calls between a job's compnodes, and the broker's ``replicas`` and
``fetch_replica`` after a failure. A mixin of ``tasks.SubtaskService``, which owns the jobs.

Who may call: ``replicate`` only the job's compnode of that sub-DAG, and only to the compnode the
assignment names as its holder, for the current attempt; ``replicas`` and ``fetch_replica`` only the
broker that assigned the job (``SubtaskService._job``).

A chunk goes over the direct data path when the holder has one (``compnode.replica_frames``), and in
the ``replicate`` call itself (a P2P stream) otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from fusionnet.compnode.replica_frames import (
    MAX_CHUNK_BYTES,
    Landings,
    check_replica_frame,
    replica_frame,
)
from fusionnet.compnode.replicas import Chunk, ReplicaStore, Replicator
from fusionnet.errors import JobError, WireError
from fusionnet.messages.base import handles
from fusionnet.messages.compnode_rpc import (
    CompnodeClient,
    JobRequest,
    ReplicaChunk,
    ReplicaRequest,
    ReplicasReply,
    ReplicateReply,
    ReplicateRequest,
    StepRequest,
)
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.frames import TensorFrame

if TYPE_CHECKING:
    from fusionnet.compnode.job_host import HeldJob
    from fusionnet.compnode.tcp_down import DownPeers
    from fusionnet.wire.datapath import DataPathClient

log = logging.getLogger("fusionnet.compnode.replicas")

REPLICATE_TIMEOUT = 600.0  # one part of a snapshot (hundreds of MB on a slow link)


class ReplicaRPC:
    jobs: dict[str, HeldJob]
    node: Any  # CompnodeDaemon
    fault: Any  # FaultPoint | None
    replicas: ReplicaStore
    landings: Landings
    bulk: DataPathClient | None  # a connection of its own per holder, beside the activations'
    _tcp_down: DownPeers
    replica_refused: dict[str, int]  # job id -> replica frames refused

    def _job(self, request: JobRequest, context: RPCContext) -> HeldJob:
        raise NotImplementedError  # SubtaskService's

    async def send_direct(
        self, client: DataPathClient, job: HeldJob, dst: int, frame: TensorFrame, otherwise: str
    ) -> bool:
        raise NotImplementedError  # SubtaskService's

    def _replicator(self, job: HeldJob, subdag: int | None = None) -> Replicator | None:
        """The snapshots of our sub-DAG ``subdag`` (default: our first) leaving for its holder."""
        holders = job.replica_holders
        if holders is None or job.spec.task != "train":
            return None
        i = job.index if subdag is None else subdag
        if i not in job.replicators:
            holder_index = holders[i]
            holder = job.peers[holder_index].peer_id
            client = CompnodeClient(self.node.call)

            async def send(step: int, index: int, count: int, chunk: Chunk) -> bool:
                where = (index, count, chunk[0])
                landed = await self._send_chunk_frame(job, i, holder_index, step, where, chunk[1])
                request = ReplicateRequest(
                    job_id=job.job_id,
                    attempt=job.attempt,
                    subdag=i,
                    step=step,
                    chunk=index,
                    chunks=count,
                    part=chunk[0],
                    blob=b"" if landed else bytes(chunk[1]),
                    landed=landed,
                )
                reply = await client.call_replicate(holder, request, timeout=REPLICATE_TIMEOUT)
                return reply.complete

            def fault() -> None:
                if self.fault is not None:
                    self.fault.hit("sync")

            job.replicators[i] = Replicator(self.replicas, job.job_id, job.attempt, i, send, fault)
        return job.replicators[i]

    async def _send_chunk_frame(
        self, job: HeldJob, subdag: int, holder: int, step: int, chunk: tuple[int, int, str], blob: object
    ) -> bool:
        """Sends a chunk of ``subdag``'s snapshot to its holder over the data path; False when it must
        go in the RPC instead (no data path address, the path is down, or the chunk is bigger than a
        frame may be)."""
        if self.bulk is None or len(memoryview(blob)) > MAX_CHUNK_BYTES:  # type: ignore[arg-type]
            return False
        frame = replica_frame(job.job_id, self.node.peer_id, job.attempt, subdag, step, chunk, blob)
        return await self.send_direct(self.bulk, job, holder, frame, "snapshots go by RPC")

    async def on_replica_frame(self, job: HeldJob, frame: TensorFrame) -> None:
        """A snapshot chunk a peer sent us over the data path: checked, then kept on disk."""
        try:
            peer_of = [p.peer_id for p in job.peers]
            got = check_replica_frame(frame, job.attempt, job.indices, peer_of, job.replica_holders)
        except WireError as e:
            self.replica_refused[job.job_id] = self.replica_refused.get(job.job_id, 0) + 1
            name, sender = frame.name[:80], frame.sender
            log.warning("job %s: refused replica frame %r from %s: %s", job.job_id, name, sender, e)
            return
        put = partial(self.replicas.put, job.job_id, got.attempt, got.subdag, got.step, got.chunk, got.blob)
        key = (job.job_id, got.attempt, got.subdag, got.step, got.chunk[0])
        try:
            await asyncio.to_thread(put)
        except Exception as e:  # a full disk: the owner's confirming call fails with the reason
            log.warning("job %s: could not keep a replica chunk of sub-DAG %d: %s", job.job_id, got.subdag, e)
            self.landings.landed(key, JobError(f"job {job.job_id}: the replica chunk was not stored: {e}"))
            return
        self.landings.landed(key)

    def after_step(self, job: HeldJob, request: StepRequest) -> None:
        """Called with the job's lock held, right after every sub-DAG of ours ran the step: queues each
        one's snapshot on the compute thread before anything else can be (module docstring of
        ``compnode.replicas``)."""
        if self._replicator(job) is None:
            return
        if request.keep_from is not None:
            self.replicas.prune(job.job_id, request.keep_from)
        if request.snapshot:
            for i in job.indices:
                replicator = self._replicator(job, i)
                assert replicator is not None
                self._pace_snapshots(job, i, request.replica_pace)
                replicator.start(request.step + 1, job.host.snapshot(i))

    def _pace_snapshots(self, job: HeldJob, subdag: int, pace: float | None) -> None:
        """Caps the snapshot connection to ``subdag``'s holder at the broker's ``pace`` (bytes/s)."""
        holders = job.replica_holders
        if self.bulk is None or holders is None:
            return
        holder = job.peers[holders[subdag]]
        if holder.data_address:
            self.bulk.pace(holder.data_address, pace)

    def forget_replicas(self, job: HeldJob) -> None:
        for replicator in job.replicators.values():
            replicator.cancel()
        self.replicas.drop(job.job_id)
        self.landings.forget(job.job_id)
        self.replica_refused.pop(job.job_id, None)

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(ReplicateRequest)
    async def rpc_replicate(self, request: ReplicateRequest, context: RPCContext) -> ReplicateReply:
        job = self.jobs.get(request.job_id)
        if job is None:
            raise JobError(f"no job {request.job_id!r} is assigned to this compnode")
        holders, i = job.replica_holders, request.subdag
        if request.attempt != job.attempt:
            raise JobError(f"job {job.job_id}: snapshot of attempt {request.attempt}, this is {job.attempt}")
        if holders is None or i >= len(job.peers) or i in job.indices or holders[i] not in job.indices:
            raise JobError(f"job {job.job_id}: this compnode keeps no replica of sub-DAG {i}")
        if context.remote_peer != job.peers[i].peer_id:
            raise JobError(f"job {job.job_id}: only the compnode of sub-DAG {i} may replicate it")
        if request.part not in ("state", "optim"):
            raise JobError(f"replicate: part must be 'state' or 'optim', got {request.part!r}")
        chunk = (request.chunk, request.chunks, request.part)
        if request.landed:  # the bytes came over the data path: confirm once they are on disk
            await self.landings.wait((job.job_id, job.attempt, i, request.step, request.chunk))
            held = await asyncio.to_thread(self.replicas.held, job.job_id, job.attempt)
            return ReplicateReply(complete=request.step in held.get(i, []))
        put = partial(self.replicas.put, job.job_id, job.attempt, i, request.step, chunk, request.blob)
        return ReplicateReply(complete=await asyncio.to_thread(put))

    @handles(JobRequest)
    async def rpc_replicas(self, request: JobRequest, context: RPCContext) -> ReplicasReply:
        job = self._job(request, context)
        held = await asyncio.to_thread(self.replicas.held, job.job_id, job.attempt)
        return ReplicasReply(held={str(k): v for k, v in held.items()})

    @handles(ReplicaRequest)
    async def rpc_fetch_replica(self, request: ReplicaRequest, context: RPCContext) -> ReplicaChunk:
        job = self._job(request, context)
        where = (job.job_id, job.attempt, request.subdag, request.step, request.chunk, request.offset)
        part, chunks, data, size = await asyncio.to_thread(self.replicas.read, *where)
        return ReplicaChunk(part=part, chunks=chunks, blob=data, size=size)
