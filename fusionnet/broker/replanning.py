"""When a job needs a new placement, and which one: the decisions of a job run, as plain values.

A ``Replan`` says that the job must be placed (again) before its next step and why: its first
placement, a failure (``lost``: the dead compnodes), a proactive hand-over (``lost``: the leavers), an
elastic join or a misprediction (``proposed``: the placement the model chose at the step boundary; a
misprediction is measured step times that contradict the plan, ``planning.misprediction``). ``JobRun`` keeps
at most one pending ``Replan``; these functions decide it and turn it into a placement, without any
I/O, so they are tested in-process (``tests/test_jobrun_decisions.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from fusionnet.broker.registry import CompnodeRegistry
from fusionnet.broker.replicas import PACE
from fusionnet.errors import FusionNetError
from fusionnet.perfmodel.types import NO_OVERHEADS, DeviceSpec
from fusionnet.planning.placement import (
    SCHEDULER,
    Candidate,
    JobShape,
    PeerLinks,
    Placement,
    consider_growth,
    fastest_free,
    first_pool,
    plan_placement,
    pool_after_loss,
    predicted_step,
    worth_replanning,
)
from fusionnet.planning.speeds import SpeedBook

log = logging.getLogger("fusionnet.broker.jobs")

ReplanReason = Literal["first", "failure", "hand-over", "growth", "mispredicted"]


@dataclass(frozen=True)
class Replan:
    """The job must be placed before its next step: ``reason``, the compnodes whose sub-DAGs must move
    (``lost``), and for a growth the placement already chosen (``proposed``)."""

    reason: ReplanReason
    lost: frozenset[str] = frozenset()
    proposed: Placement | None = None

    def __post_init__(self) -> None:
        assert (self.proposed is not None) == (self.reason in PROPOSING), "only growth/misprediction propose"
        assert not self.lost or self.reason in ("failure", "hand-over"), "only a loss moves sub-DAGs"


PROPOSING = ("growth", "mispredicted")
# What a re-plan costs, in steps: the state collected on the broker and every sub-DAG assigned again
# take about as long as a few steps (benchmarks/scale.py, issue 16's link runs).
REPLAN_COST_STEPS = 3
# ... and never less than this (seconds): a collection and a round of assignments take a few hundred ms
# even for a toy model, which short steps would otherwise make look free.
REPLAN_COST_FLOOR = 1.0
FIRST = Replan("first")


def failure(dead: Collection[str]) -> Replan:
    return Replan("failure", frozenset(dead))


def hand_over(leaving: Collection[str]) -> Replan:
    return Replan("hand-over", frozenset(leaving))


def candidates(registry: CompnodeRegistry, speeds: SpeedBook, excluded: Collection[str]) -> list[Candidate]:
    """Compnodes a placement may use: schedulable, with a data path, not ``excluded`` (dead or leaving).

    A candidate that has not announced its per-op overheads yet (a first start's calibration takes
    seconds after ONLINE) is priced with those of a calibrated one of the same kind and nearest peak
    speed: counted as zero, they would make it look faster than its calibrated twin, and make every
    split of a small model look like pure communication.
    """
    out = []
    for e in registry.schedulable():
        if e.record.data_path_address is None or e.peer_id in excluded:
            continue
        try:
            device = speeds.device(e.peer_id, e.device_spec())
        except FusionNetError:  # no (or unusable) hardware record: the balanced policy places it
            device = None
        out.append(Candidate(e.peer_id, e.record.backup, device))
    return [replace(c, device=_with_overheads(c.device, out)) for c in out]


def _with_overheads(device: DeviceSpec | None, pool: Sequence[Candidate]) -> DeviceSpec | None:
    if device is None or device.overheads != NO_OVERHEADS:
        return device
    twins = [
        c.device
        for c in pool
        if c.device is not None and c.device.overheads != NO_OVERHEADS and c.device.kind == device.kind
    ]
    if not twins:
        return device
    nearest = min(twins, key=lambda d: abs(math.log(d.peak_flops / device.peak_flops)))
    return replace(device, overheads=nearest.overheads)


def next_placement(
    shape: JobShape,
    replan: Replan,
    peers: Sequence[str],
    pool: Sequence[Candidate],
    *,
    policy: str,
    links: PeerLinks | None,
) -> Placement:
    """The placement ``replan`` asks for: the proposed one (growth), a first one over the fastest
    compnodes, or the job's survivors topped up with backups (failure, hand-over) on at most as many
    sub-DAGs as before. ``PlanError`` when nobody is left to run it."""
    if replan.proposed is not None:
        return replan.proposed
    if not peers:
        return plan_placement(shape, first_pool(pool), policy=policy, links=links)
    survivors = pool_after_loss(peers, set(replan.lost), pool)
    stages = min(len(set(peers)), len(survivors))  # compnodes (interleaved: each holds chunks sub-DAGs)
    return plan_placement(shape, survivors, stages=stages, policy=policy, links=links)


def growth_replan(
    job_id: str,
    shape: JobShape,
    current: Placement,
    pool: Sequence[Candidate],
    min_gain: float,
    links: PeerLinks | None,
) -> Replan | None:
    """Elastic join: a ``Replan`` onto a larger placement when the model predicts a step faster by more
    than ``min_gain``; None otherwise (nobody new, no prediction, or not enough gain)."""
    try:
        growth = consider_growth(shape, current, pool, min_gain, links)
    except FusionNetError as e:
        log.info("job %s: no re-plan with the new compnodes: %s", job_id, e)
        return None
    if growth is None:
        return None
    if not growth.adopt:
        log.info("job %s: not re-planning: %s, gain below %g", job_id, growth.describe(), min_gain)
        return None
    log.info(
        "job %s: re-planning at this step boundary: %d -> %d compnode(s), %s",
        job_id,
        len(current.peers),
        len(growth.proposed.peers),
        growth.describe(),
    )
    return Replan("growth", proposed=growth.proposed)


def prediction_replan(
    job_id: str,
    shape: JobShape,
    current: Placement,
    pool: Sequence[Candidate],
    min_gain: float,
    links: PeerLinks | None,
    measured: float,
    remaining: int,
) -> tuple[Replan | None, float | None]:
    """Measured steps contradict the plan: the current placement priced again with what was learnt
    since (refined speeds, probed links), and a fresh plan over the job's compnodes plus the free
    regular ones. Returns the re-plan when the fresh plan beats the re-priced current one by more than
    ``min_gain`` and what it saves over the ``remaining`` steps pays for the move (about
    ``REPLAN_COST_STEPS`` measured steps: the state collected, every sub-DAG assigned again), else
    None; and the re-priced step (None when the model cannot say)."""
    if current.policy != SCHEDULER:
        return None, None
    by_id = {c.peer_id: c for c in pool}
    ours = list(dict.fromkeys(current.peers))  # a compnode holding several sub-DAGs (interleaved) once
    mine = [by_id[p] for p in ours if p in by_id]
    if len(mine) < len(ours):
        return None, None  # one of ours is not schedulable right now: failure handling comes first
    try:
        now = predicted_step(shape, current, pool, links)
        proposed = plan_placement(shape, mine + fastest_free(current.peers, pool), links=links)
    except FusionNetError as e:
        log.info("job %s: no re-plan after the misprediction: %s", job_id, e)
        return None, None
    predicted = current.predicted_step
    log.info(
        "job %s: measured %.3f s/step against %s predicted; re-priced %s, a fresh plan %s",
        job_id,
        measured,
        "-" if predicted is None else f"{predicted:.3f} s",
        "-" if now is None else f"{now:.3f} s",
        "-" if proposed.predicted_step is None else f"{proposed.predicted_step:.3f} s",
    )
    same = list(proposed.peers) == list(current.peers) and proposed.assignment == current.assignment
    if same or not worth_replanning(now, proposed, min_gain):
        return None, now
    assert now is not None and proposed.predicted_step is not None  # worth_replanning checked them
    saved = (now - proposed.predicted_step) / now * measured * remaining  # the gain, at measured speed
    if saved < max(REPLAN_COST_STEPS * measured, REPLAN_COST_FLOOR):
        log.info(
            "job %s: not re-planning: %d step(s) left save %.1f s, less than the move",
            job_id,
            remaining,
            saved,
        )
        return None, now
    log.info("job %s: re-planning at this step boundary (misprediction): %s", job_id, proposed.describe())
    return Replan("mispredicted", proposed=proposed), now


def next_sync(step: int, sync_seconds: float, step_seconds: float) -> int:
    """After a collection at ``step`` that took ``sync_seconds`` (steps take ``step_seconds``): the step
    count at which the next is due, so that collecting (the whole state through one link) costs at most
    about 1 / ``replicas.PACE`` of the job's time, as replication rounds do; every step where it is
    cheap. A failure replays at most those steps; nothing is lost."""
    if sync_seconds <= 0 or step_seconds <= 0:
        return step + 1
    return step + max(1, math.ceil((PACE - 1) * sync_seconds / step_seconds))


def sync_due(step: int, steps: int, sync_every: int, leaving: bool) -> bool:
    """A train job collects a checkpoint on the broker after ``step`` (the count of steps done) every
    ``sync_every`` steps (0: never; failover then relies on ``broker.replicas``), at the end (the
    results) and before a hand-over (the leaver's state must be in the checkpoint)."""
    return (sync_every > 0 and step % sync_every == 0) or step == steps or leaving
