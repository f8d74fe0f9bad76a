"""Driving a job's steps on the broker (a mixin of ``jobrun.JobRun``): one ``step`` call to every
compnode of the placement, or the next step's call sent while this one runs (``--steps-ahead``: the
broker's round trip per step off the critical path), and each step's replies turned into a
metrics.jsonl row, the compnodes' refined speeds, the replica books and the Prometheus figures.
"""

from __future__ import annotations

import asyncio
import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fusionnet.broker import replanning
from fusionnet.broker.checkpoints import JobFiles
from fusionnet.broker.context import JobContext
from fusionnet.broker.failures import step_timeout
from fusionnet.broker.job_calls import JobCalls
from fusionnet.broker.replanning import Replan
from fusionnet.broker.replicas import REPLICA_LINK_SHARE, ReplicaBook
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.partition import Partition
from fusionnet.errors import PlanError
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.compnode_rpc import StepReply
from fusionnet.perfmodel.simulator import compute_path
from fusionnet.planning.placement import Placement

# Sub-DAGs x micro-batches up to which a step's compute path is simulated on the loop (about 1 ms)
INLINE_PATH_ACTIONS = 128


class JobSteps:
    ctx: JobContext
    job: SubmittedJob
    calls: JobCalls
    files: JobFiles
    replicas: ReplicaBook
    progress: Any  # ``jobrun.JobProgress``
    peers: list[str]
    pending: Replan | None
    attempt: int
    _placement: Placement | None
    partition: Partition | None
    _busy: dict[int, float]
    _busy_steps: int
    _planned_slowness: list[float]
    _outputs: dict[int, dict[str, torch.Tensor]]
    _ahead: tuple[int, float, asyncio.Future[list[StepReply]]] | None
    _last_reply_at: float | None
    _next_sync: int  # one compnode: the first step after which the broker collects again

    if TYPE_CHECKING:  # ``job_placement.JobPlacement``, beside this mixin in ``jobrun.JobRun``

        def _leavers(self) -> set[str]: ...

    async def _compute_path(self, replies: list[StepReply], microbatches: int) -> float | None:
        """The step's schedule run on its sub-DAGs' measured compute alone (``simulator.compute_path``);
        a long pipeline's simulation (64 sub-DAGs x 512 micro-batches: 0.2 s) runs off the event loop."""
        partition = self.partition
        if self._placement is None or partition is None or len(partition.subdags) != len(replies):
            return None
        chosen = self._placement.schedule
        work = partial(
            compute_path,
            [(r.fp_seconds, r.bp_seconds, r.update_seconds) for r in replies],
            [s.compnode_users for s in partition.subdags],
            microbatches,
            schedule=self.job.spec.schedule if chosen is None else chosen.name,
            task=self.job.spec.task,
            chunks=self._placement.chunks,
        )
        try:
            inline = len(replies) * microbatches <= INLINE_PATH_ACTIONS
            path = work() if inline else await asyncio.to_thread(work)
        except PlanError:  # a schedule the simulator cannot run here: the row goes without it
            return None
        return path if math.isfinite(path) else None  # timings near the float limit add up to inf

    def _sync_due(self, step: int) -> bool:
        """Whether the broker collects the state after ``step`` steps (train jobs)."""
        every = self.ctx.settings.sync_every
        leaving = bool(self._leavers())
        if every or self.replicas.enabled:
            return replanning.sync_due(step, self.job.spec.step_count, every, leaving)
        # One compnode, no peer to replicate to: the broker collects, paced to a share of the time.
        return step >= self._next_sync or replanning.sync_due(step, self.job.spec.step_count, 0, leaving)

    def _send_step(self, step: int, ahead: bool = False) -> asyncio.Future[list[StepReply]]:
        """``step``'s call to every compnode; ``ahead``: sent while step - 1 runs, which it waits for."""
        last = self.progress.metrics[-1]["seconds"] if self.progress.metrics else None
        predicted = None if self._placement is None else self._placement.predicted_step
        snapshot, keep_from = self.replicas.request(step)
        timeout = (2 if ahead else 1) * step_timeout(predicted, last)
        after = step - 1 if ahead else None
        paces = self._replica_paces() if snapshot else None
        call = self.calls.step(
            self.peers,
            step,
            timeout=timeout,
            snapshot=snapshot,
            keep_from=keep_from,
            after=after,
            paces=paces,
        )
        return asyncio.ensure_future(call)

    def _replica_paces(self) -> list[float | None]:
        """Per sub-DAG, the bytes/s its snapshot may take towards its holder: ``REPLICA_LINK_SHARE`` of
        the link's measured bandwidth (None where the link was never measured)."""
        holders = self.replicas.holders() or []
        paces: list[float | None] = []
        for i, h in enumerate(holders):
            link = self.ctx.links.get(self.peers[i], self.peers[h])
            fast = link is None or link.beta <= 0
            paces.append(None if fast else min(REPLICA_LINK_SHARE / link.beta, 1e12))
        return paces

    def _may_send_ahead(self, step: int) -> bool:
        """Whether ``step`` may go out before the previous one is answered: not past the end, and not
        where the broker must look at the state between the two (a sync, a re-plan, a hand-over)."""
        if not self.ctx.settings.steps_ahead or step >= self.job.spec.step_count:
            return False
        if self.pending is not None or self._leavers():
            return False
        return self.job.spec.task != "train" or not self._sync_due(step)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[2].cancel()
            self._ahead[2].add_done_callback(lambda f: f.cancelled() or f.exception())
            self._ahead = None

    async def _step(self, step: int) -> None:
        job = self.job
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            # Sent while the previous step ran: it started when that one's replies came.
            call, started = ahead[2], max(ahead[1], self._last_reply_at or ahead[1])
        else:
            if ahead is not None:
                ahead[2].cancel()
            call, started = self._send_step(step), time.perf_counter()
        if self._may_send_ahead(step + 1):
            self._ahead = (step + 1, time.perf_counter(), self._send_step(step + 1, ahead=True))
        try:
            replies = await call
        except BaseException:
            self._drop_ahead()
            raise
        self._last_reply_at = time.perf_counter()
        seconds = self._last_reply_at - started
        self._busy_steps += 1
        sizes = job.spec.microbatch_sizes(step)
        samples = sum(sizes)
        row: dict[str, Any] = {"step": step, "seconds": seconds, "samples": samples}
        row["microbatches"] = len(sizes)
        loss = None
        for i, r in enumerate(replies):
            self._busy[i] = self._busy.get(i, 0.0) + r.busy_seconds
            predicted = None if self._placement is None else (self._placement.predicted or {}).get(i)
            if predicted is not None:  # refine the compnode's speed online from this sub-task
                self.ctx.speeds.observe(self.peers[i], self._planned_slowness[i], predicted, r.busy_seconds)
                if predicted > 0:
                    self.ctx.metrics.observe_subtask_prediction(r.busy_seconds, predicted)
            if r.loss is not None:
                loss = r.loss
            if r.outputs is not None:
                self._outputs[step] = unpack_tensors(r.outputs, f"step {step} outputs from {self.peers[i]}")
        self.progress.refused_frames = sum(r.refused for r in replies)
        if loss is not None:
            row["loss"] = loss
        if job.spec.task != "infer":  # per sub-DAG: the most activation bytes it held at once in the step
            row["activation_peak_bytes"] = [r.activation_peak_bytes for r in replies]
        row["sent_bytes"] = [r.sent_bytes for r in replies]  # per sub-DAG, as on the wire
        # per sub-DAG: the seconds its compnode computed (FP, BP, Update); the rest of ``seconds`` it
        # waited (the schedule's bubble, the network, the broker's call)
        row["compute_seconds"] = [r.fp_seconds + r.bp_seconds + r.update_seconds for r in replies]
        path = await self._compute_path(replies, len(sizes))
        if path is not None:  # the step had every message been free; the rest the network and calls added
            row["compute_path_seconds"] = path
        if any(r.snapshot_seconds for r in replies):  # compute time of the last snapshot (runs in parallel)
            row["checkpoint_seconds"] = max(r.snapshot_seconds for r in replies)
        if self.replicas.observe([r.replicated for r in replies], step, seconds):  # for a restarted broker
            self.replicas.pointer(self.attempt, self.peers, self.progress.metrics).save(self.files)
        self.progress.metrics.append(row)
        self.ctx.store.update_job(job.job_id, step=step + 1, loss=loss)
        self.ctx.metrics.observe_step(
            job.job_id,
            step=step + 1,
            seconds=seconds,
            samples=samples,
            loss=loss,
            compnodes=len(self.peers),
            predicted_seconds=None if self._placement is None else self._placement.predicted_step,
            compute_path_seconds=path,
        )
