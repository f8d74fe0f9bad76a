"""A compnode's intake of assignments (a mixin of ``tasks.SubtaskService``): ``stage_state`` takes the
parts of a slice ahead of its ``assign``; ``assign`` builds the job's sub-DAG where it will run (a sandbox
worker, or the compute thread with ``--sandbox off``), registers it with the data paths and holds it.

Only a trusted broker may assign (``trust.py``). A job already held from the same broker and round
answers a repeated call the same way, takes one more interleaved chunk, or is replaced by a newer
round. A release that comes while the job's sub-DAG is still being built (``Build``) drops the build
when it ends: a job cancelled while a worker forked would otherwise be held by nobody's will.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fusionnet.compnode.assignment_intake import build_assignment
from fusionnet.compnode.faults import FaultPoint, fault_hooks
from fusionnet.compnode.job_host import HeldJob, JobHost
from fusionnet.compnode.linkprobe import LinkProber
from fusionnet.compnode.sandbox_client import SandboxedJob
from fusionnet.compnode.sandbox_pool import SandboxPool
from fusionnet.compnode.staging import StateStaging
from fusionnet.compnode.throttle import throttle_hooks
from fusionnet.compnode.trust import TrustedBrokers
from fusionnet.errors import JobError
from fusionnet.messages.base import handles
from fusionnet.messages.compnode_rpc import AssignReply, AssignRequest, StageStateReply, StageStateRequest
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import OTHER_LANES

log = logging.getLogger("fusionnet.compnode.tasks")

MAX_JOBS = 16  # assignments held at once; a broker gone wild cannot exhaust our memory


@dataclass
class Build:
    """An assignment being built here: by which broker, and whether that broker has released it since."""

    broker: str
    released: str | None = None  # the release's reason


class AssignRPC:
    node: Any  # CompnodeDaemon
    jobs: dict[str, HeldJob]
    _locks: dict[str, asyncio.Lock]
    _heard: dict[str, float]
    _probers: dict[str, LinkProber]
    _building: dict[str, list[Build]]
    staging: StateStaging
    trust: TrustedBrokers
    sandboxes: SandboxPool | None
    fault: FaultPoint | None
    server: Any  # DataPathServer
    p2p: Any  # P2PDataPath

    if TYPE_CHECKING:  # ``tasks.SubtaskService`` and ``replica_rpc.ReplicaRPC``, beside this mixin

        async def _send(self, job: HeldJob, dst: int, frame: TensorFrame) -> None: ...

        def _release(self, job_id: str, why: str) -> None: ...

        def _set_load(self) -> None: ...

        def on_replica_frame(self, job: HeldJob, frame: TensorFrame) -> Any: ...

    @handles(StageStateRequest)
    async def rpc_stage_state(self, request: StageStateRequest, context: RPCContext) -> StageStateReply:
        """One part of a slice that its ``assign`` will name (``compnode.staging``)."""
        self.trust.check(context.remote_peer, "stage_state")
        return StageStateReply(received=self.staging.add(context.remote_peer, request))

    @handles(AssignRequest)
    async def rpc_assign(self, request: AssignRequest, context: RPCContext) -> AssignReply:
        self.trust.check(context.remote_peer, "assign")
        job_id = request.job_id
        if job_id in self.jobs:
            held = self.jobs[job_id]
            if held.broker != context.remote_peer:
                raise JobError(f"job {job_id} is already assigned here by {held.broker}")
            if request.attempt == held.attempt and request.subdag == held.index:
                return AssignReply(subdag=held.index, nodes=held.nodes)  # a repeated request
            if request.attempt == held.attempt and request.subdag in held.indices:
                return await self._assign_chunk(held, request, context)  # interleaved: one more
            # A new round of the same job (failover, re-plan, restarted broker): the old one is void.
            self._release(job_id, f"superseded by attempt {request.attempt}")
        if len(self.jobs) >= MAX_JOBS:
            raise JobError(f"this compnode already runs {MAX_JOBS} jobs")
        staged = [n for n in (request.staged_state, request.staged_optim) if n is not None]
        request = self.staging.resolve(context.remote_peer, request)
        if staged:
            log.info("job %s: sub-DAG %d slice staged ahead (%d bytes)", job_id, request.subdag, sum(staged))
        holder: dict[str, HeldJob] = {}

        async def send(dst: int, frame: TensorFrame) -> None:
            await self._send(holder["job"], dst, frame)

        building = Build(context.remote_peer)
        self._building.setdefault(job_id, []).append(building)
        self._set_load()
        try:
            job = await self._build(request, context.remote_peer, send)
        finally:
            builds = self._building[job_id]
            builds.remove(building)
            if not builds:
                del self._building[job_id]
            self._set_load()
        if building.released is not None:
            closing = asyncio.ensure_future(job.host.close(building.released))  # its sandbox worker stops
            closing.add_done_callback(lambda f: f.cancelled() or f.exception())
            why = f"released by its broker ({building.released}) while sub-DAG {job.index} was being built"
            log.info("job %s: %s: dropped", job_id, why)
            raise JobError(f"job {job_id}: {why} here; dropped")
        holder["job"] = job
        allowed = job.allowed_senders()
        prober = LinkProber(job.job_id, self.node.peer_id, job.subdag_of_peer(), send)
        self._probers[job.job_id] = prober

        def router(path_name: str) -> Any:
            def route(frame: TensorFrame) -> Any:  # probes: prober; snapshots: disk; values: executor
                nbytes = frame.tensor.numel() * frame.tensor.element_size()
                self.node.metrics.count_data(path_name, "received", nbytes)  # as ``_send`` counts: probes too
                if frame.kind == "ctrl":
                    return prober.on_frame(frame)
                if frame.kind == "param":
                    return self.on_replica_frame(job, frame)
                return job.host.deliver(frame)

            return route

        for path_name, path in (("tcp", self.server), ("p2p", self.p2p)):
            assert path is not None
            keys = job.keys_by_sender()
            # A worker that reads its peers' values owns the lane their workers number in (``handoff``).
            lanes = OTHER_LANES if isinstance(job.host, SandboxedJob) and job.host.reads_values else None
            path.register_job(job.job_id, keys, allowed, router(path_name), job.spec.wire_encryption, lanes)
        self.jobs[job.job_id] = job
        self._locks[job.job_id] = asyncio.Lock()
        self._heard[job.job_id] = time.monotonic()
        self._set_load()
        log.info(
            "job %s: sub-DAG %d assigned by %s (%d nodes, %d parameters)",
            job.job_id,
            job.index,
            context.remote_peer,
            job.nodes,
            job.params,
        )
        serves = isinstance(job.host, SandboxedJob) and job.host.serves_direct
        if isinstance(job.host, SandboxedJob):
            job.host.on_served = self._served_direct
        return AssignReply(subdag=job.index, nodes=job.nodes, serves_direct=serves)

    def _served_direct(self, fp_seconds: list[float], failed: int) -> None:
        """Batches a worker served straight from the broker (``worker_serves``), counted as the
        ``serve_step`` RPC counts its own."""
        metrics = self.node.metrics
        for seconds in fp_seconds:
            metrics.observe_compute("fp", seconds)
            metrics.count_subtask("succeeded")
        for _ in range(failed):
            metrics.count_subtask("failed")

    async def _assign_chunk(self, held: HeldJob, request: AssignRequest, context: RPCContext) -> AssignReply:
        """Another sub-DAG of a job and round we hold already (interleaved-1f1b: compnode d holds
        d, p + d, ...), built into the same host: its worker runs all of them in one loop."""
        if request.peers != held.peers or request.spec != held.spec:
            raise JobError(f"job {held.job_id}: sub-DAG {request.subdag}'s assignment disagrees with ours")
        request = self.staging.resolve(context.remote_peer, request)
        self.node.make_way_for_work()
        if isinstance(held.host, JobHost):  # --sandbox off: built here, on the compute thread
            build = partial(
                build_assignment,
                request,
                own_peer_id=self.node.peer_id,
                broker=held.broker,
                send=partial(self._send, held),
                device=self.node.device,
            )
            built = await asyncio.get_running_loop().run_in_executor(self.node.compute, build)
            for hook in (*fault_hooks(self.fault), *throttle_hooks(self.node.settings.slowdown)):
                built.executor.hooks.add(hook)
            held.host.add(built)
            nodes, params = len(built.subdag.nodes), len(built.subdag.params)
        else:
            nodes, params = await held.host.assign_more(request)  # type: ignore[attr-defined]
        held.add_subdag(nodes, params)
        log.info("job %s: sub-DAG %d assigned too (%d nodes)", held.job_id, request.subdag, nodes)
        return AssignReply(subdag=request.subdag, nodes=nodes)

    async def _build(self, request: AssignRequest, broker: str, send: Any) -> HeldJob:
        """The assignment decoded, checked and built where it will run: in a sandbox worker, or on the
        compute thread (placing the state on the device is compute-stream work). A first start-up's
        calibration on that thread gives way at once instead of delaying the job."""
        self.node.make_way_for_work()
        if self.sandboxes is not None:
            sandboxed = SandboxedJob(
                self.sandboxes,
                self.node.peer_id,
                request.job_id,
                request.subdag,
                send,
                counted=partial(self.node.metrics.count_data, "tcp"),
                refusals=self.node.metrics.count_refusal,
            )
            try:
                nodes, params = await sandboxed.assign(request, broker, str(self.node.device))
            except BaseException:
                await sandboxed.close("its assignment was refused")
                raise
            return HeldJob.of(request, broker, nodes, params, sandboxed)
        build = partial(
            build_assignment,
            request,
            own_peer_id=self.node.peer_id,
            broker=broker,
            send=send,
            device=self.node.device,
        )
        built = await asyncio.get_running_loop().run_in_executor(self.node.compute, build)
        for hook in (*fault_hooks(self.fault), *throttle_hooks(self.node.settings.slowdown)):
            built.executor.hooks.add(hook)
        host = JobHost(built, self.node.compute)
        return HeldJob.of(request, broker, len(built.subdag.nodes), len(built.subdag.params), host)
