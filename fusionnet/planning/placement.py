"""Which compnodes run a job and where its graph is cut: first placement, failover, hand-over, growth.

Pure functions of data (``Candidate`` values and the job's ``JobShape``), so the policy is tested
without a swarm. Every placement is two steps, propose then plan:

1. a *pool* of compnodes that may be used (``first_pool``, ``pool_after_loss``, ``grown_pool``):
   - a first placement uses regular compnodes; the backup pool stands by, and is used only when no
     regular compnode is free;
   - after a failure or a leave the survivors stay in the pool and the free backups join it (free
     regular compnodes only when the backups do not make up the loss); when nobody is free the job
     goes on over the survivors, with fewer sub-DAGs;
   - a compnode that joins mid-job is offered to the job at a step boundary (``grown_pool``).
2. ``plan_placement`` cuts the graph into ``min(wanted, pool, ops)`` sub-DAGs: with the scheduler of
   problem (2) and the performance model when every compnode of the pool has announced usable
   hardware (which devices, where to cut, predicted seconds), else the cost-balanced default policy on
   the fastest compnodes; a job that names its own cuts (``placement.cuts``) is cut there and its pieces
   given the k compnodes the model predicts fastest for them (``cut_plan``). Since every sub-DAG restarts
   from the broker's checkpoint at a new placement, a re-plan may move any cut (but the job's own):
   nothing but the checkpoint ties a sub-DAG to its compnode.

``worth_replanning`` is the elastic-join rule: a new plan is adopted only when the model predicts a
step time shorter by more than a threshold (moving costs an assignment round).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.errors import PlanError
from fusionnet.planning.auto_interleaved import best_interleaved, interleaving_pays, why_interleaved
from fusionnet.planning.cut_plan import plan_cuts
from fusionnet.planning.links import index_links
from fusionnet.planning.pipeline_schedule import AUTO, choose_schedule
from fusionnet.planning.placement_types import (
    BALANCED,
    CUTS,
    SCHEDULER,
    Candidate,
    JobShape,
    PeerLinks,
    Placement,
    fastest_first,
)
from fusionnet.planning.planner import PlannedJob, plan_graph, plan_interleaved
from fusionnet.planning.predict import predict_assignment
from fusionnet.schedules import INTERLEAVED

__all__ = [  # the types live in ``placement_types``; callers import them from here too
    "BALANCED",
    "CUTS",
    "SCHEDULER",
    "Candidate",
    "JobShape",
    "PeerLinks",
    "Placement",
]


def first_pool(candidates: Sequence[Candidate]) -> list[Candidate]:
    if not candidates:
        raise PlanError("no ONLINE compnode with a data path is registered with the broker")
    regular = fastest_first([c for c in candidates if not c.backup])
    return regular or fastest_first([c for c in candidates if c.backup])


def pool_after_loss(
    current: Sequence[str], lost: set[str], candidates: Sequence[Candidate]
) -> list[Candidate]:
    """Survivors first (in sub-DAG order), then free backups, then free regular compnodes up to the
    number of compnodes the job had (a compnode holding several sub-DAGs counts once)."""
    by_id = {c.peer_id: c for c in candidates}
    current = list(dict.fromkeys(current))
    survivors = [by_id[p] for p in current if p not in lost and p in by_id]
    busy = set(current) | lost
    free = [c for c in candidates if c.peer_id not in busy]
    backups = fastest_first([c for c in free if c.backup])
    regular = fastest_first([c for c in free if not c.backup])
    pool = survivors + backups
    short = len(current) - len(pool)
    if short > 0:
        pool += regular[:short]
    if not pool:
        raise PlanError(f"every compnode of the job is gone ({len(lost)} lost) and none is free to take over")
    return pool


def fastest_free(current: Sequence[str], candidates: Sequence[Candidate]) -> list[Candidate]:
    """The regular compnodes not in ``current``, fastest first."""
    return fastest_first([c for c in candidates if c.peer_id not in set(current) and not c.backup])


def grown_pool(current: Sequence[str], candidates: Sequence[Candidate]) -> list[Candidate] | None:
    """The job's compnodes plus every free regular one, or None when nobody new is free."""
    by_id = {c.peer_id: c for c in candidates}
    current = list(dict.fromkeys(current))
    mine = [by_id[p] for p in current if p in by_id]
    if len(mine) < len(current):
        return None  # one of ours is not schedulable right now: failure handling comes first
    free = fastest_free(current, candidates)
    return mine + free if free else None


