"""One job on the broker, plan to results, surviving compnodes that die, leave or join (FusionAI 3.2-3.6).

PLANNING: the performance model places the job (``placement.py``); each compnode gets its sub-DAG (IR,
assignment, peers, a fresh per-job data-path key, its slice of the checkpoint, the dataset fields its
placeholders read). RUNNING: drive steps; every compnode runs the step's GPipe schedule and exchanges
activations and gradients with its peers directly. Failover checkpoints (train) are replicated between
the compnodes in the background (``replicas.py``): the broker only asks for snapshots and keeps the
books, and collects parameters and optimizer state itself (``checkpoints.py``) only for the results,
a hand-over, a re-plan or every ``--sync-every`` steps.

Failure handling (Confidant's passive recovery, made exact; detection and phase records in
``failures.py``):
- detection: a step or sync call fails, or the registry reports an assigned compnode unreachable or
  gone (heartbeats); the broker then pings every assigned compnode to learn which are dead;
- redistribution: the newest step every sub-DAG has a replica of on a survivor is fetched into a
  checkpoint on disk; survivors are released and the job re-planned over them and the free backups;
  every sub-DAG is assigned again (a new ``attempt``) from that checkpoint;
- replay: the steps after the checkpoint run again. Steps are deterministic and micro-batch messages
  idempotent, so the result equals a fault-free run.
Proactive leave: a compnode on SIGTERM calls ``leaving``; at the next step boundary the broker syncs
and moves its sub-DAG to a replacement, with nothing to replay. Elastic join: at a checkpointed step
boundary a newly joined compnode is taken in when the model predicts a gain above ``replan_gain``.

Whether and how to place the job again is an explicit ``replanning.Replan`` (first placement, failure,
hand-over, growth, misprediction) pending before the next step, made by ``job_placement.JobPlacement``,
looked for between steps by ``placement_review.PlacementReview``; the calls to compnodes are
``job_calls.JobCalls``; what the run may use of the broker is ``context.JobContext``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fusionnet.broker import replanning
from fusionnet.broker.checkpoints import Checkpoint, JobFiles
from fusionnet.broker.context import JobContext
from fusionnet.broker.failures import FailureWatch, PeerFailure, RecoveryLog
from fusionnet.broker.job_calls import JobCalls
from fusionnet.broker.job_placement import JobPlacement
from fusionnet.broker.job_steps import JobSteps
from fusionnet.broker.placement_review import PlacementReview
from fusionnet.broker.replanning import Replan
from fusionnet.broker.replicas import (
    ReplicaBook,
    assemble_checkpoint,
    recovered_checkpoint,
    resumed_from_replicas,
)
from fusionnet.broker.store import BrokerStore, JobState
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.partition import Partition
from fusionnet.errors import ComputeError, FusionNetError, IRError, JobError, PartitionError, TraceError
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.compnode_rpc import StepReply
from fusionnet.planning.misprediction import PredictionWatch
from fusionnet.planning.optimizers import optimizer_profiles
from fusionnet.planning.placement import JobShape, Placement
from fusionnet.results.assemble import RunResult, StateView, assemble_result
from fusionnet.results.files import plan_document, write_results
from fusionnet.schedules import ScheduleError, make_schedule

log = logging.getLogger("fusionnet.broker.jobs")
# The broker's own files failing (not a network error, which is an OSError too): the job fails saying so.
FILE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOENT, errno.EIO})
# A job that failed on one of these failed on its input (job file, model, data: the model raised on the
# rows, its graph or cut is refused): sending it again fails again. Anything else is the work's (swarm,
# peers, broker); the submitter's exit status tells the two apart.
INPUT_ERRORS = (JobError, TraceError, IRError, PartitionError, ComputeError)
RESUME_WAIT = 60.0  # seconds a job resumed after a broker restart waits for its compnodes to be found again
RESUME_POLL = 0.25


@dataclass
class JobProgress:
    """What ``job_status`` reports beyond the store's row."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    placement: list[dict[str, Any]] = field(default_factory=list)  # per sub-DAG: peer, nodes, params
    refused_frames: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # per failover: phase seconds
    results: Path | None = None


