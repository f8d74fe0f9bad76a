"""One job on the broker, plan to results, surviving compnodes that die, leave or join (FusionAI 3.2-3.6).

PLANNING: the performance model places the job (``placement.py``); each compnode gets its sub-DAG (IR,
assignment, peers, a fresh per-job data-path key, its slice of the checkpoint, the dataset fields its
placeholders read). RUNNING: drive steps; every compnode runs the step's GPipe schedule and exchanges
activations and gradients with its peers directly. Every ``sync_every`` steps (train) the broker
collects parameters and optimizer state into a checkpoint on disk (``checkpoints.py``).

Failure handling (Confidant's passive recovery, made exact; detection and phase records in
``failures.py``):
- detection: a step or sync call fails, or the registry reports an assigned compnode unreachable or
  gone (heartbeats); the broker then pings every assigned compnode to learn which are dead;
- redistribution: survivors are released and the job re-planned over them and the free backups; every
  sub-DAG is assigned again (a new ``attempt``) from the last checkpoint;
- replay: the steps after the checkpoint run again. Steps are deterministic and micro-batch messages
  idempotent, so the result equals a fault-free run.
Proactive leave: a compnode on SIGTERM calls ``leaving``; at the next step boundary the broker syncs
and moves its sub-DAG to a replacement, with nothing to replay. Elastic join: at a checkpointed step
boundary a newly joined compnode is taken in when the model predicts a gain above ``replan_gain``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fusionnet.broker.assignments import assignment_payloads
from fusionnet.broker.checkpoints import Checkpoint, JobFiles
from fusionnet.broker.failures import MAX_RECOVERIES, FailureWatch, PeerFailure, RecoveryLog, step_timeout
from fusionnet.broker.links import LinkBook, probe_placement
from fusionnet.broker.placement import (
    Candidate,
    JobShape,
    Placement,
    consider_growth,
    first_pool,
    plan_placement,
    pool_after_loss,
    predicted_step,
)
from fusionnet.broker.speeds import SpeedBook
from fusionnet.broker.store import JobState
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.partition import Partition, build_partition
from fusionnet.errors import ExecutionError, FusionNetError, JobError
from fusionnet.runtime.blobs import unpack_tensors
from fusionnet.runtime.local import RunResult, write_results
from fusionnet.runtime.planning import optimizer_profiles
from fusionnet.runtime.results import assemble_state, join_step_outputs, plan_document

log = logging.getLogger("fusionnet.broker.jobs")

ASSIGN_TIMEOUT = 120.0
RELEASE_TIMEOUT = 5.0


@dataclass
class JobProgress:
    """What ``job_status`` reports beyond the store's row."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    placement: list[dict[str, Any]] = field(default_factory=list)  # per sub-DAG: peer, nodes, params
    refused_frames: int = 0
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # per failover: phase seconds
    results: Path | None = None


