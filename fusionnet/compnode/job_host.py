"""What a compnode does with one assigned sub-DAG once it is built: steps, request batches, state
collection, snapshots and received values, each an async call.

``JobHost`` runs them on a ``JobAssignment`` with a compute pool, in the process that holds the
executor: the compnode daemon itself (``--sandbox off``) or the job's sandbox worker
(``compnode.sandbox_worker``), where the daemon reaches it through ``compnode.sandbox_client``'s
``SandboxedJob``, which has the same calls. ``HeldJob`` is what the daemon keeps of an assignment
either way: who may drive it, its peers, its round, and the host its calls go to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from fusionnet.compnode.assignment_intake import JobAssignment
from fusionnet.compnode.device_step import DeviceSteps
from fusionnet.compnode.replicas import Chunk, Replicator
from fusionnet.compnode.serve_steps import StepOrder, serve_step
from fusionnet.compnode.snapshots import Snapshotter
from fusionnet.compnode.value_frames import split_route
from fusionnet.errors import JobError, WireError
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.compnode_rpc import (
    AssignRequest,
    CollectReply,
    JobPeer,
    StepReply,
    first_subdag_of_others,
)
from fusionnet.messages.jobwire import RunSpec
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.results.assemble import output_tensors
from fusionnet.results.slice_stream import SliceStream
from fusionnet.wire.frames import TensorFrame

COLLECT_CHUNK_BYTES = 32 << 20  # bytes per ``collect`` answer: a byte range of one safetensors stream
KEPT_REPLIES = 4  # step answers kept for repeated requests


@dataclass
class StepOutcome:
    """One step of a sub-DAG as the broker's ``step`` reply needs it (outputs packed)."""

    loss: float | None
    fp_seconds: float
    bp_seconds: float
    update_seconds: float
    outputs: bytes | None
    refused: int  # values refused by the channel's checks so far
    activation_peak_bytes: int = 0
    sent_bytes: int = 0


class Host(Protocol):
    """The calls ``tasks.SubtaskService`` makes on a job, in-process or in its sandbox worker."""

    async def run_step(self, step: int, subdag: int | None = None) -> StepOutcome: ...
    async def drop_inflight(self) -> None: ...
    async def serve(self, request: ServeStepRequest) -> ServeStepReply: ...
    async def collect(self, part: str, chunk: int, subdag: int | None = None) -> CollectReply: ...
    def snapshot(self, subdag: int | None = None) -> Awaitable[tuple[list[Chunk], float]]: ...
    def deliver(self, frame: TensorFrame) -> None: ...
    def refused(self) -> int: ...
    async def close(self, why: str) -> None: ...