def plan_placement(
    shape: JobShape,
    pool: Sequence[Candidate],
    *,
    stages: int | None = None,
    policy: str = SCHEDULER,
    links: PeerLinks | None = None,
) -> Placement:
    """Cuts the job into ``stages`` sub-DAGs (default ``min(wanted, pool, ops)``, fewer where the model
    would leave a compnode without work: ``idle_stages``) placed on the pool, by
    the performance model (``policy=SCHEDULER``, when every compnode's hardware is known) or by cost
    balance on the fastest compnodes (``BALANCED``: the plain default policy, for comparison).
    ``links`` are the measured links between compnodes (``links.LinkBook.pairs``).

    Raises ``PlanError`` when the performance model finds that nothing fits (naming the constraint), or
    when the job's pipeline schedule cannot run on the cut."""
    placement = _place(shape, pool, stages, policy, links)
    by_id = {c.peer_id: c.device for c in pool}
    devices = [by_id.get(p) for p in placement.peers]
    choice = choose_schedule(
        shape.schedule,
        shape.graph,
        build_partition(shape.graph, placement.assignment),
        microbatches=shape.microbatches,
        devices=None if any(d is None for d in devices) else devices,  # type: ignore[arg-type]
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links(placement.peers, links),
        microbatch_choices=shape.microbatch_choices,
        chunks=shape.chunks,
    )
    step = choice.predicted.get(choice.name, placement.predicted_step)
    placement = replace(placement, schedule=choice, predicted_step=step)
    if shape.schedule == AUTO and shape.chunks == 1 and placement.policy == SCHEDULER:
        return _interleaved_if_faster(shape, pool, placement, links)
    return placement


def _interleaved_if_faster(
    shape: JobShape, pool: Sequence[Candidate], placement: Placement, links: PeerLinks | None
) -> Placement:
    """``auto``: the same compnodes running interleaved-1f1b when the model predicts it clearly faster
    than the schedule chosen for one sub-DAG per compnode (``auto_interleaved``); else ``placement``."""
    choice = placement.schedule
    assert choice is not None
    by_id = {c.peer_id: c for c in pool}
    chosen = fastest_first([by_id[p] for p in dict.fromkeys(placement.peers)])
    m = choice.microbatches or shape.microbatches
    option = best_interleaved(
        shape.graph,
        [c.device for c in chosen],  # type: ignore[misc]  # the SCHEDULER policy: all known
        microbatches=m,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links((c.peer_id for c in chosen), links),
    )
    if option is None or not interleaving_pays(placement.predicted_step, option, shape.interleave_gain):
        return placement
    planned = option.planned
    assert placement.predicted_step is not None
    interleaved = replace(
        choice,
        name=INTERLEAVED,
        why=why_interleaved(option, choice.name, placement.predicted_step, shape.interleave_gain),
        predicted={**choice.predicted, INTERLEAVED: option.step_seconds},
        chunks=option.chunks,
    )
    return Placement(
        peers=tuple(chosen[s % len(chosen)].peer_id for s in range(len(chosen) * option.chunks)),
        assignment=planned.assignment,
        policy=SCHEDULER,
        predicted=planned.predicted_seconds,
        predicted_step=option.step_seconds,
        schedule=interleaved,
        stage_timing=planned.stage_timing,
    )