class JobRun(JobPlacement, PlacementReview, JobSteps):
    def __init__(self, context: JobContext, job: SubmittedJob, folder: Path, *, resume: bool = False) -> None:
        self.ctx = context
        self.job = job
        self.files = JobFiles(folder)
        self.out_dir = folder
        self.progress = JobProgress()
        self.peers: list[str] = []
        self.partition: Partition | None = None  # of the current placement
        self.pending: Replan | None = replanning.FIRST  # a placement to make before the next step
        self.attempt = 0
        self.resume = resume
        self.cancel_reason: str | None = None  # set by ``JobService`` just before it cancels the run
        self.leaving: set[str] = set()
        self.dead: set[str] = set()
        self.unfit: set[str] = set()  # alive, but the job's sub-DAG did not fit their device memory
        self.calls = JobCalls(context.compnodes, job.job_id)
        self.replicas = ReplicaBook(
            context.settings.replica_interval,
            mtbf=lambda: context.churn.job_mtbf(len(set(self.peers)), time.time()),
        )
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._grads: list[dict[str, torch.Tensor]] | None = None  # a grad job's last, per sub-DAG
        self._busy: dict[int, float] = {}  # sub-DAG -> FP+BP+Update seconds over the steps below
        self._busy_steps = 0
        self._next_sync = 0  # one compnode: the first step after which the broker collects again
        self._placement: Placement | None = None
        self._seen_candidates: set[str] = set()  # the compnodes offered at the last placement decision
        self.shape = JobShape(
            graph=job.graph,
            wanted=job.spec.compnodes,
            microbatches=job.spec.microbatches,
            batch_size=job.spec.batch_size,
            optimizer=optimizer_profiles(job.spec.optimizer_spec(), job.graph)
            if job.spec.task == "train"
            else None,
            schedule=job.spec.schedule,
            microbatch_choices=tuple(job.spec.microbatch_choices),
            chunks=job.spec.chunks,
            interleave_gain=context.settings.interleave_gain,
            cuts=tuple(job.spec.cuts),
        )
        self._planned_slowness: list[float] = []  # per sub-DAG: its compnode's slowness when planned
        self.prediction = PredictionWatch()  # measured steps against the plan (issue 16: re-plan when off)
        self._probes_contradict = False  # the link probes after the last placement re-priced it by > 25%
        self._telling: set[asyncio.Task[None]] = set()  # releases sent to compnodes declared lost
        self.watch = FailureWatch(context, lambda: self.peers, self.leaving)
        # The next step's call, sent while this one runs (issue 13: the broker's round trip per step
        # off the critical path): a compnode starts step k + 1 the moment it finishes step k.
        self._ahead: tuple[int, float, asyncio.Future[list[StepReply]]] | None = None
        self._last_reply_at: float | None = None  # when the latest step's last reply came
        self.recoveries = RecoveryLog(context, job.job_id, self.progress.recoveries)
        self.watch.attach()

    # ---- orchestration ---------------------------------------------------------------------------
    async def run(self) -> None:
        job, store = self.job, self.ctx.store
        broker_stops = False
        try:
            ckpt = await self._initial_checkpoint()
            store.update_job(job.job_id, state=JobState.PLANNING)
            step = ckpt.step
            recovering: dict[str, Any] | None = None
            while step < job.spec.step_count:
                if self.pending is not None and self._ahead is None:  # (else: the step sent ahead first)
                    await self._place_and_assign(ckpt, recovering, self.pending)
                    store.update_job(job.job_id, state=JobState.RUNNING, step=step)
                in_step = True  # else in what follows a step (its sync, a re-plan check)
                try:
                    await self.watch.guarded(self._step(step))
                    step += 1
                    in_step = False
                    ckpt = await self._after_step(step, ckpt)
                    if job.spec.task == "grad" and step == job.spec.step_count:
                        # The last step's gradients are on its compnodes: taken here, in the loop, so
                        # that a compnode lost meanwhile (with them) makes that step run again on a
                        # new placement instead of failing a job a backup could finish.
                        before_last = replace(ckpt, step=step - 1)
                        try:
                            self._grads = await self.watch.guarded(self._collect_grads())
                        except PeerFailure:
                            ckpt = before_last  # a grad step changes no parameters: only the count
                            raise
                    if recovering is not None and step > recovering["failed_step"]:
                        self.recoveries.replayed(recovering)
                        recovering = None
                    if self._leavers():
                        if self._ahead is None:  # else after the step sent ahead, synced then
                            self._hand_over(ckpt)
                    elif step < job.spec.step_count:
                        self.pending = self.pending or await self._grow() or await self._recheck_prediction()
                        # The re-plan starts here, once no step sent ahead can change the state.
                        if self.pending is not None and ckpt.step != step and self._ahead is None:
                            ckpt = await self.watch.guarded(self._sync(step, ckpt))
                except PeerFailure as failure:
                    self._drop_ahead()
                    if recovering is not None:  # failed again before the replay was over
                        recovering["superseded"] = True
                    recovered = await self._replicated_checkpoint(failure, ckpt)
                    source = "broker" if recovered is ckpt else "replicas"
                    ckpt = recovered
                    # Recovered once step k has run again, k the step that failed or, for a failure
                    # after a step (in its sync), that step: ``failed_step`` is k either way.
                    recovering = self._on_failure(failure, ckpt, step if in_step else step - 1, source)
                    self._tell_lost(failure.dead)
                    step = ckpt.step
            if recovering is not None:  # the replicas held the last step: nothing was left to redo
                self.recoveries.replayed(recovering)
            result = await self._collect_results(ckpt)
            await asyncio.to_thread(write_results, self.out_dir, result, job.spec.task)
            self.progress.results = self.out_dir
            store.update_job(job.job_id, state=JobState.SUCCEEDED, step=step)
            log.info("job %s: succeeded; results in %s", job.job_id, self.out_dir)
        except asyncio.CancelledError:
            if self.cancel_reason is None:  # the broker stops: the job stays RUNNING, its checkpoint on disk
                log.warning("job %s: the broker stopped; the job resumes when it is back", job.job_id)
                broker_stops = True
                raise
            # ``cancel_job``: the in-flight step is abandoned; the compnodes are released below.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled here: the release below must not be cancelled too
            mark_cancelled(store, job.job_id, self.cancel_reason)
        except FusionNetError as e:
            self._fail(str(e), e)
        except Exception as e:  # a bug of ours must still end the job with a reason, not hang it
            if isinstance(e, OSError) and e.errno in FILE_ERRNOS:  # its files: a full disk, a lost dir
                log.error("job %s: the broker's files: %s", job.job_id, e)
                self._fail(f"the broker could not write or read its files: {e}")
            else:
                log.exception("job %s: internal error", job.job_id)
                self._fail(f"internal error: {type(e).__name__}: {e}")
        finally:
            self._drop_ahead()
            self.watch.detach()
            if self._telling:
                await asyncio.gather(*self._telling, return_exceptions=True)
            if not broker_stops:
                # Not when the broker stops: released, the compnodes would drop the job's snapshots
                # (``replicas``), which a restarted broker resumes from (as after a crash); a broker
                # that never comes back leaves them to expire (``--assignment-ttl``).
                await self._release_all(
                    "the job ended" if self.cancel_reason is None else "the job was cancelled"
                )
            self._update_job_gauges()
            if JobState(self.ctx.store.get_job(job.job_id)["state"]).terminal:
                # nothing resumes an ended job: its submission and checkpoints would only fill the disk
                await asyncio.to_thread(self.files.drop_working_files)

    async def _after_step(self, step: int, ckpt: Checkpoint) -> Checkpoint:
        """The checkpoint after ``step`` steps: synced from the compnodes when due (train), else the
        last one with this step's metrics (grad and infer change no parameters)."""
        job = self.job
        if job.spec.task != "train":
            return Checkpoint(step, ckpt.state, ckpt.optim, list(self.progress.metrics))
        due = self._sync_due(step)
        if not due or self._ahead is not None:  # a step sent ahead runs: synced after it instead
            return ckpt
        ckpt = await self.watch.guarded(self._sync(step, ckpt))
        row = self.progress.metrics[-1] if self.progress.metrics else {}
        self._next_sync = replanning.next_sync(step, row.get("sync_seconds", 0.0), row.get("seconds", 0.0))
        return ckpt

    async def _compnodes_back(self) -> None:
        """A broker that restarts finds its compnodes again within a DHT refresh and a heartbeat or two;
        a resumed job placed before that would fail on an empty registry. It waits, up to
        ``RESUME_WAIT`` seconds, until the job's count of compnodes is schedulable (or fewer, once the
        wait is over: placement then takes what there is, or fails saying so)."""
        want = self.job.spec.compnodes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESUME_WAIT
        while len(self.ctx.registry.schedulable()) < want and loop.time() < deadline:
            await asyncio.sleep(RESUME_POLL)
        found = len(self.ctx.registry.schedulable())
        log.info("job %s: %d of %d compnodes found again after the restart", self.job.job_id, found, want)

    async def _initial_checkpoint(self) -> Checkpoint:
        base = Checkpoint(0, self.job.state, {}, [])
        if not self.resume:
            return base
        await self._compnodes_back()
        loaded = self.files.load_checkpoint()
        ckpt, self.attempt = loaded if loaded is not None else (base, 0)
        ckpt, self.attempt, pointed = await resumed_from_replicas(self.calls, self.files, ckpt, self.attempt)
        if loaded is None and not pointed:
            return base
        self.progress.metrics = list(ckpt.metrics)
        log.info("job %s: resuming from the checkpoint before step %d", self.job.job_id, ckpt.step)
        self.ctx.store.add_job_event(self.job.job_id, "resumed", {"step": ckpt.step})
        return ckpt

    async def _replicated_checkpoint(self, failure: PeerFailure, last: Checkpoint) -> Checkpoint:
        """After a failure: the newest step the survivors' replicas make up, on disk (else ``last``)."""
        if not self.replicas.enabled:
            return last
        live = [p for p in self.peers if p not in failure.dead or failure.unfit]
        rows = self.progress.metrics
        got = await recovered_checkpoint(
            self.calls, self.files, live, len(self.peers), last, self.attempt, rows
        )
        return last if got is None else got

    def cancel(self, task: asyncio.Task[None], reason: str) -> None:
        """Stops the run (``task``) at once: whatever it awaits is cancelled, the job ends CANCELLED and
        its compnodes are released (they drop their sub-DAGs and fail the step they were in)."""
        self.cancel_reason = reason
        task.cancel()

    def _fail(self, reason: str, error: BaseException | None = None) -> None:
        """FAILED with ``reason``; ``error``, the exception, says whose fault it is (``INPUT_ERRORS``)."""
        log.warning("job %s: failed: %s", self.job.job_id, reason)
        kind = "input" if isinstance(error, INPUT_ERRORS) else "work"
        self.ctx.store.update_job(self.job.job_id, state=JobState.FAILED, error=reason, error_kind=kind)

    def _update_job_gauges(self) -> None:
        self.ctx.metrics.forget_job(self.job.job_id)
        self.ctx.refresh_job_metrics()

    # ---- failures (detection and the phase record: ``failures.py``) ------------------------------
    def _on_failure(
        self, failure: PeerFailure, ckpt: Checkpoint, failed_step: int, source: str
    ) -> dict[str, Any]:
        info = self.recoveries.failed(failure, ckpt.step, failed_step, source)
        self._exclude(failure)
        # The steps after the checkpoint run again: their rows and outputs are recorded again.
        self.progress.metrics = [r for r in self.progress.metrics if r["step"] < ckpt.step]
        self._outputs = {s: o for s, o in self._outputs.items() if s < ckpt.step}
        self.pending = replanning.failure(failure.dead)
        return info

    # ---- steps and syncs -------------------------------------------------------------------------
    async def _sync(self, step: int, last: Checkpoint) -> Checkpoint:
        """Parameters and optimizer state of every sub-DAG after ``step - 1``, collected by the broker:
        the new checkpoint, on disk (``replicas.assemble_checkpoint``: never the model in memory)."""
        started = time.perf_counter()
        parts = self.calls.collect_parts
        got = await assemble_checkpoint(self.files, step, last, self.peers, parts, f"a{self.attempt}")
        if self.progress.metrics:  # what the collection cost (metrics.jsonl, benchmarks/scale.py)
            self.progress.metrics[-1]["sync_seconds"] = time.perf_counter() - started
        ckpt = replace(got, metrics=list(self.progress.metrics))
        await asyncio.to_thread(self.files.save_checkpoint, ckpt, self.attempt)
        return ckpt

    def _schedule_doc(self) -> dict[str, Any]:
        chosen = None if self._placement is None else self._placement.schedule
        doc: dict[str, Any]
        if chosen is None:
            doc = {"name": self.job.spec.schedule, "why": "placement.schedule", "predicted_step_seconds": {}}
        else:
            doc = chosen.to_dict()
        # The programs the compnodes ran, one line each, as ``run --local`` writes them (README): built
        # as each compnode builds its own (``schedule_loop.schedule_for``), for the last step's count.
        spec, partition = self.job.spec, self.partition
        metrics = self.progress.metrics
        m = int(metrics[-1]["microbatches"]) if metrics else spec.microbatches
        chunks = chosen.chunks if chosen is not None else spec.chunks
        if partition is not None:
            try:
                program = make_schedule(str(doc["name"]), len(partition.subdags), m, spec.task, chunks)
            except ScheduleError as e:  # a name no compnode ran either: the document goes without it
                log.warning("job %s: no schedule text for plan.json: %s", self.job.job_id, e)
            else:
                doc["text"] = program.text()
        return doc

    # ---- results ---------------------------------------------------------------------------------
    async def _collect_results(self, ckpt: Checkpoint) -> RunResult:
        assert self.partition is not None
        job, graph = self.job, self.job.graph
        grads = self._grads
        if job.spec.task == "grad" and grads is None:
            raise AssertionError(f"job {job.job_id}: a grad job ended without its gradients")
        steps = max(self._busy_steps, 1)
        measured = {i: t / steps for i, t in self._busy.items()}
        plan = plan_document(
            self.partition,
            predicted=None if self._placement is None else self._placement.predicted,
            measured=measured,
            extra={
                "job": job.spec.name,
                "job_id": job.job_id,
                "task": job.spec.task,
                "frontend": graph.frontend,
                "compnodes": dict(enumerate(self.peers)),
                "policy": None if self._placement is None else self._placement.policy,
                "slowness": {p: self.ctx.speeds.slowness(p) for p in self.peers},
                "links": self.ctx.links.describe(self.peers),
                "predicted_step_seconds": None if self._placement is None else self._placement.predicted_step,
                "recoveries": self.progress.recoveries,
                "schedule": self._schedule_doc(),
            },
        )
        for doc in plan["subdags"]:
            doc["compnode"] = self.peers[doc["subdag"]]
        result = assemble_result(
            graph,
            job.spec.task,
            states=[],
            initial={},
            grads=grads,
            outputs=[self._outputs[s] for s in sorted(self._outputs)],
            metrics=self.progress.metrics,
            plan=plan,
        )
        # The weights straight from the checkpoint on disk, a tensor at a time as they are written:
        # the broker never holds the model, not even for the results.
        weights = StateView(graph.state_keys, ckpt.state, graph.aliases)
        return replace(result, weights=weights, measured_seconds=measured)

    async def _collect_grads(self) -> list[dict[str, torch.Tensor]]:
        """A grad job's last gradients, per sub-DAG, from the compnodes that computed them."""
        replies = await self.calls.collect(self.peers, subdags=range(len(self.peers)))
        return [unpack_tensors(r.grads, f"grads from {p}") for p, r in zip(self.peers, replies)]

    async def _release_all(self, why: str, only: list[str] | None = None) -> None:
        peers = self.peers if only is None else only
        await self.calls.release([p for p in peers if p not in self.dead], why)


def mark_cancelled(store: BrokerStore, job_id: str, reason: str) -> bool:
    """CANCELLED in the store unless the job already ended (a job that just finished stays finished)."""
    if JobState(store.get_job(job_id)["state"]).terminal:
        return False
    log.info("job %s: cancelled (%s)", job_id, reason)
    store.update_job(job_id, state=JobState.CANCELLED, error=reason)
    return True
