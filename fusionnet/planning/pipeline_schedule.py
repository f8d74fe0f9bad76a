"""Which pipeline schedule a job runs (``placement.schedule``): a named one, checked against the real
cut (skip edges included), or, for ``auto``, the one the performance model predicts fastest among
those whose memory fits, preferring the one that holds fewer activations on a near tie.

The simulator prices the same ``fusionnet.schedules`` objects the executors run, so the prediction
in plan.json is for the order that runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition
from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import DeviceSpec, Workload
from fusionnet.planning.costgraph import cost_graph, micro_batch_scale
from fusionnet.planning.planner import Links, make_swarm
from fusionnet.planning.scheduler import plan_for_assignment
from fusionnet.schedules import INTERLEAVED, NAMES, Edge, ScheduleError, check, make_schedule

AUTO = "auto"
# On a near tie (within TIE of the fastest) the first of these wins: fewer live activations first.
PREFERENCE = ("1f1b", "zero-bubble", "gpipe")
TIE = 0.01


@dataclass(frozen=True)
class ScheduleChoice:
    name: str  # the schedule that runs
    why: str
    predicted: dict[str, float] = field(default_factory=dict)  # schedule -> predicted step seconds
    # ``data.microbatches: auto``: the count chosen (None: the job's own), and per count priced the
    # fastest predicted step of any schedule that fits
    microbatches: int | None = None
    by_microbatches: dict[int, float] = field(default_factory=dict)
    chunks: int = 1  # interleaved-1f1b: sub-DAGs per compnode (named, or chosen by ``auto``)

    def to_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "name": self.name,
            "why": self.why,
            "predicted_step_seconds": dict(self.predicted),
        }
        if self.chunks > 1:
            doc["chunks"] = self.chunks
        if self.microbatches is not None:
            doc["microbatches"] = self.microbatches
            doc["predicted_step_seconds_by_microbatches"] = {
                str(m): t for m, t in self.by_microbatches.items()
            }
        return doc


def stage_edges(partition: Partition) -> list[Edge]:
    """(producer, consumer) sub-DAG pairs of the cut: every edge an FP waits on (rows of a tied weight
    are traded at the step's start, ``dag.row_lookup``, and wait on no FP)."""
    return sorted(
        {
            (s.index, d)
            for s in partition.subdags
            for name, ds in s.consumers.items()
            if name not in s.row_serves
            for d in ds
            if d != s.index
        }
    )


def check_schedule(name: str, partition: Partition, microbatches: int, task: str, chunks: int = 1) -> None:
    """Raises ``PlanError`` when ``name`` is unknown or cannot run on this cut (``chunks``: sub-DAGs
    per compnode, interleaved-1f1b's)."""
    try:
        sched = make_schedule(name, len(partition.subdags), microbatches, task, chunks)
        check(sched, stage_edges(partition))
    except ScheduleError as e:
        raise PlanError(f"placement.schedule {name!r}: {e}") from None


def _predict(
    name: str,
    graph: IRGraph,
    partition: Partition,
    devices: Sequence[DeviceSpec],
    microbatches: int,
    batch_size: int | None,
    optimizer: str | Mapping[str, str] | None,
    links: Links,
    chunks: int = 1,
) -> float | None:
    """Predicted step seconds under ``name``, or None when its memory does not fit."""
    k = len(partition.subdags)
    devs = list(devices) * k if len(devices) == 1 else list(devices)
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    try:
        plan = plan_for_assignment(
            cg,
            make_swarm(devs, links, None),
            Workload(microbatches, graph.task, name, chunks if name == INTERLEAVED else 1),
            {op.name: partition.assignment[op.name] for op in cg.ops},
        )
    except PlanError:
        return None
    return plan.predicted_step_seconds


def choose_schedule(
    wanted: str,
    graph: IRGraph,
    partition: Partition,
    *,
    microbatches: int,
    devices: Sequence[DeviceSpec] | None = None,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = None,
    microbatch_choices: Sequence[int] = (),
    chunks: int = 1,
) -> ScheduleChoice:
    """The schedule to run for the job's ``placement.schedule`` ``wanted`` on this cut; ``devices``
    (one per sub-DAG, or one for all) let ``auto`` price the candidates. ``microbatch_choices`` (the job
    says ``data.microbatches: auto``): the counts the graph runs, priced with every schedule in question;
    the fastest pair that fits wins, the fewest micro-batches on a near tie (``microbatches`` is the count
    used without a device to price on). ``chunks``: sub-DAGs per compnode (interleaved-1f1b; ``auto``
    prices the cut it is given, one sub-DAG per compnode: ``auto_interleaved`` weighs interleaving)."""
    counts = sorted(set(microbatch_choices))
    args = (batch_size, optimizer, links, chunks)
    if not counts:
        return _choose_name(wanted, graph, partition, microbatches, devices, *args)
    if not devices:
        fixed = _choose_name(wanted, graph, partition, microbatches, None, *args)
        why = f"{fixed.why}; data.microbatches auto: {microbatches}, no device to price on"
        return replace(fixed, why=why, microbatches=microbatches)
    names = [wanted] if wanted != AUTO else ["gpipe"] if graph.task == "infer" else list(NAMES)
    table: dict[tuple[str, int], float] = {}
    for m in counts:
        for name in names:
            try:
                check_schedule(name, partition, m, graph.task, chunks if name == INTERLEAVED else 1)
            except PlanError:
                continue
            t = _predict(name, graph, partition, devices, m, *args)
            if t is not None:
                table[name, m] = t
    if not table:
        raise PlanError(
            f"data.microbatches auto: no micro-batch count of {counts} fits in memory on these devices "
            f"with placement.schedule {wanted}"
        )
    best = min(table.values())
    rank = {n: i for i, n in enumerate(PREFERENCE)}
    m, _, name = min((m, rank.get(n, len(rank)), n) for (n, m), t in table.items() if t <= best * (1 + TIE))
    by_count: dict[int, float] = {}
    for (_, k), t in table.items():
        by_count[k] = min(t, by_count.get(k, t))
    return ScheduleChoice(
        name,
        ("placement.schedule; " if wanted != AUTO else "auto: ")
        + f"data.microbatches auto: {m}, the fastest predicted step that fits (fewest on a near tie)",
        {n: t for (n, k), t in table.items() if k == m},
        microbatches=m,
        by_microbatches=dict(sorted(by_count.items())),
        chunks=chunks if name == INTERLEAVED else 1,
    )


def _choose_name(
    wanted: str,
    graph: IRGraph,
    partition: Partition,
    microbatches: int,
    devices: Sequence[DeviceSpec] | None,
    batch_size: int | None,
    optimizer: str | Mapping[str, str] | None,
    links: Links,
    chunks: int = 1,
) -> ScheduleChoice:
    if wanted != AUTO:
        check_schedule(wanted, partition, microbatches, graph.task, chunks)
        return ScheduleChoice(wanted, "placement.schedule", chunks=chunks if wanted == INTERLEAVED else 1)
    if graph.task == "infer":
        return ScheduleChoice("gpipe", "auto: inference runs forwards only, every schedule is the same")
    if not devices:
        return ScheduleChoice("1f1b", "auto: no device to price on; 1f1b: GPipe's step, p/m of the memory")
    args = (graph, partition, devices, microbatches, batch_size, optimizer, links)
    predicted = {n: t for n in NAMES if (t := _predict(n, *args)) is not None}
    if not predicted:
        raise PlanError("placement.schedule auto: no schedule's memory fits on these devices")
    best = min(predicted.values())
    name = next(n for n in PREFERENCE if n in predicted and predicted[n] <= best * (1 + TIE))
    return ScheduleChoice(name, "auto: fastest predicted step that fits in memory", predicted)
