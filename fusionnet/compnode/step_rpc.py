"""The compnode's step calls (a mixin of ``tasks.SubtaskService``): ``step`` runs one step of a job's
sub-DAG (a repeated call gets the first one's answer; a call sent ahead waits for the step before it)
and reports its timings, loss, activation peak, traffic and replica state; ``serve_step`` runs one
request batch of a deployment (FP only). Both count the sub-task in the compnode's metrics.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fusionnet.compnode.job_host import HeldJob
from fusionnet.errors import DeviceMemoryError, JobError
from fusionnet.messages.base import handles
from fusionnet.messages.compnode_rpc import JobRequest, StepReply, StepRequest
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.rpc.server import RPCContext

log = logging.getLogger("fusionnet.compnode.tasks")

AHEAD_WAIT = 3600.0  # a step sent ahead waits at most this long for the step before it to run here


class StepRPC:
    node: Any  # CompnodeDaemon
    _locks: dict[str, asyncio.Lock]

    def _job(self, request: JobRequest, context: RPCContext) -> HeldJob:
        raise NotImplementedError  # SubtaskService's

    def _refused(self, job_id: str) -> int:
        raise NotImplementedError  # SubtaskService's

    def after_step(self, job: HeldJob, request: StepRequest) -> None:
        raise NotImplementedError  # ReplicaRPC's

    def collect_released(self, job: HeldJob) -> None:
        raise NotImplementedError  # SubtaskService's

    @handles(StepRequest)
    async def rpc_step(self, request: StepRequest, context: RPCContext) -> StepReply:
        """Runs one step of the caller's job: its sub-DAG's program of the schedule, then Update."""
        job = self._job(request, context)
        step = request.step
        subdag = job.subdag_of(request.subdag)
        if request.after is not None:  # sent ahead: after that step, whichever call came first
            await job.wait_for_step(request.after, AHEAD_WAIT)
        async with self._locks[job.job_id]:
            if step in job.steps_done or (step, subdag) in job.answered_steps:
                if (step, subdag) in job.replies:
                    return job.replies[(step, subdag)]  # a repeated request whose answer was lost
                raise JobError(f"job {job.job_id}: step {step} already ran on sub-DAG {subdag}")
            try:
                # several sub-DAGs here (interleaved): the first call runs all of them, in order
                outcome = await job.host.run_step(step, subdag)
            except asyncio.CancelledError:  # the job was released (or the daemon stops) mid-step
                self.node.metrics.count_subtask("cancelled")
                self.collect_released(job)
                raise
            except Exception as e:
                job.step_ended(step, ok=False)
                # A step its job's release ended (its values fail with the release's error) is cancelled
                released = self.jobs.get(job.job_id) is not job
                self.node.metrics.count_subtask("cancelled" if released else "failed")
                if released:
                    self.collect_released(job)
                if isinstance(e, DeviceMemoryError):  # the daemon lives on; the broker places again
                    log.warning("job %s: %s", job.job_id, e)
                    await job.host.drop_inflight()
                raise
            job.answered_steps.add((step, subdag))
            if all((step, i) in job.answered_steps for i in job.indices):
                job.steps_done.add(step)
                self.after_step(job, request)
                job.step_ended(step, ok=True)
        for phase, seconds in (
            ("fp", outcome.fp_seconds),
            ("bp", outcome.bp_seconds),
            ("update", outcome.update_seconds),
        ):
            if job.spec.task != "infer" or phase == "fp":
                self.node.metrics.observe_compute(phase, seconds)
        if job.spec.task != "infer":
            self.node.metrics.set_activation_peak(outcome.activation_peak_bytes)
        self.node.metrics.count_subtask("succeeded")
        replicator = job.replicators.get(subdag)  # this sub-DAG's snapshots
        reply = StepReply(
            step=step,
            loss=outcome.loss,
            fp_seconds=outcome.fp_seconds,
            bp_seconds=outcome.bp_seconds,
            update_seconds=outcome.update_seconds,
            activation_peak_bytes=outcome.activation_peak_bytes,
            sent_bytes=outcome.sent_bytes,
            refused=self._refused(job.job_id),
            outputs=outcome.outputs,
            replicated=None if replicator is None else replicator.confirmed,
            snapshot_seconds=0.0 if replicator is None else replicator.take_seconds(),
        )
        job.answered(reply, subdag)
        return reply

    @handles(ServeStepRequest)
    async def rpc_serve_step(self, request: ServeStepRequest, context: RPCContext) -> ServeStepReply:
        """One request batch of a deployment (``serve_steps``): FP only, data from the call."""
        job = self._job(request, context)  # type: ignore[arg-type]  # it names a job like a JobRequest
        if job.spec.task != "infer":
            raise JobError(f"job {job.job_id} is a {job.spec.task} job, not a deployment")
        try:
            reply = await job.host.serve(request)
        except asyncio.CancelledError:
            self.node.metrics.count_subtask("cancelled")
            raise
        except Exception:
            self.node.metrics.count_subtask("failed")
            raise
        self.node.metrics.observe_compute("fp", reply.fp_seconds)
        self.node.metrics.count_subtask("succeeded")
        return reply