class JobHost:
    """``Host`` on a built ``JobAssignment``: compute on ``compute`` (None: inline)."""

    def __init__(self, job: JobAssignment, compute: Executor | None) -> None:
        self.job = job  # the first sub-DAG assigned here (deployments: the only one)
        self.jobs: dict[int, JobAssignment] = {job.index: job}  # several with interleaved-1f1b
        self.compute = compute
        job.executor.compute = compute
        self.snapshots = {job.index: Snapshotter(job)}  # by sub-DAG
        self._order = StepOrder()  # deployments: request batches run in step order
        self._collected: tuple[tuple[str, int, int], SliceStream] | None = None
        self._device_steps = DeviceSteps()

    def add(self, job: JobAssignment) -> None:
        """Another sub-DAG of the same job and round on this compnode (interleaved-1f1b's chunks)."""
        first = self.job
        if (job.job_id, job.attempt) != (first.job_id, first.attempt) or job.spec.chunks < 2:
            raise JobError(f"job {job.job_id}: only interleaved chunks of one round share a compnode")
        if job.index in self.jobs:
            raise JobError(f"job {job.job_id}: sub-DAG {job.index} is held here already")
        job.executor.compute = self.compute
        self.jobs[job.index] = job
        self.snapshots[job.index] = Snapshotter(job)

    def local(self, subdag: int) -> bool:
        return subdag in self.jobs

    def _of(self, subdag: int | None) -> JobAssignment:
        if subdag is None:
            return self.job
        job = self.jobs.get(subdag)
        if job is None:
            raise JobError(
                f"job {self.job.job_id}: sub-DAG {subdag} is not held here (ours: {sorted(self.jobs)})"
            )
        return job

    def _on_compute(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def run_step(self, step: int, subdag: int | None = None) -> StepOutcome:
        if self.job.spec.chunks > 1:  # every chunk of the compnode at once, in its program's order
            report = await self._device_steps.report(self.jobs, step, self._of(subdag).index)
        else:
            report = await self._of(subdag).run_step(step)
        outputs = None
        if report.outputs:
            outputs = await self._on_compute(pack_tensors, output_tensors(report.outputs))
        return StepOutcome(
            loss=report.loss,
            fp_seconds=report.fp_seconds,
            bp_seconds=report.bp_seconds,
            update_seconds=report.update_seconds,
            outputs=outputs,
            refused=self.refused(),
            activation_peak_bytes=report.activation_peak_bytes,
            sent_bytes=report.sent_bytes,
        )

    async def drop_inflight(self) -> None:
        self._device_steps.forget()
        for job in self.jobs.values():
            await self._on_compute(job.executor.drop_inflight)

    async def serve(self, request: ServeStepRequest) -> ServeStepReply:
        return await serve_step(self.job, self._order, request)

    async def collect(self, part: str, chunk: int, subdag: int | None = None) -> CollectReply:
        job = self._of(subdag)

        def blobs() -> CollectReply:
            # Packing a big model's state is compute (seconds for 100M parameters): on the compute
            # thread, after any stretch still queued there, never on the event loop.
            if part == "all":
                grads = job.grads_blob() if job.spec.task == "grad" else None
                return CollectReply(state=job.state_blob(), grads=grads, optim=job.optim_blob())
            stream = self._collect_stream(job, part)
            chunks = stream.chunks(COLLECT_CHUNK_BYTES)
            if chunk >= chunks:
                raise JobError(f"collect: no chunk {chunk} of {part} ({chunks} chunks)")
            start = chunk * COLLECT_CHUNK_BYTES
            data = stream.read(start, start + COLLECT_CHUNK_BYTES)
            if chunk == chunks - 1:
                self._collected = None  # the last chunk went
            if part == "optim":
                return CollectReply(state=b"", optim=data, chunks=chunks)
            grads = job.grads_blob() if job.spec.task == "grad" and chunk == 0 else None
            return CollectReply(state=data, grads=grads, chunks=chunks)

        return await self._on_compute(blobs)

    def _collect_stream(self, job: JobAssignment, part: str) -> SliceStream:
        """The part as one safetensors stream over the live tensors (no packed copy), answered in byte
        ranges (``results.slice_stream``); kept from chunk 0 to the last for the state as it is now."""
        key = (part, len(job.steps_done), job.index)
        if self._collected is None or self._collected[0] != key:
            tensors = job.optim_tensors() if part == "optim" else job.executor.state(copy=False)
            self._collected = (key, SliceStream(tensors, sorted(tensors)))
        return self._collected[1]

    def snapshot(self, subdag: int | None = None) -> asyncio.Future[tuple[list[Chunk], float]]:
        """The state and optimizer state of sub-DAG ``subdag`` (default: the first) in chunks, and the
        compute-thread seconds they cost. Started on the compute thread *now*, so after the Update it is
        of; no later Update runs before the copy is done (``compnode.snapshots``)."""
        started = self._on_compute(self.snapshots[self._of(subdag).index].start)

        async def chunks() -> tuple[list[Chunk], float]:
            copy, seconds = await started
            return await asyncio.wrap_future(copy), seconds

        return asyncio.ensure_future(chunks())

    def deliver(self, frame: TensorFrame) -> None:
        if len(self.jobs) == 1:
            self.job.channel.on_frame(frame)
            return
        try:  # several sub-DAGs here: the frame's route names which one it is for
            _, dst, _ = split_route(frame.name)
        except WireError:
            dst = self.job.index  # its channel refuses it, counted and logged
        self.jobs.get(dst, self.job).channel.on_frame(frame)

    def refused(self) -> int:
        return sum(job.channel.refused for job in self.jobs.values())

    async def close(self, why: str) -> None:
        for job in self.jobs.values():
            job.channel.mailbox.fail_all(JobError(f"job {job.job_id} was released: {why}"))
        for snapshots in self.snapshots.values():
            snapshots.close()


@dataclass
class HeldJob:
    """The daemon's record of one assignment; its compute happens in ``host``."""

    job_id: str
    broker: str  # the peer that assigned the job: the only one that may drive or release it
    attempt: int  # the broker's assignment round (a failover or re-plan starts a new one)
    spec: RunSpec
    index: int  # our (first) sub-DAG
    peers: list[JobPeer]
    link_keys: list[bytes]  # per sub-DAG: the key of frames between it and us (``AssignRequest``)
    nodes: int  # IR nodes of our sub-DAG
    params: int  # parameters it owns
    host: Host
    replica_holders: list[int] | None = None  # per sub-DAG: who keeps its snapshots (None: nobody)
    # our sub-DAGs' snapshots leaving, by sub-DAG (``compnode.replicas``)
    replicators: dict[int, Replicator] = field(default_factory=dict)
    steps_done: set[int] = field(default_factory=set)  # steps every sub-DAG of ours has run
    # Answers to the latest steps per (step, sub-DAG), for a repeated request whose answer was lost on
    # the way (with a step sent ahead, step k's retry may come after k + 1 ran).
    replies: dict[tuple[int, int], StepReply] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)  # all our sub-DAGs (several: interleaved chunks)
    answered_steps: set[tuple[int, int]] = field(default_factory=set)  # (step, sub-DAG) run here
    created_at: float = field(default_factory=time.time)
    ended: dict[int, asyncio.Event] = field(default_factory=dict)  # steps a step sent ahead waits for
    failed: set[int] = field(default_factory=set)
    released: bool = False

    def answered(self, reply: StepReply, subdag: int) -> None:
        self.replies[(reply.step, subdag)] = reply
        for old in [k for k in self.replies if k[0] < reply.step - KEPT_REPLIES]:
            del self.replies[old]
        self.answered_steps = {k for k in self.answered_steps if k[0] >= reply.step - KEPT_REPLIES}

    def subdag_of(self, requested: int | None) -> int:
        """The sub-DAG a call is about: the one it names, or our only one."""
        if requested is None:
            if len(self.indices) > 1:
                raise JobError(f"job {self.job_id}: this compnode holds sub-DAGs {self.indices}: name one")
            return self.index
        if requested not in self.indices:
            raise JobError(f"job {self.job_id}: sub-DAG {requested} is not held here (ours: {self.indices})")
        return requested

    def add_subdag(self, nodes: int, params: int) -> None:
        """Another of our sub-DAGs of this round (interleaved chunks) joined the host."""
        self.nodes += nodes
        self.params += params

    def step_ended(self, step: int, ok: bool) -> None:
        if not ok:
            self.failed.add(step)
        self.ended.setdefault(step, asyncio.Event()).set()

    def release(self) -> None:
        self.released = True
        for event in self.ended.values():
            event.set()

    async def wait_for_step(self, step: int, timeout: float) -> None:
        """Until ``step`` has run here (a step sent ahead of it waits so): ``JobError`` if it failed,
        the job was released, or it did not come within ``timeout``."""
        if step not in self.steps_done:
            event = self.ended.setdefault(step, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                raise JobError(
                    f"job {self.job_id}: step {step} did not run here within {timeout:g} s"
                ) from None
        if self.released:
            raise JobError(f"job {self.job_id} was released")
        if step in self.failed:
            raise JobError(f"job {self.job_id}: step {step} failed here; step {step + 1} is not run")

    @classmethod
    def of(cls, request: AssignRequest, broker: str, nodes: int, params: int, host: Host) -> HeldJob:
        ours = request.own_subdags()
        return cls(
            job_id=request.job_id,
            broker=broker,
            attempt=request.attempt,
            spec=request.spec,
            index=request.subdag,
            peers=list(request.peers),
            link_keys=[b"" if j in ours else request.key_of_link(j) for j in range(len(request.peers))],
            nodes=nodes,
            params=params,
            host=host,
            replica_holders=request.replica_holders,
            indices=ours,
        )

    def _others(self) -> dict[str, int]:
        """Every other compnode of the job -> its first sub-DAG (one key and one link per compnode)."""
        return first_subdag_of_others(self.peers, self.indices)

    def allowed_senders(self) -> list[str]:
        return list(self._others())

    def keys_by_sender(self) -> dict[str, bytes]:
        """What the data path checks each sender's frames with."""
        return {peer: self.link_keys[i] for peer, i in self._others().items()}

    def subdag_of_peer(self) -> dict[str, int]:
        return self._others()
