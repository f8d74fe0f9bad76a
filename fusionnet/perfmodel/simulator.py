"""Pipeline schedule simulator: step time and per-stage peak in-flight micro-batches.

Resources: each device runs its operations one at a time in the schedule's order (a device is one
stage, or several with an interleaved schedule: its ``U`` then updates them all); each
directed link between two stages carries one transfer at a time, first come first served. Compute
and communication overlap (a device computes while its links move data), as eq. (4) assumes.
Stages are numbered in a topological order of the sub-DAG graph; a ``Hop`` from stage ``src`` to a
later stage ``dst`` carries activations forward (``fwd`` seconds per micro-batch on src -> dst) and
their gradients backward (``bwd`` seconds on dst -> src). Any DAG of stages works, not just a chain.

Schedules are the executor's own ``fusionnet.schedules.Schedule`` objects (or their names: gpipe,
1f1b, zero-bubble), so the prediction follows the order that runs. A split backward runs I (input
gradients, sent on at its end) for ``input_share`` of the stage's BP seconds and W (weight gradients)
for the rest. A whole B on a stage that sends gradients back runs as the executor runs it
(``dag.schedule_loop.run_device_step``): its I, its gradients sent, and its W left pending; the device
runs pending Ws, oldest first, while its next B or I waits for gradients, and all of them before its
next F, W, U or the end of its program; a B followed by an F on a stage whose last F did not wait for
its inputs runs whole, its gradients sent at its end. ``infer`` tasks run forwards only; ``grad``
tasks skip the update.

The step ends when the last stage finishes its last operation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import SCHEDULES, TASKS
from fusionnet.schedules import Schedule, ScheduleError, check, make_schedule


@dataclass(frozen=True)
class StageTimes:
    fp: float  # seconds per micro-batch
    bp: float  # seconds per micro-batch
    update: float = 0.0  # seconds per step
    input_share: float = 0.5  # of ``bp``, the I half of a split backward (the rest is W)


@dataclass(frozen=True)
class Hop:
    src: int
    dst: int
    fwd: float  # seconds per micro-batch on src -> dst
    bwd: float = 0.0  # seconds per micro-batch on dst -> src
    # Once per step (a parameter read across the cut): more seconds on the message of src's first
    # forward, and on the gradient message of dst's last seeding backward (B or I).
    fwd_once: float = 0.0
    bwd_once: float = 0.0


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F", "B", "I", "W" or "U"
    microbatch: int  # -1 for the update
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    step_seconds: float
    stage_busy: tuple[float, ...]  # compute seconds per stage
    stage_finish: tuple[float, ...]
    peak_inflight: tuple[int, ...]  # micro-batches whose activations a stage held at once
    events: tuple[Event, ...] = ()  # only with record=True


def stage_program(
    schedule: str, task: str, stage: int, num_stages: int, m: int, chunks: int = 1
) -> list[tuple[str, int]]:
    """The order in which one stage runs its operations."""
    prog = make_schedule(schedule, num_stages, m, task, chunks).program(stage)
    return [(a.kind, a.mb) for a in prog]


def _resolve(schedule: str | Schedule, task: str, n: int, m: int, chunks: int = 1) -> Schedule:
    try:
        if isinstance(schedule, Schedule):
            check(schedule)
            if (schedule.stages, schedule.microbatches) != (n, m):
                raise PlanError(
                    f"schedule {schedule.name!r} is for {schedule.stages} stages x {schedule.microbatches} "
                    f"micro-batches, the pipeline has {n} x {m}"
                )
            return schedule.for_task(task)
        return make_schedule(schedule, n, m, task, chunks)
    except ScheduleError as e:
        raise PlanError(str(e)) from None


def _validate(
    stages: Sequence[StageTimes], hops: Sequence[Hop], m: int, schedule: str | Schedule, task: str
) -> None:
    if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
        raise PlanError(f"schedule {schedule!r} must be one of {', '.join(SCHEDULES)}")
    if task not in TASKS:
        raise PlanError(f"task {task!r} must be one of {', '.join(TASKS)}")
    if not isinstance(m, int) or m < 1:
        raise PlanError(f"microbatches must be a positive integer, got {m!r}")
    if not stages:
        raise PlanError("a pipeline needs at least one stage")
    for i, s in enumerate(stages):
        if min(s.fp, s.bp, s.update) < 0:
            raise PlanError(f"stage {i} has a negative time")
        if not 0 <= s.input_share <= 1:
            raise PlanError(f"stage {i}: input_share must be in [0, 1]")
    seen = set()
    for h in hops:
        if not 0 <= h.src < h.dst < len(stages):
            raise PlanError(
                f"hop {h.src} -> {h.dst} must go from a stage to a later one (0..{len(stages) - 1})"
            )
        if (h.src, h.dst) in seen:
            raise PlanError(f"hop {h.src} -> {h.dst} is given twice")
        if min(h.fwd, h.bwd, h.fwd_once, h.bwd_once) < 0:
            raise PlanError(f"hop {h.src} -> {h.dst} has a negative time")
        seen.add((h.src, h.dst))


def _ready(arrival: list[list[float | None]], hop_ids: list[int], k: int, start: float) -> float | None:
    """When micro-batch ``k``'s inputs over ``hop_ids`` have all arrived (not before ``start``), or
    None while one is still missing."""
    for j in hop_ids:
        t = arrival[j][k]
        if t is None:
            return None
        if t > start:
            start = t
    return start


def _send(
    hop_ids: list[int],
    k: int,
    end: float,
    link_free: list[float],
    arrival: list[list[float | None]],
    seconds: list[float],
    once: list[float] | None = None,
) -> None:
    """A task that ended at ``end`` sends micro-batch ``k`` over ``hop_ids`` (with ``once``: the
    step's once-per-step values too): each link carries one message at a time, so a message waits
    for the one before it."""
    for j in hop_ids:
        t0 = end if end > link_free[j] else link_free[j]
        link_free[j] = arrival[j][k] = t0 + seconds[j] + (once[j] if once is not None else 0.0)


def simulate(
    stages: Sequence[StageTimes],
    hops: Sequence[Hop],
    microbatches: int,
    *,
    schedule: str | Schedule = "gpipe",
    task: str = "train",
    record: bool = False,
    chunks: int = 1,
) -> SimResult:
    """Run the schedule on the stage and link resources and return the step's timing (``chunks``: the
    stages per device of a schedule given by name, interleaved-1f1b's)."""
    _validate(stages, hops, microbatches, schedule, task)
    n, m = len(stages), microbatches
    hops = sorted(hops, key=lambda h: (h.src, h.dst))
    ins: list[list[int]] = [[j for j, h in enumerate(hops) if h.dst == s] for s in range(n)]  # hops in
    outs: list[list[int]] = [[j for j, h in enumerate(hops) if h.src == s] for s in range(n)]
    fwd_t = [h.fwd for h in hops]
    bwd_t = [h.bwd for h in hops]
    fwd_once = [h.fwd_once for h in hops]
    bwd_once = [h.bwd_once for h in hops]
    fwd_arrival: list[list[float | None]] = [[None] * m for _ in hops]  # activation at hop.dst
    bwd_arrival: list[list[float | None]] = [[None] * m for _ in hops]  # gradient at hop.src
    fwd_free = [0.0] * len(hops)  # the src -> dst link
    bwd_free = [0.0] * len(hops)  # the dst -> src link
    plan = _resolve(schedule, task, n, m, chunks)
    # One program per device, each action tagged with its stage (an interleaved device runs several).
    programs = [[(a.kind, a.mb, plan.stage_of(d, a)) for a in prog] for d, prog in enumerate(plan.programs)]
    first_f: list[tuple[int, int] | None] = [None] * n  # (device, position) of a stage's first F
    last_seed: list[tuple[int, int] | None] = [None] * n  # and of its last B or I
    for d, prog in enumerate(programs):
        for i, (kind, _, st) in enumerate(prog):
            if kind == "F" and first_f[st] is None:
                first_f[st] = (d, i)
            if kind in ("B", "I"):
                last_seed[st] = (d, i)
    dur = {
        "F": [st.fp for st in stages],
        "B": [st.bp for st in stages],
        "I": [st.bp * st.input_share for st in stages],
        "W": [st.bp * (1 - st.input_share) for st in stages],
        "U": [st.update for st in stages],
    }
    free = [0.0] * len(programs)  # per device
    busy = [0.0] * n
    held = [0] * n
    peak = [0] * n
    pos = [0] * len(programs)
    events: list[Event] = []
    deferred: list[deque[tuple[int, int]]] = [deque() for _ in programs]  # (stage, micro-batch) Ws
    waited = [True] * n  # whether a stage's last F waited for its inputs

    def deferred_weight(dev: int) -> None:
        s, k = deferred[dev].popleft()
        start, end = free[dev], free[dev] + dur["W"][s]
        free[dev] = end
        busy[s] += dur["W"][s]
        held[s] -= 1
        if record:
            events.append(Event(s, "W", k, start, end))

    def all_deferred(dev: int) -> None:
        while deferred[dev]:
            deferred_weight(dev)

    remaining = sum(len(p) for p in programs)
    forward_sweep = True
    while remaining:
        progressed = False
        # alternate sweep directions: forward waves run down the pipeline, backward waves up it
        for dev in range(len(programs)) if forward_sweep else range(len(programs) - 1, -1, -1):
            prog = programs[dev]
            while pos[dev] < len(prog):
                kind, k, s = prog[pos[dev]]
                if kind in ("B", "I"):
                    arrived = _ready(bwd_arrival, outs[s], k, 0.0)
                    if arrived is None:
                        break
                    while deferred[dev] and arrived > free[dev]:  # a pending W fills the wait
                        deferred_weight(dev)
                    start = max(arrived, free[dev])
                else:
                    all_deferred(dev)
                    start = _ready(fwd_arrival, ins[s], k, free[dev]) if kind == "F" else free[dev]
                if start is None:
                    break
                if kind == "F":
                    waited[s] = start > free[dev]
                here = (dev, pos[dev])
                # The executor's rules: a B whose W could not wait, after an F that did not, runs whole;
                # any other B on a stage that sends gradients back leaves its W pending
                upcoming = prog[pos[dev] + 1][0] if pos[dev] + 1 < len(prog) else None
                whole = kind == "B" and upcoming == "F" and not waited[s]
                defers = kind == "B" and bool(ins[s]) and not whole
                if defers:
                    kind = "I"
                # an interleaved device's U updates all its chunks: their updates, one after another
                stages_now = [c * len(programs) + dev for c in range(plan.chunks)] if kind == "U" else [s]
                d = sum(dur[kind][t] for t in stages_now)
                end = start + d
                free[dev] = end
                for t in stages_now:
                    busy[t] += dur[kind][t]
                pos[dev] += 1
                remaining -= 1
                progressed = True
                if record:
                    events.append(Event(s, kind, k, start, end))
                if kind == "F":
                    if task != "infer":
                        held[s] += 1
                        peak[s] = max(peak[s], held[s])
                    else:
                        peak[s] = 1
                    once = fwd_once if here == first_f[s] else None
                    _send(outs[s], k, end, fwd_free, fwd_arrival, fwd_t, once)
                if kind in ("B", "I"):
                    once = bwd_once if here == last_seed[s] else None
                    sent = end  # after I, or after a B run whole
                    _send(ins[s], k, sent, bwd_free, bwd_arrival, bwd_t, once)
                if defers:
                    deferred[dev].append((s, k))
                elif kind in ("B", "W"):
                    held[s] -= 1
            if pos[dev] == len(prog):
                all_deferred(dev)
        if not progressed:  # check names what each stuck stage waits for
            try:
                check(plan, [(h.src, h.dst) for h in hops])
            except ScheduleError as e:
                raise PlanError(str(e)) from None
            raise PlanError(f"schedule {plan.name!r} deadlocks on these hops")
        forward_sweep = not forward_sweep
    step = max(max(free), max(fwd_free, default=0.0), max(bwd_free, default=0.0))
    return SimResult(
        step_seconds=step,
        stage_busy=tuple(busy),
        stage_finish=tuple(free[plan.device_of(s)] for s in range(n)),
        peak_inflight=tuple(peak),
        events=tuple(events),
    )


def compute_path(
    compute: Sequence[tuple[float, float, float]],
    users: Sequence[Sequence[int]],
    microbatches: int,
    *,
    schedule: str | Schedule = "gpipe",
    task: str = "train",
    chunks: int = 1,
) -> float:
    """How long a step that ran would have taken had every message been free: its schedule run on
    the stages' measured compute alone. ``compute[s]``: sub-DAG ``s``'s FP, BP and Update seconds in
    the step (all its micro-batches); ``users[s]``: the sub-DAGs that read its outputs. The step's
    wall time minus this is what the network, the runtime and the broker's calls added. A split
    backward (zero-bubble) is priced as half I, half W: the step reports their sum."""
    m = microbatches
    stages = [StageTimes(fp / m, bp / m, up) for fp, bp, up in compute]
    hops = sorted({(s, u) for s, readers in enumerate(users) for u in readers if s < u < len(stages)})
    return simulate(
        stages, [Hop(s, u, 0.0) for s, u in hops], m, schedule=schedule, task=task, chunks=chunks
    ).step_seconds
