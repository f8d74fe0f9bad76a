"""Placing a job's sub-DAGs on compnodes (a mixin of ``jobrun.JobRun``): plan with the performance
model's policy (``planning.placement``) for the pending ``replanning.Replan``, release the old placement,
adopt the new one (partition, peers, replica ring, events) and assign every sub-DAG, its slice read from
the checkpoint just before it is sent, one slice at a time, each compnode setting up its sub-DAG while
the next slice is sent to another. A compnode that dies before it got its sub-DAG is excluded and the job
planned again. Also: which compnodes are candidates, and telling a compnode declared lost to drop its
sub-DAG.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from fusionnet.broker import replanning
from fusionnet.broker.assignment_payloads import iter_assignment_payloads
from fusionnet.broker.checkpoints import JobFiles
from fusionnet.broker.failures import MAX_RECOVERIES, PeerFailure
from fusionnet.broker.replanning import Replan
from fusionnet.broker.replicas import replicas_apart
from fusionnet.dag.partition import build_partition
from fusionnet.errors import ExecutionError
from fusionnet.planning.placement import Candidate, Placement

if TYPE_CHECKING:
    from fusionnet.broker.checkpoints import Checkpoint
    from fusionnet.broker.context import JobContext
    from fusionnet.broker.failures import FailureWatch, RecoveryLog
    from fusionnet.broker.job_calls import JobCalls
    from fusionnet.broker.replicas import ReplicaBook
    from fusionnet.broker.submission import SubmittedJob
    from fusionnet.dag.partition import Partition
    from fusionnet.planning.misprediction import PredictionWatch
    from fusionnet.planning.placement import JobShape

log = logging.getLogger("fusionnet.broker.jobs")


class JobPlacement:
    ctx: JobContext
    job: SubmittedJob
    shape: JobShape
    calls: JobCalls
    files: JobFiles
    watch: FailureWatch
    recoveries: RecoveryLog
    replicas: ReplicaBook
    prediction: PredictionWatch
    progress: Any  # ``jobrun.JobProgress``
    peers: list[str]
    partition: Partition | None
    pending: Replan | None
    attempt: int
    dead: set[str]
    leaving: set[str]
    unfit: set[str]
    _placement: Placement | None
    _busy: dict[int, float]
    _busy_steps: int
    _planned_slowness: list[float]
    _seen_candidates: set[str]
    _telling: set[asyncio.Task[None]]

    async def _release_all(self, why: str, only: list[str] | None = None) -> None:
        raise NotImplementedError  # JobRun's

    def _tell_lost(self, dead: set[str]) -> None:
        """A compnode declared lost may still be alive (a partition, a link that stalled): tell it, so it
        drops its sub-DAG at once instead of holding it until it is shut down. In the background (a dead
        one does not answer; the re-plan must not wait for it), owned and awaited when the job ends."""
        task = asyncio.ensure_future(self.calls.release(sorted(dead), "declared lost by the broker"))
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    def _candidates(self) -> list[Candidate]:
        return replanning.candidates(
            self.ctx.registry, self.ctx.speeds, self.dead | self.leaving | self.unfit
        )

    def _exclude(self, failure: PeerFailure) -> None:
        """The failed compnodes take no further part in this job: dead ones, or (a device OOM) ones too
        small for it, which are released like survivors."""
        (self.unfit if failure.unfit else self.dead).update(failure.dead)

    def _leavers(self) -> set[str]:
        return self.leaving & set(self.peers)

    def _hand_over(self, ckpt: Checkpoint) -> None:
        """Proactive: the checkpoint was just taken at this boundary; move the leavers' sub-DAGs."""
        self.pending = replanning.hand_over(self._leavers())
        self.recoveries.handing_over(set(self.pending.lost), ckpt.step)

    def _plan(self, replan: Replan) -> Placement:
        return replanning.next_placement(
            self.shape,
            replan,
            self.peers,
            self._candidates(),
            policy=self.ctx.settings.placement_policy,
            links=self.ctx.links.pairs(),
        )

    async def _place_and_assign(
        self, ckpt: Checkpoint, recovering: dict[str, Any] | None, replan: Replan
    ) -> None:
        started = time.monotonic()
        lost = set(replan.lost)
        while_placing: list[dict[str, Any]] = []  # recoveries of compnodes lost during this placement
        for _ in range(MAX_RECOVERIES):
            placement = await asyncio.to_thread(self._plan, replan)
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
                # A recovery like any other (log line, event, failovers_total, plan.json's entry),
                # though no step ran on it: nothing to replay once placed again.
                while_placing.append(self.recoveries.failed(failure, ckpt.step, ckpt.step, "broker"))
                self._exclude(failure)
                replan = replanning.failure(failure.dead)
                lost |= failure.dead
        else:
            raise ExecutionError(f"job {self.job.job_id}: could not assign its sub-DAGs")
        seconds = time.monotonic() - started
        self.recoveries.placed(recovering, seconds, len(self.peers), lost)
        for info in while_placing:
            self.recoveries.placed_after_loss(info, seconds)
        self.pending = None
        self._seen_candidates = {c.peer_id for c in self._candidates()}
        await self._probe_links()
        self.prediction.placed(None if self._placement is None else self._placement.predicted_step)

    def _adopt(self, placement: Placement) -> None:
        self._placement = placement
        chosen = placement.schedule
        if chosen is not None and chosen.microbatches is not None and self.job.spec.microbatch_choices:
            # data.microbatches auto, settled at the first placement: the compnodes get the count in the
            # spec, and every later placement (failover, re-plan) keeps it
            count = chosen.microbatches
            self.job.spec = self.job.spec.model_copy(update={"microbatches": count, "microbatch_choices": []})
            self.shape = replace(self.shape, microbatches=count, microbatch_choices=())
            if self.files.has_submission():  # a broker restart resumes with this count, not a new choice
                self.files.save_spec(self.job.spec.model_dump(mode="json"))
        self._busy, self._busy_steps = {}, 0  # measured times are per sub-DAG of this placement
        self.partition = build_partition(self.job.graph, placement.assignment)
        self.peers = list(placement.peers)
        # A replica is worth something only on another compnode: interleaved chunks (sub-DAG s on
        # compnode s mod p) put each ring neighbour on the next compnode, but never with one compnode.
        apart = replicas_apart(self.peers)
        self.replicas.reset(len(self.peers), enabled=self.job.spec.task == "train" and apart)
        self._planned_slowness = [self.ctx.speeds.slowness(p) for p in self.peers]
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
        self.ctx.store.add_job_event(
            self.job.job_id,
            "planned",
            {
                "compnodes": self.peers,
                "attempt": self.attempt,
                "policy": placement.policy,
                "predicted_step": placement.predicted_step,
            },
        )

    def _serve_keys(self) -> list[bytes] | None:
        """Per sub-DAG, the key of the broker's link to it for serving batches (a deployment's); a job
        has none."""
        return None

    async def _assign_all(self, ckpt: Checkpoint) -> None:
        assert self.partition is not None
        addresses = {}
        for peer_id in self.peers:
            entry = self.ctx.registry.get(peer_id)
            addresses[peer_id] = None if entry is None else entry.record.data_path_address
        chosen = None if self._placement is None else self._placement.schedule
        part_bytes = int(self.ctx.settings.stage_part_mb * 1e6)
        requests = iter_assignment_payloads(
            self.job,
            self.partition,
            self.peers,
            addresses,
            self.attempt,
            ckpt,
            schedule=None if chosen is None else chosen.name,
            chunks=None if chosen is None else chosen.chunks,
            replica_holders=self.replicas.holders(),
            stage_over=part_bytes,
            serve_keys=self._serve_keys(),
        )
        # The broker never holds the whole model (issue 11): one slice at a time is read and sent.
        await self.calls.stage_and_assign(self.peers, partial(asyncio.to_thread, next, requests), part_bytes)
