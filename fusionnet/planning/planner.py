"""The scheduler facade: plans an IR graph onto a list of devices (problem (2)).

``plan_graph`` turns the IR into a cost graph (``costgraph``), runs the scheduler
(``scheduler.schedule``) over a list of devices, e.g. the ``DeviceSpec``s of the live compnodes
(``CompnodeEntry.device_spec()``), and returns the IR assignment that ``build_partition`` accepts,
which device runs each sub-DAG, the predicted seconds and the plan as text. Deterministic for equal
inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition, balanced_assignment, build_partition
from fusionnet.errors import PlanError
from fusionnet.perfmodel.memory import MemoryDemand, fmt_bytes
from fusionnet.perfmodel.types import DeviceSpec, Link, Swarm, Workload, link_between
from fusionnet.planning.costgraph import cost_graph, ir_assignment, micro_batch_scale
from fusionnet.planning.scheduler import Plan, plan_for_assignment, schedule
from fusionnet.planning.scheduler_plan import StagePlan
from fusionnet.schedules import INTERLEAVED

LOOPBACK = Link.from_bandwidth(100e-6, 1e9)  # local compnodes: loopback TCP, design.md's figures
IN_PROCESS = Link(alpha=0.0, beta=0.0)  # run --local: tensors are handed over in memory


@dataclass(frozen=True)
class PlannedJob:
    """The planner's answer for one IR graph."""

    assignment: dict[str, int]  # every IR node -> sub-DAG index 0..k-1 (build_partition's order)
    devices: list[int]  # devices[i]: index into the input device list of sub-DAG i
    predicted_seconds: dict[int, float]  # sub-DAG -> FP + BP + Update seconds per step
    predicted_step_seconds: float  # the schedule simulator's step time (pipelining, transfers)
    # sub-DAG -> (C_p, R_p): FP seconds and activations-received seconds per micro-batch (eq. (3)/(4))
    stage_timing: dict[int, tuple[float, float]]
    explanation: str  # the plan as text: per-stage times, memory, bottleneck
    plan: Plan  # the scheduler's plan (stage i of ``plan.stages`` is sub-DAG i)
    # what ``explanation`` says after the priced plan (``plan_cuts``: why these devices): kept when
    # ``priced_with`` prices the cut again, which writes the rest anew
    notes: str = ""


Links = Mapping[tuple[int, int], Link] | Link | None


def make_swarm(devices: Sequence[DeviceSpec], links: Links, default_link: Link | None) -> Swarm:
    if not devices:
        raise PlanError("no devices to plan for: no compnode is online (or none has announced its hardware)")
    if isinstance(links, Link):
        return Swarm(tuple(devices), {}, links)
    return Swarm(tuple(devices), dict(links or {}), default_link or LOOPBACK)


def stage_timing(stage: StagePlan) -> tuple[float, float]:
    """(C_p, R_p) of eq. (3)/(4): a stage's FP seconds and activations-received seconds per micro-batch."""
    return (stage.fp_seconds, stage.comm_fwd_seconds)


def _partition(graph: IRGraph, labels: Mapping[str, int]) -> Partition:
    return build_partition(graph, labels)  # returns its analysis; the graph is left as it is


