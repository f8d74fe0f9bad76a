"""A job's own cuts (``placement.cuts``) on devices: which device runs each piece, and what it predicts.

The job fixed where the graph is cut, so only the devices are chosen: the k fastest, piece i on the
i-th fastest; or, when the pieces' work differs, the heaviest piece (FP+BP FLOPs) on the fastest
device, the next heaviest on the next, which minimises the slowest piece's compute when only speeds
differ. That order is taken when the performance model predicts it faster (links and fixed costs count
too) and it fits the devices' memories. The broker's placement (``placement._place``) and ``fusionnet
plan`` both call ``plan_cuts``, so plan.json predicts what runs. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from fusionnet.dag.cuts import piece_work
from fusionnet.dag.ir import IRGraph
from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import DeviceSpec, Link, Workload
from fusionnet.planning.costgraph import cost_graph, micro_batch_scale
from fusionnet.planning.planner import Links, PlannedJob, explain_plan, make_swarm, per_subdag
from fusionnet.planning.scheduler import Plan, plan_for_assignment


def device_orders(
    graph: IRGraph, devices: Sequence[DeviceSpec], assignment: Mapping[str, int]
) -> list[list[int]]:
    """The orders worth pricing, device indices per piece: the k fastest in speed order, then (when it
    differs) the same devices matched to the pieces by work, heaviest on fastest."""
    k = max(assignment.values(), default=0) + 1
    fastest = sorted(range(len(devices)), key=lambda d: (-devices[d].speed, d))[:k]
    work = piece_work(graph, assignment, k)
    matched = [0] * k
    for rank, piece in enumerate(sorted(range(k), key=lambda i: (-work[i], i))):
        matched[piece] = fastest[rank]
    return [fastest] if matched == fastest else [fastest, matched]


def _by_piece(links: Links, order: Sequence[int]) -> Links:
    """``links`` between device indices, renumbered by piece."""
    if not isinstance(links, Mapping):
        return links
    pairs = [(a, b) for a in range(len(order)) for b in range(len(order))]
    return {(a, b): links[order[a], order[b]] for a, b in pairs if (order[a], order[b]) in links}


def plan_cuts(
    graph: IRGraph,
    devices: Sequence[DeviceSpec],
    assignment: Mapping[str, int],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = None,
    default_link: Link | None = None,
    pipeline_schedule: str = "gpipe",
) -> PlannedJob:
    """The job's cut (``dag.cuts.cut_assignment``) placed on ``devices`` as the module's text says.
    ``links``: (i, j) indices into ``devices`` -> ``Link``, or one ``Link`` for every pair.
    ``PlanError`` when there are fewer devices than pieces, or no order fits the devices' memories."""
    k = max(assignment.values(), default=0) + 1
    if len(devices) < k:
        raise PlanError(f"placement.cuts make {k} sub-DAGs, but there are {len(devices)} device(s)")
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    workload = Workload(microbatches, graph.task, pipeline_schedule)
    ops = {op.name: assignment[op.name] for op in cg.ops}
    priced: list[tuple[list[int], Plan]] = []
    refusal: PlanError | None = None
    for order in device_orders(graph, devices, assignment):
        swarm = make_swarm([devices[d] for d in order], _by_piece(links, order), default_link)
        try:
            priced.append((order, plan_for_assignment(cg, swarm, workload, ops)))
        except PlanError as e:
            refusal = refusal or e
    if not priced:
        assert refusal is not None
        raise PlanError(f"placement.cuts: {refusal}") from None
    # the speed order unless the matched one is predicted strictly faster
    order, plan = min(priced, key=lambda op: op[1].predicted_step_seconds)
    planned = per_subdag(plan, assignment, order)
    every = make_swarm(devices, links, default_link)  # the explanation numbers devices as given
    explanation = explain_plan(plan, every, order, planned.predicted_seconds, k)
    return replace(planned, explanation=explanation + "\ncut at placement.cuts")