def _place(
    shape: JobShape, pool: Sequence[Candidate], stages: int | None, policy: str, links: PeerLinks | None
) -> Placement:
    if policy not in (SCHEDULER, BALANCED):
        raise PlanError(f"placement policy {policy!r} must be {SCHEDULER!r} or {BALANCED!r}")
    if not pool:
        raise PlanError("no compnode to place the job on")
    k = stages if stages is not None else min(shape.wanted, len(pool), max(shape.ops, 1))
    if not 1 <= k <= len(pool):
        raise PlanError(f"cannot place {k} sub-DAG(s) on {len(pool)} compnode(s)")
    if shape.chunks > 1:
        return _place_interleaved(shape, fastest_first(pool)[:k], links)
    cut = shape.cut_assignment(k)
    if cut is None and policy == SCHEDULER and all(c.device is not None for c in pool):
        planned = _schedule(shape, pool, links, stages=k)
        while stages is None and len(planned.devices) > 1 and idle_stages(planned.predicted_seconds):
            # Forced to k stages, the model left some without work (slow links: one compnode does it
            # all). A compnode that gets no work goes back to the pool: the model picks fewer stages
            # (free to, it may still keep a stub that saves it a millisecond: then fewer again).
            planned = _schedule(shape, pool, links, max_devices=len(planned.devices) - 1)
        return _placed(planned, pool, SCHEDULER)
    # The balanced split (or the job's cuts on unknown hardware): sub-DAG i on the i-th fastest compnode.
    # Cuts on known hardware: any k of the pool (by the model), else the k fastest when they are known.
    chosen = fastest_first(pool)[:k]
    if cut is not None and all(c.device is not None for c in pool):
        return _place_cuts(shape, fastest_first(pool), cut, links)  # any k of them: by the model
    if cut is not None and all(c.device is not None for c in chosen):
        return _place_cuts(shape, chosen, cut, links)
    placement = Placement(
        peers=tuple(c.peer_id for c in chosen),
        assignment=balanced_assignment(shape.graph, k) if cut is None else cut,
        policy=BALANCED if cut is None else CUTS,
    )
    if any(c.device is None for c in chosen):
        return placement
    # Known hardware: predict this split too, so that plan.json compares it with what ran.
    predicted = predict_assignment(
        shape.graph,
        placement.assignment,
        [c.device for c in chosen],  # type: ignore[misc]
        microbatches=shape.microbatches,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links(placement.peers, links),
        pipeline_schedule=shape.priced,
    )
    return replace(
        placement,
        predicted=predicted.per_subdag,
        predicted_step=predicted.step_seconds,
        stage_timing=predicted.stage_timing,
    )


def _place_cuts(
    shape: JobShape, chosen: Sequence[Candidate], cut: dict[str, int], links: PeerLinks | None
) -> Placement:
    """The job's own cuts on k of ``chosen``, each piece on the one ``cut_plan.plan_cuts`` picks
    (``fusionnet plan`` shows the same)."""
    planned = plan_cuts(
        shape.graph,
        [c.device for c in chosen],  # type: ignore[misc]  # all known (the caller checked)
        cut,
        microbatches=shape.microbatches,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links((c.peer_id for c in chosen), links),
        pipeline_schedule=shape.priced,
    )
    return _placed(planned, chosen, CUTS)


def _placed(planned: PlannedJob, pool: Sequence[Candidate], policy: str) -> Placement:
    """The planner's answer as a placement: sub-DAG i on ``pool[planned.devices[i]]``."""
    return Placement(
        peers=tuple(pool[d].peer_id for d in planned.devices),
        assignment=dict(planned.assignment),
        policy=policy,
        predicted=dict(planned.predicted_seconds),
        predicted_step=planned.predicted_step_seconds,
        stage_timing=dict(planned.stage_timing),
    )