def plan_graph(
    graph: IRGraph,
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    max_devices: int | None = None,
    links: Links = None,
    default_link: Link | None = None,
    objective: str = "step_time",
    stages: int | None = None,
    pipeline_schedule: str = "gpipe",
) -> PlannedJob:
    """Plans ``graph`` onto ``devices`` with the scheduler of problem (2).

    ``microbatches`` and ``batch_size`` are the job's (costs are rescaled when the traced micro-batch
    had another size); ``optimizer`` one profile name (``"adam"``, ``"sgd_momentum"``, ...) or a map
    parameter key -> name; ``max_devices`` caps the sub-DAGs (default: every device may be used);
    ``links`` a map (i, j) of device indices -> ``Link`` (pairs not given use ``default_link``,
    loopback by default) or one ``Link`` for every pair; ``stages`` fixes the number of sub-DAGs (the
    scheduler then picks only the cuts and the devices); ``pipeline_schedule`` the schedule the step
    is simulated with (``fusionnet.schedules``). Deterministic for equal inputs. Raises
    ``PlanError`` naming the binding constraint (an op or the model too big for the memories, ...)
    when no placement fits.
    """
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    swarm = make_swarm(devices, links, default_link)
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    plan = schedule(
        cg,
        swarm,
        Workload(microbatches, graph.task, pipeline_schedule),
        max_devices=max_devices,
        objective=objective,
        stages=stages,
    )
    stage_of = {d: i for i, d in enumerate(plan.devices_used)}
    labels = ir_assignment(graph, {op: stage_of[d] for op, d in plan.assignment.items()})
    partition = _partition(graph, labels)
    # sub-DAG i of the partition -> the stage (and device) it came from
    stage_for = {s.index: s.compnode for s in partition.subdags}
    if sorted(stage_for.values()) != list(range(len(plan.stages))):
        raise PlanError("internal: the plan's stages do not map one-to-one onto sub-DAGs")
    plan_devices = [plan.stages[stage_for[i]].device for i in range(len(partition.subdags))]
    predicted = {i: plan.stages[stage_for[i]].compute_seconds for i in range(len(partition.subdags))}
    timing = {i: stage_timing(plan.stages[stage_for[i]]) for i in range(len(partition.subdags))}
    return PlannedJob(
        assignment=dict(partition.assignment),
        devices=plan_devices,
        predicted_seconds=predicted,
        predicted_step_seconds=plan.predicted_step_seconds,
        stage_timing=timing,
        explanation=explain_plan(plan, swarm, plan_devices, predicted, max_devices),
        plan=plan,
    )


def per_subdag(plan: Plan, assignment: Mapping[str, int], devices: list[int]) -> PlannedJob:
    """A plan priced on a swarm of one device per sub-DAG (stage i = sub-DAG i) as the planner's answer,
    sub-DAG i on ``devices[i]``; its ``explanation`` is left for the caller to write."""
    return PlannedJob(
        assignment=dict(assignment),
        devices=devices,
        predicted_seconds={s.device: s.compute_seconds for s in plan.stages},
        predicted_step_seconds=plan.predicted_step_seconds,
        stage_timing={s.device: stage_timing(s) for s in plan.stages},
        explanation="",
        plan=plan,
    )


def priced_with(
    graph: IRGraph,
    planned: PlannedJob,
    devices: Sequence[DeviceSpec],
    pipeline_schedule: str,
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Mapping[tuple[int, int], Link] | None = None,
    default_link: Link | None = None,
    max_devices: int | None = None,
) -> PlannedJob:
    """``planned``'s cut on its devices (indices into ``devices``) priced with ``pipeline_schedule``: a
    cut searched with one schedule's pricing and run with another (``auto`` choosing zero-bubble, say)
    then reports the memory, micro-batches in flight and step time of the schedule that runs, in its
    ``plan`` and in its ``explanation``, written again as ``plan_graph`` writes it (``max_devices`` as
    passed there) followed by ``planned.notes``."""
    order = planned.devices
    by_subdag = {
        (i, j): link_between(links or {}, a, b, default_link or LOOPBACK)
        for i, a in enumerate(order)
        for j, b in enumerate(order)
        if i != j
    }
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    swarm = make_swarm([devices[d] for d in order], by_subdag, default_link)
    ops = {op.name: planned.assignment[op.name] for op in cg.ops}
    plan = plan_for_assignment(cg, swarm, Workload(microbatches, graph.task, pipeline_schedule), ops)
    repriced = per_subdag(plan, planned.assignment, list(order))
    # Not ``planned.explanation``: that is the other schedule's table (its step time, its micro-batches
    # in flight), which ``fusionnet plan`` then printed above the schedule that runs.
    every = make_swarm(devices, links, default_link)  # the text numbers devices as given, as planned's
    text = explain_plan(plan, every, list(order), repriced.predicted_seconds, max_devices)
    if planned.notes:
        text = f"{text}\n{planned.notes}"
    return replace(repriced, explanation=text, notes=planned.notes)


