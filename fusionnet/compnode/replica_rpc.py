"""The sub-task service's part in state replication (``compnode.replicas``): snapshots after the steps
the broker names, the ``replicate`` calls between a job's compnodes, and the broker's ``replicas`` and
``fetch_replica`` after a failure. A mixin of ``tasks.SubtaskService``, which owns the jobs.

Who may call: ``replicate`` only the job's compnode of that sub-DAG, and only to the compnode the
assignment names as its holder, for the current attempt; ``replicas`` and ``fetch_replica`` only the
broker that assigned the job (``SubtaskService._job``).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

from fusionnet.compnode.replicas import Chunk, ReplicaStore, Replicator
from fusionnet.errors import JobError
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

if TYPE_CHECKING:
    from fusionnet.compnode.job_host import HeldJob

REPLICATE_TIMEOUT = 600.0  # one part of a snapshot (hundreds of MB on a slow link)


class ReplicaRPC:
    jobs: dict[str, HeldJob]
    node: Any  # CompnodeDaemon
    fault: Any  # FaultPoint | None
    replicas: ReplicaStore

    def _job(self, request: JobRequest, context: RPCContext) -> HeldJob:
        raise NotImplementedError  # SubtaskService's

    def _replicator(self, job: HeldJob) -> Replicator | None:
        holders = job.replica_holders
        if holders is None or job.spec.task != "train":
            return None
        if job.replicator is None:
            holder = job.peers[holders[job.index]].peer_id
            client = CompnodeClient(self.node.call)

            async def send(step: int, index: int, count: int, chunk: Chunk) -> bool:
                request = ReplicateRequest(
                    job_id=job.job_id,
                    attempt=job.attempt,
                    subdag=job.index,
                    step=step,
                    chunk=index,
                    chunks=count,
                    part=chunk[0],
                    blob=chunk[1],
                )
                reply = await client.call_replicate(holder, request, timeout=REPLICATE_TIMEOUT)
                return reply.complete

            def fault() -> None:
                if self.fault is not None:
                    self.fault.hit("sync")

            job.replicator = Replicator(self.replicas, job.job_id, job.attempt, job.index, send, fault)
        return job.replicator

    def after_step(self, job: HeldJob, request: StepRequest) -> None:
        """Called with the job's lock held, right after the step ran: queues the snapshot on the compute
        thread before anything else can be (module docstring of ``compnode.replicas``)."""
        replicator = self._replicator(job)
        if replicator is None:
            return
        if request.keep_from is not None:
            self.replicas.prune(job.job_id, request.keep_from)
        if request.snapshot:
            replicator.start(request.step + 1, job.host.snapshot())

    def forget_replicas(self, job: HeldJob) -> None:
        if job.replicator is not None:
            job.replicator.cancel()
        self.replicas.drop(job.job_id)

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(ReplicateRequest)
    async def rpc_replicate(self, request: ReplicateRequest, context: RPCContext) -> ReplicateReply:
        job = self.jobs.get(request.job_id)
        if job is None:
            raise JobError(f"no job {request.job_id!r} is assigned to this compnode")
        holders, i = job.replica_holders, request.subdag
        if request.attempt != job.attempt:
            raise JobError(f"job {job.job_id}: snapshot of attempt {request.attempt}, this is {job.attempt}")
        if holders is None or i >= len(job.peers) or i == job.index or holders[i] != job.index:
            raise JobError(f"job {job.job_id}: this compnode keeps no replica of sub-DAG {i}")
        if context.remote_peer != job.peers[i].peer_id:
            raise JobError(f"job {job.job_id}: only the compnode of sub-DAG {i} may replicate it")
        if request.part not in ("state", "optim"):
            raise JobError(f"replicate: part must be 'state' or 'optim', got {request.part!r}")
        chunk = (request.chunk, request.chunks, request.part)
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
