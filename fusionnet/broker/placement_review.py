"""A job's placement looked at again between steps (a mixin of ``jobrun.JobRun``): elastic join when
new compnodes appear (FusionAI 3.6), a re-plan when measured steps or link probes contradict the
performance model (issue 16), and the link probes after each placement that price it on measured links.
The decisions themselves are pure functions in ``replanning`` and ``planning.misprediction``; this is
their wiring to the run's state, events and calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from fusionnet.broker import replanning
from fusionnet.broker.links import probe_placement
from fusionnet.broker.replanning import Replan
from fusionnet.planning.misprediction import PredictionWatch
from fusionnet.planning.placement import Candidate, JobShape, Placement, predicted_step

if TYPE_CHECKING:
    from fusionnet.broker.context import JobContext
    from fusionnet.broker.job_calls import JobCalls
    from fusionnet.broker.submission import SubmittedJob
    from fusionnet.dag.partition import Partition


class Progress(Protocol):
    metrics: list[dict[str, Any]]  # one row per step done (``jobrun.JobProgress``)


class PlacementReview:
    ctx: JobContext
    job: SubmittedJob
    shape: JobShape
    progress: Progress
    calls: JobCalls
    peers: list[str]
    partition: Partition | None
    prediction: PredictionWatch
    _placement: Placement | None
    _seen_candidates: set[str]
    _probes_contradict: bool

    def _candidates(self) -> list[Candidate]:
        raise NotImplementedError  # JobRun's

    async def _grow(self) -> Replan | None:
        """Elastic join, looked at when the set of free compnodes changed since the last look."""
        candidates = self._candidates()
        if self._placement is None or {c.peer_id for c in candidates} == self._seen_candidates:
            return None  # nothing joined (or left) since the last look: do not plan again
        self._seen_candidates = {c.peer_id for c in candidates}
        replan = await asyncio.to_thread(
            replanning.growth_replan,
            self.job.job_id,
            self.shape,
            self._placement,
            candidates,
            self.ctx.settings.replan_gain,
            self.ctx.links.pairs(),
        )
        if replan is not None and replan.proposed is not None:
            self.ctx.store.add_job_event(
                self.job.job_id,
                "re-plan",
                {
                    "from": self.peers,
                    "to": list(replan.proposed.peers),
                    "predicted": [self._placement.predicted_step, replan.proposed.predicted_step],
                },
            )
        return replan

    async def _recheck_prediction(self) -> Replan | None:
        """Issue 16: when measured steps (``PredictionWatch``) or the link probes after a placement
        contradict the plan, the links are probed where stale, the placement priced again and a fresh
        plan adopted when it is worth it."""
        placement = self._placement
        if placement is None or not self.progress.metrics:
            return None
        measured = self.progress.metrics[-1]["seconds"]
        # A probe contradiction alone does not bypass the watch's floor: a job of steps that short cannot
        # win back what a re-plan costs, however the links were priced.
        probed = self._probes_contradict and measured >= self.prediction.min_seconds
        looks = self.prediction.observe(measured) or probed
        self._probes_contradict = False
        if not looks:
            return None
        # The steps contradict the plan: the job's links are timed again, however recently, since a
        # link that slowed down mid-job (a shared uplink, a throttled route) would otherwise keep its
        # old figure for 10 minutes, and the re-pricing below (and the snapshots' pace) with it.
        await self._probe_links(fresh=True)
        self._probes_contradict = False  # this look covers what those probes found
        placement = self._placement
        assert placement is not None
        replan, now = await asyncio.to_thread(
            replanning.prediction_replan,
            self.job.job_id,
            self.shape,
            placement,
            self._candidates(),
            self.ctx.settings.replan_gain,
            self.ctx.links.pairs(),
            measured,
            self.job.spec.step_count - len(self.progress.metrics),
        )
        self.prediction.repredicted(now)
        if now is not None:
            self._placement = replace(placement, predicted_step=now)
        event: dict[str, Any] = {"measured": measured, "predicted": placement.predicted_step, "repriced": now}
        if replan is not None and replan.proposed is not None:
            event.update(to=list(replan.proposed.peers), proposed=replan.proposed.predicted_step)
        self.ctx.store.add_job_event(self.job.job_id, "misprediction", event)
        return replan

    async def _probe_links(self, *, fresh: bool = False) -> None:
        """Times the links this placement's activations take that the broker has not measured lately
        (all of them with ``fresh``; ``links.probe_placement``), then predicts the step again on them."""
        assert self.partition is not None
        consumers = {
            s.index: {c for cs in s.consumers.values() for c in cs if c != s.index}
            for s in self.partition.subdags
        }
        probed = await probe_placement(
            self.job.job_id, self.peers, consumers, self.ctx.links, self.calls.probe, fresh=fresh
        )
        placement = self._placement
        if probed and placement is not None and placement.predicted_step is not None:
            step = await asyncio.to_thread(
                predicted_step, self.shape, placement, self._candidates(), self.ctx.links.pairs()
            )
            if step is not None:
                # The plan was priced on links it had not measured (a backup brought in, say): when the
                # probes contradict it, the next step boundary looks at the placement again.
                self._probes_contradict = self.prediction.contradicts(placement.predicted_step, step)
                self._placement = replace(placement, predicted_step=step)