def plan_interleaved(
    graph: IRGraph,
    devices: Sequence[DeviceSpec],
    chunks: int,
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Mapping[tuple[int, int], Link] | None = None,
    default_link: Link | None = None,
    assignment: Mapping[str, int] | None = None,
) -> PlannedJob:
    """interleaved-1f1b on ``devices`` (p of them): ``graph`` cut evenly into p x ``chunks`` sub-DAGs
    (``balanced_assignment``; or ``assignment``, the job's cuts), sub-DAG s on device s mod p, priced by
    the performance model with the interleaved schedule. The broker places such a job the same way
    (``placement._place_interleaved``): the scheduler's search cuts for one sub-DAG per device, so it
    prices this cut but does not choose it. ``links``: (i, j) device indices -> ``Link``
    (``default_link`` for the pairs not given); two sub-DAGs of one device are priced at loopback, as on
    the broker. ``PlanError`` when a device's chunks do not fit in its memory (``_check_chunks_fit``)."""
    p = len(devices)
    if p < 1 or chunks < 2:
        raise PlanError(f"interleaved-1f1b needs >= 1 device and >= 2 chunks, got {p} and {chunks}")
    k = p * chunks
    how = "evenly" if assignment is None else "at the job's cuts"
    assignment = assignment or balanced_assignment(graph, k)
    device_of = [s % p for s in range(k)]
    between = dict(links or {})
    by_subdag = {
        (a, b): LOOPBACK  # one device's chunks: priced as the broker prices them (``index_links``)
        if device_of[a] == device_of[b]
        else link_between(between, device_of[a], device_of[b], default_link or LOOPBACK)
        for a in range(k)
        for b in range(k)
        if a != b
    }
    swarm = make_swarm([devices[d] for d in device_of], by_subdag, default_link)
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    plan = plan_for_assignment(
        cg,
        swarm,
        Workload(microbatches, graph.task, INTERLEAVED, chunks),
        {op.name: assignment[op.name] for op in cg.ops},
        check_memory=False,
    )
    _check_chunks_fit(plan, devices, device_of, chunks)
    planned = per_subdag(plan, assignment, device_of)
    predicted = planned.predicted_seconds
    lines = [plan.describe(), ""]
    for i, d in enumerate(device_of):
        dev = devices[d]
        lines.append(
            f"sub-DAG {i}: device {d} ({dev.name}, {dev.kind}, S(p) {dev.speed / 1e9:.3g} GFLOP/s): chunk "
            f"{i // p} of {chunks}, predicted FP+BP+Update {predicted[i]:.6g} s per step"
        )
    lines.append(
        f"cut {how} into {p} device(s) x {chunks} chunks "
        "(interleaved-1f1b); predicted step time: "
        f"{plan.predicted_step_seconds:.6g} s"
    )
    return replace(planned, explanation="\n".join(lines))


def _check_chunks_fit(plan: Plan, devices: Sequence[DeviceSpec], device_of: list[int], chunks: int) -> None:
    """``PlanError`` unless every chunk fits its device's memories, and a device's chunks together fit
    each of them: a chunk's parts land on fixed memories (``MemoryBreakdown.demand``: what it computes
    with on the GPU of a GPU device), so the chunks' demands add up memory by memory. A total over all
    memories let a large disk hide an overfull GPU. Each chunk is charged its own peak of micro-batches
    in flight, a bound (the chunks' peaks need not coincide) that never accepts a device it overfills."""
    for s in plan.stages:
        why = s.demand.violation(devices[device_of[s.device]])
        if why is not None:
            raise PlanError(f"interleaved-1f1b: sub-DAG {s.device} ({len(s.ops)} ops) {why}")
    for d, dev in enumerate(devices):
        mine = [s.demand for s in plan.stages if device_of[s.device] == d]
        together = MemoryDemand(
            gpu=sum(m.gpu for m in mine), cpu=sum(m.cpu for m in mine), disk=sum(m.disk for m in mine)
        )
        why = together.violation(dev)
        if why is not None:
            who = f"the {chunks} chunks of device {d} ({dev.name!r})"
            raise PlanError(f"interleaved-1f1b: {who} together: {why}")


def explain_plan(
    plan: Plan, swarm: Swarm, devices: list[int], predicted: Mapping[int, float], max_devices: int | None
) -> str:
    allowed = min(max_devices or len(swarm.devices), len(swarm.devices))
    lines = [plan.describe(), ""]
    for i, d in enumerate(devices):
        dev = swarm.devices[d]
        lines.append(
            f"sub-DAG {i}: device {d} ({dev.name}, {dev.kind}, S(p) {dev.speed / 1e9:.3g} GFLOP/s, "
            f"{fmt_bytes(dev.compute_memory)}): predicted FP+BP+Update {predicted[i]:.6g} s per step"
        )
    if len(devices) < allowed:
        lines.append(
            f"{len(devices)} of {allowed} allowed device(s) used: more sub-DAGs would add transfers and "
            "fixed costs without shortening the predicted step"
        )
    lines.append(f"predicted step time: {plan.predicted_step_seconds:.6g} s")
    return "\n".join(lines)