def _place_interleaved(shape: JobShape, chosen: Sequence[Candidate], links: PeerLinks | None) -> Placement:
    """interleaved-1f1b: the model cut into p x chunks sub-DAGs (evenly, or at the job's cuts), compnode d
    (of the p fastest) holding d, p + d, ...; the performance model prices that cut when every compnode's
    hardware is known (``planner.plan_interleaved``, which ``fusionnet plan`` shows too)."""
    p, v = len(chosen), shape.chunks
    peers = tuple(chosen[s % p].peer_id for s in range(p * v))
    cut = shape.cut_assignment(p * v)
    policy = BALANCED if cut is None else CUTS
    if any(c.device is None for c in chosen):
        assignment = cut or balanced_assignment(shape.graph, p * v)
        return Placement(peers=peers, assignment=assignment, policy=policy)
    planned = plan_interleaved(
        shape.graph,
        [c.device for c in chosen],  # type: ignore[misc]
        v,
        microbatches=shape.microbatches,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links((c.peer_id for c in chosen), links),
        assignment=cut,
    )
    return Placement(
        peers=peers,
        assignment=planned.assignment,
        policy=policy,
        predicted=planned.predicted_seconds,
        predicted_step=planned.predicted_step_seconds,
        stage_timing=planned.stage_timing,
    )


IDLE_SHARE = 0.02  # a stage predicted to do less than this share of the step's compute gets no real work


def idle_stages(predicted_seconds: Mapping[int, float]) -> list[int]:
    """The sub-DAGs whose predicted compute is a stub's (under ``IDLE_SHARE`` of the total)."""
    total = sum(predicted_seconds.values())
    if total <= 0:
        return []
    return sorted(i for i, t in predicted_seconds.items() if t < IDLE_SHARE * total)


def _schedule(
    shape: JobShape,
    pool: Sequence[Candidate],
    links: PeerLinks | None,
    *,
    stages: int | None = None,
    max_devices: int | None = None,
) -> PlannedJob:
    return plan_graph(
        shape.graph,
        [c.device for c in pool],  # type: ignore[misc]
        microbatches=shape.microbatches,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        stages=stages,
        max_devices=max_devices,
        pipeline_schedule=shape.priced,
        links=index_links((c.peer_id for c in pool), links),
    )


def predicted_step(
    shape: JobShape, placement: Placement, candidates: Sequence[Candidate], links: PeerLinks | None = None
) -> float | None:
    """The model's step time for an existing placement on the compnodes as they are announced now (their
    speed factors may have been refined since it was planned), or None when it cannot say."""
    by_id = {c.peer_id: c for c in candidates}
    devices = [by_id[p].device if p in by_id else None for p in placement.peers]
    if any(d is None for d in devices):
        return None
    return predict_assignment(
        shape.graph,
        placement.assignment,
        devices,  # type: ignore[arg-type]
        microbatches=shape.microbatches,
        batch_size=shape.batch_size,
        optimizer=shape.optimizer,
        links=index_links(placement.peers, links),
        pipeline_schedule=shape.priced if placement.schedule is None else placement.schedule.name,
        chunks=max(shape.chunks, placement.chunks),
    ).step_seconds


def worth_replanning(current_step: float | None, proposed: Placement, min_gain: float) -> bool:
    """Adopt ``proposed`` when it is predicted faster than now by more than ``min_gain`` (a fraction)."""
    if proposed.predicted_step is None or current_step is None or current_step <= 0:
        return False
    return proposed.predicted_step < current_step * (1.0 - min_gain)


@dataclass(frozen=True)
class Growth:
    """The elastic-join decision: the model's step now and with the new compnodes, and the verdict."""

    now: float | None
    proposed: Placement
    adopt: bool

    def describe(self) -> str:
        def fmt(v: float | None) -> str:
            return "?" if v is None else f"{v:.4g}"

        return f"predicted step {fmt(self.now)} -> {fmt(self.proposed.predicted_step)} s"


def consider_growth(
    shape: JobShape,
    current: Placement,
    candidates: Sequence[Candidate],
    min_gain: float,
    links: PeerLinks | None = None,
) -> Growth | None:
    """Elastic join: the job's compnodes plus the free regular ones, planned by the model, adopted when
    the step gets shorter by more than ``min_gain``; None when nobody new is free (or the job is not
    placed by the model). ``PlanError`` when the model cannot place the larger pool."""
    if current.policy != SCHEDULER:
        return None
    pool = grown_pool(current.peers, candidates)
    if pool is None:
        return None
    now = predicted_step(shape, current, candidates, links)
    proposed = plan_placement(shape, pool, links=links)
    return Growth(now, proposed, worth_replanning(now, proposed, min_gain))