class JobRun:
    def __init__(self, broker: Any, job: SubmittedJob, folder: Path, *, resume: bool = False) -> None:
        self.broker = broker
        self.job = job
        self.files = JobFiles(folder)
        self.out_dir = folder
        self.progress = JobProgress()
        self.peers: list[str] = []
        self.partition: Partition | None = None
        self.attempt = 0
        self.resume = resume
        self.leaving: set[str] = set()
        self.dead: set[str] = set()
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._busy: dict[int, float] = {}  # sub-DAG -> FP+BP+Update seconds over the steps below
        self._busy_steps = 0
        self._placement: Placement | None = None
        self._lost: set[str] = set()  # peers whose sub-DAGs the next placement must move
        self._next: Placement | None = None  # a re-plan decided at a step boundary
        self._seen_candidates: set[str] = set()  # the compnodes offered at the last placement decision
        self.shape = JobShape(
            graph=job.graph,
            wanted=job.spec.compnodes,
            microbatches=job.spec.microbatches,
            batch_size=job.spec.batch_size,
            optimizer=optimizer_profiles(job.spec.optimizer_spec(), job.graph)
            if job.spec.task == "train"
            else None,
        )
        self.speeds: SpeedBook = broker.speeds
        self.links: LinkBook = broker.links
        self._planned_slowness: list[float] = []  # per sub-DAG: its compnode's slowness when planned
        self.watch = FailureWatch(broker, lambda: self.peers, self.leaving)
        self.recoveries = RecoveryLog(broker, job.job_id, self.progress.recoveries)
        self.watch.attach()

    @property
    def sync_every(self) -> int:
        return self.broker.settings.sync_every

    @property
    def min_gain(self) -> float:
        return self.broker.settings.replan_gain

    # ---- orchestration ---------------------------------------------------------------------------
    async def run(self) -> None:
        job, store = self.job, self.broker.store
        try:
            ckpt = self._initial_checkpoint()
            store.update_job(job.job_id, state=JobState.PLANNING)
            step = ckpt.step
            recovering: dict[str, Any] | None = None
            while step < job.spec.step_count:
                if self.partition is None:
                    await self._place_and_assign(ckpt, recovering)
                    store.update_job(job.job_id, state=JobState.RUNNING, step=step)
                try:
                    await self.watch.guarded(self._step(step))
                    step += 1
                    if job.spec.task != "train":
                        ckpt = Checkpoint(step, ckpt.state, ckpt.optim, list(self.progress.metrics))
                    elif step % self.sync_every == 0 or step == job.spec.step_count or self._leavers():
                        ckpt = await self.watch.guarded(self._sync(step))
                    if recovering is not None and step > recovering["failed_step"]:
                        self.recoveries.replayed(recovering)
                        recovering = None
                    if self._leavers():
                        self._hand_over(ckpt)
                    elif ckpt.step == step and step < job.spec.step_count and await self._grow():
                        self.partition = None
                except PeerFailure as failure:
                    if recovering is not None:  # failed again before the replay was over
                        recovering["superseded"] = True
                    recovering = self._on_failure(failure, ckpt, step)
                    step = ckpt.step
            result = await self._collect_results(ckpt)
            await asyncio.to_thread(write_results, self.out_dir, result, job.spec.task)
            self.progress.results = self.out_dir
            store.update_job(job.job_id, state=JobState.SUCCEEDED, step=step)
            log.info("job %s: succeeded; results in %s", job.job_id, self.out_dir)
        except asyncio.CancelledError:  # the broker stops: the job stays RUNNING, its checkpoint on disk
            log.warning("job %s: the broker stopped; the job resumes when it is back", job.job_id)
            raise
        except FusionNetError as e:
            self._fail(str(e))
        except Exception as e:  # a bug of ours must still end the job with a reason, not hang it
            log.exception("job %s: internal error", job.job_id)
            self._fail(f"internal error: {type(e).__name__}: {e}")
        finally:
            self.watch.detach()
            await self._release_all("the job ended")
            self._update_job_gauges()

    def _initial_checkpoint(self) -> Checkpoint:
        if self.resume:
            loaded = self.files.load_checkpoint()
            if loaded is not None:
                ckpt, self.attempt = loaded
                self.progress.metrics = list(ckpt.metrics)
                log.info("job %s: resuming from the checkpoint before step %d", self.job.job_id, ckpt.step)
                self.broker.store.add_job_event(self.job.job_id, "resumed", {"step": ckpt.step})
                return ckpt
        return Checkpoint(0, self.job.state, {}, [])

    def _fail(self, reason: str) -> None:
        log.warning("job %s: failed: %s", self.job.job_id, reason)
        if self.broker.store is not None:
            self.broker.store.update_job(self.job.job_id, state=JobState.FAILED, error=reason)

    def _update_job_gauges(self) -> None:
        self.broker.metrics.forget_job(self.job.job_id)
        refresh = getattr(self.broker, "refresh_job_metrics", None)
        if refresh is not None and self.broker.store is not None:
            refresh()

    # ---- failures (detection and the phase record: ``failures.py``) ------------------------------
    def _on_failure(self, failure: PeerFailure, ckpt: Checkpoint, failed_step: int) -> dict[str, Any]:
        info = self.recoveries.failed(failure, ckpt.step, failed_step)
        self.dead |= failure.dead
        self._lost = set(failure.dead)
        # The steps after the checkpoint run again: their rows and outputs are recorded again.
        self.progress.metrics = [r for r in self.progress.metrics if r["step"] < ckpt.step]
        self._outputs = {s: o for s, o in self._outputs.items() if s < ckpt.step}
        self.partition = None
        return info

    # ---- placement (policy: ``placement.py``) -----------------------------------------------------
    def _candidates(self) -> list[Candidate]:
        out = []
        for e in self.broker.registry.schedulable():
            if e.record.data_path_address is None or e.peer_id in self.dead or e.peer_id in self.leaving:
                continue
            try:
                device = self.speeds.device(e.peer_id, e.device_spec())
            except FusionNetError:  # no (or unusable) hardware record: the balanced policy places it
                device = None
            out.append(Candidate(e.peer_id, e.record.backup, device))
        return out

    def _leavers(self) -> set[str]:
        return self.leaving & set(self.peers)

    def _hand_over(self, ckpt: Checkpoint) -> None:
        """Proactive: the checkpoint was just taken at this boundary; move the leavers' sub-DAGs."""
        self._lost = self._leavers()
        self.recoveries.handing_over(self._lost, ckpt.step)
        self.partition = None

    async def _grow(self) -> bool:
        """Elastic join (``placement.consider_growth``), looked at when the set of free compnodes changed."""
        candidates = self._candidates()
        if self._placement is None or {c.peer_id for c in candidates} == self._seen_candidates:
            return False  # nothing joined (or left) since the last look: do not plan again
        self._seen_candidates = {c.peer_id for c in candidates}
        try:
            growth = await asyncio.to_thread(
                consider_growth, self.shape, self._placement, candidates, self.min_gain, self.links.pairs()
            )
        except FusionNetError as e:
            log.info("job %s: no re-plan with the new compnodes: %s", self.job.job_id, e)
            return False
        if growth is None:
            return False
        if not growth.adopt:
            log.info(
                "job %s: not re-planning: %s, gain below %g",
                self.job.job_id,
                growth.describe(),
                self.min_gain,
            )
            return False
        log.info(
            "job %s: re-planning at this step boundary: %d -> %d compnode(s), %s",
            self.job.job_id,
            len(self.peers),
            len(growth.proposed.peers),
            growth.describe(),
        )
        detail = {"from": self.peers, "to": list(growth.proposed.peers)}
        self.broker.store.add_job_event(
            self.job.job_id, "re-plan", {**detail, "predicted": [growth.now, growth.proposed.predicted_step]}
        )
        self._lost = set()
        self._next = growth.proposed
        return True

    def _plan(self) -> Placement:
        """The next placement: a re-plan decided at a step boundary, the first one, or the one after a
        loss or a leave (``self._lost``)."""
        candidates = self._candidates()
        if self._next is not None:
            placement, self._next = self._next, None
            return placement
        policy, links = self.broker.settings.placement_policy, self.links.pairs()
        if not self.peers:
            return plan_placement(self.shape, first_pool(candidates), policy=policy, links=links)
        pool = pool_after_loss(self.peers, self._lost, candidates)
        stages = min(len(self.peers), len(pool))
        return plan_placement(self.shape, pool, stages=stages, policy=policy, links=links)

    async def _place_and_assign(self, ckpt: Checkpoint, recovering: dict[str, Any] | None) -> None:
        started = time.monotonic()
        lost = set(self._lost)
        for _ in range(MAX_RECOVERIES):
            placement = await asyncio.to_thread(self._plan)
            old = self.peers
            if old:
                # Leavers are released too: that is their signal that the hand-over is done and they
                # may exit. Dead peers are skipped by ``_release_all``.
                await self._release_all("re-assigned", only=list(old))
            self._adopt(placement)
            try:
                await self.watch.guarded(self._assign_all(ckpt))
                break
            except PeerFailure as failure:  # a chosen compnode died before it got its sub-DAG
                self.dead |= failure.dead
                self._lost = set(failure.dead)
                lost |= failure.dead
        else:
            raise ExecutionError(f"job {self.job.job_id}: could not assign its sub-DAGs")
        self.recoveries.placed(recovering, time.monotonic() - started, len(self.peers), lost)
        self._lost = set()
        self._seen_candidates = {c.peer_id for c in self._candidates()}
        await self._probe_links()

    async def _probe_links(self) -> None:
        """Times the links this placement's activations take that the broker has not measured lately
        (``links.probe_placement``), then predicts the step again on them."""
        assert self.partition is not None
        consumers = {
            s.index: {c for cs in s.consumers.values() for c in cs if c != s.index}
            for s in self.partition.subdags
        }
        probed = await probe_placement(self.job.job_id, self.peers, consumers, self.links, self._call)
        placement = self._placement
        if probed and placement is not None and placement.predicted_step is not None:
            step = await asyncio.to_thread(
                predicted_step, self.shape, placement, self._candidates(), self.links.pairs()
            )
            if step is not None:
                self._placement = replace(placement, predicted_step=step)

    def _adopt(self, placement: Placement) -> None:
        self._placement = placement
        self._busy, self._busy_steps = {}, 0  # measured times are per sub-DAG of this placement
        self.partition = build_partition(self.job.graph, placement.assignment)
        self.peers = list(placement.peers)
        self._planned_slowness = [self.speeds.slowness(p) for p in self.peers]
        self.attempt += 1
        self.progress.placement = [
            {
                "subdag": s.index,
                "peer_id": self.peers[s.index],
                "nodes": len(s.nodes),
                "params": len(s.params),
                "predicted_seconds": None if placement.predicted is None else placement.predicted[s.index],
            }
            for s in self.partition.subdags
        ]
        log.info("job %s: attempt %d: %s", self.job.job_id, self.attempt, placement.describe())
        self.broker.store.add_job_event(
            self.job.job_id,
            "planned",
            {
                "compnodes": self.peers,
                "attempt": self.attempt,
                "policy": placement.policy,
                "predicted_step": placement.predicted_step,
            },
        )

    async def _assign_all(self, ckpt: Checkpoint) -> None:
        assert self.partition is not None
        registry = self.broker.registry
        addresses = {}
        for peer_id in self.peers:
            entry = registry.get(peer_id)
            addresses[peer_id] = None if entry is None else entry.record.data_path_address
        payloads = assignment_payloads(self.job, self.partition, self.peers, addresses, self.attempt, ckpt)
        calls = [self._call(self.peers[i], "assign", doc, ASSIGN_TIMEOUT) for i, doc in enumerate(payloads)]
        await self._gather(calls)

    # ---- steps and syncs -------------------------------------------------------------------------
    async def _step(self, step: int) -> None:
        job = self.job
        started = time.perf_counter()
        last = self.progress.metrics[-1]["seconds"] if self.progress.metrics else None
        timeout = step_timeout(getattr(self._placement, "predicted_step", None), last)
        replies = await self._gather(
            [self._call(p, "step", {"job_id": job.job_id, "step": step}, timeout) for p in self.peers]
        )
        seconds = time.perf_counter() - started
        self._busy_steps += 1
        samples = sum(job.spec.microbatch_sizes(step))
        row: dict[str, Any] = {"step": step, "seconds": seconds, "samples": samples}
        loss = None
        for i, r in enumerate(replies):
            busy = _seconds(r, "fp_seconds") + _seconds(r, "bp_seconds") + _seconds(r, "update_seconds")
            self._busy[i] = self._busy.get(i, 0.0) + busy
            predicted = None if self._placement is None else (self._placement.predicted or {}).get(i)
            if predicted is not None:  # refine the compnode's speed online from this sub-task
                self.speeds.observe(self.peers[i], self._planned_slowness[i], predicted, busy)
            if r.get("loss") is not None:
                loss = _float(r["loss"], f"step {step} loss from {self.peers[i]}")
            if r.get("outputs") is not None:
                self._outputs[step] = unpack_tensors(
                    r["outputs"], f"step {step} outputs from {self.peers[i]}"
                )
        self.progress.refused_frames = sum(int(r.get("refused") or 0) for r in replies)
        if loss is not None:
            row["loss"] = loss
        self.progress.metrics.append(row)
        self.broker.store.update_job(job.job_id, step=step + 1, loss=loss)
        self.broker.metrics.observe_step(
            job.job_id,
            step=step + 1,
            seconds=seconds,
            samples=samples,
            loss=loss,
            compnodes=len(self.peers),
            predicted_seconds=None if self._placement is None else self._placement.predicted_step,
        )

    async def _sync(self, step: int) -> Checkpoint:
        """Parameters and optimizer state of every sub-DAG after ``step - 1``: the new checkpoint, on disk."""
        replies = await self._gather(
            [self._call(p, "collect", {"job_id": self.job.job_id}, ASSIGN_TIMEOUT) for p in self.peers]
        )
        state = dict(self.job.state)
        optim: dict[str, torch.Tensor] = {}
        for peer, r in zip(self.peers, replies):
            state.update(unpack_tensors(r.get("state"), f"state from {peer}"))
            if r.get("optim") is not None:
                optim.update(unpack_tensors(r["optim"], f"optimizer state from {peer}"))
        ckpt = Checkpoint(step, state, optim, list(self.progress.metrics))
        await asyncio.to_thread(self.files.save_checkpoint, ckpt, self.attempt)
        return ckpt

    # ---- results ---------------------------------------------------------------------------------
    async def _collect_results(self, ckpt: Checkpoint) -> RunResult:
        assert self.partition is not None
        job, graph = self.job, self.job.graph
        grads = None
        if job.spec.task == "grad":
            replies = await self._gather(
                [self._call(p, "collect", {"job_id": job.job_id}, ASSIGN_TIMEOUT) for p in self.peers]
            )
            pieces = [unpack_tensors(r.get("grads"), f"grads from {p}") for p, r in zip(self.peers, replies)]
            grads = assemble_state(graph.state_keys, pieces, None, graph.aliases)
        weights = assemble_state(graph.state_keys, [ckpt.state], job.state, graph.aliases)
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
                "slowness": {p: self.speeds.slowness(p) for p in self.peers},
                "links": self.links.describe(self.peers),
                "predicted_step_seconds": None if self._placement is None else self._placement.predicted_step,
                "recoveries": self.progress.recoveries,
            },
        )
        for doc in plan["subdags"]:
            doc["compnode"] = self.peers[doc["subdag"]]
        outputs = [self._outputs[s] for s in sorted(self._outputs)]
        return RunResult(
            weights=weights,
            grads=grads,
            outputs=join_step_outputs(outputs) if job.spec.task == "infer" else None,
            metrics=self.progress.metrics,
            plan=plan,
            measured_seconds=measured,
        )

    async def _release_all(self, why: str, only: list[str] | None = None) -> None:
        peers = self.peers if only is None else only
        if not peers:
            return
        results = await asyncio.gather(
            *(
                self.broker.call(
                    p, "release", {"job_id": self.job.job_id, "reason": why}, timeout=RELEASE_TIMEOUT
                )
                for p in peers
                if p not in self.dead
            ),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                log.debug("job %s: release: %s", self.job.job_id, r)

    # ---- calls -----------------------------------------------------------------------------------
    async def _call(self, peer: str, method: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            return await self.broker.call(peer, method, payload, timeout=timeout)
        except FusionNetError as e:
            raise type(e)(f"compnode {peer} ({method}): {e}") from e

    async def _gather(self, calls: list[Any]) -> list[dict[str, Any]]:
        """All calls, or the first failure (the rest are cancelled: their compnodes get a release)."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _seconds(reply: dict[str, Any], key: str) -> float:
    value = reply.get(key, 0.0)
    return float(value) if isinstance(value, int | float) and value >= 0 else 0.0


def _float(value: object, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise JobError(f"{what}: expected a number, got {type(value).__name__}")
    return float(value)
