"""A job's own cuts (``placement.cuts``) on devices: which device runs each piece, and what it predicts.

The job fixed where the graph is cut, so only the devices are chosen: k of the pool, one per piece,
as the performance model predicts fastest among those whose memories hold their pieces (problem (2)
with the cuts given). Devices of one class (same hardware, and the links uniform) are interchangeable,
so the search is over sequences of classes: all of them when they are few (``SEARCH_BUDGET``
evaluations; three compnodes of three kinds make 6, seven of seven kinds for four pieces 840), else
a hill-climb (swap two pieces' devices, give a piece an unused device) from three starts: the k
fastest with piece i on the i-th fastest, the same devices matched to the pieces by work (heaviest on
fastest, which minimises the slowest piece's compute when only speeds differ), and the devices with
the most memory matched to the pieces that need the most. An order that does not fit is ranked by how
many bytes it lacks, so a climb from one finds its way to one that fits (a fast device too small for
any piece is left out). Ties keep the earlier order: piece i on the i-th fastest first.

The broker's placement (``placement._place``) and ``fusionnet plan`` both call ``plan_cuts``, so
plan.json predicts what runs. Pure.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from fusionnet.dag.cuts import piece_work
from fusionnet.dag.ir import IRGraph
from fusionnet.errors import PartitionError, PlanError
from fusionnet.perfmodel.placement_cost import AssignmentCost, OpTimes, evaluate_assignment
from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, Swarm, Workload
from fusionnet.planning.costgraph import cost_graph, micro_batch_scale
from fusionnet.planning.planner import Links, PlannedJob, explain_plan, make_swarm, per_subdag
from fusionnet.planning.scheduler import plan_for_assignment
from fusionnet.planning.scheduler_dp import device_classes

SEARCH_BUDGET = 1000  # orders priced at most (a 12-block GPT-2: about 0.7 ms each)
IMPROVE = 1e-9  # relative gain an order must bring over an earlier one (no float ping-pong)
NO_PIPELINE = 1 << 62  # the bytes lacking of an order whose sub-DAG graph has a cycle
Key = tuple[int, float]  # (bytes the devices lack, predicted step seconds): smaller is better


def device_orders(
    graph: IRGraph, devices: Sequence[DeviceSpec], assignment: Mapping[str, int]
) -> list[list[int]]:
    """The starts of the search, device indices per piece: the k fastest in speed order, then (when
    they differ) the same devices matched to the pieces by work, heaviest on fastest."""
    k = max(assignment.values(), default=0) + 1
    fastest = sorted(range(len(devices)), key=lambda d: (-devices[d].speed, d))[:k]
    work = piece_work(graph, assignment, k)
    matched = [0] * k
    for rank, piece in enumerate(sorted(range(k), key=lambda i: (-work[i], i))):
        matched[piece] = fastest[rank]
    return [fastest] if matched == fastest else [fastest, matched]


class _OrderCost:
    """Prices orders (device index per piece) of one cut on one swarm; remembers what it priced."""

    def __init__(self, cg: CostGraph, swarm: Swarm, workload: Workload, pieces: list[int]) -> None:
        self.cg, self.swarm, self.workload, self.pieces = cg, swarm, workload, pieces
        self.op_times = OpTimes(cg, swarm)
        self.priced: dict[tuple[int, ...], Key] = {}

    def __call__(self, order: Sequence[int]) -> Key:
        key = tuple(order)
        if key not in self.priced:
            self.priced[key] = self._price([order[p] for p in self.pieces])
        return self.priced[key]

    def _price(self, assign: list[int]) -> Key:
        try:
            cost = evaluate_assignment(self.cg, self.swarm, self.workload, assign, self.op_times)
        except PartitionError:  # cannot be for contiguous pieces; ranked below any order that can run
            return (NO_PIPELINE, float("inf"))
        return (_lacking(cost, self.swarm), cost.objective("step_time"))


def _lacking(cost: AssignmentCost, swarm: Swarm) -> int:
    """Bytes the stages need beyond their devices' memories, all three kinds summed (0: it fits)."""
    short = 0
    for stage in cost.stages:
        dev, need = swarm.devices[stage.device], stage.demand
        short += max(0, need.gpu - dev.d_gpu) + max(0, need.cpu - dev.d_cpu) + max(0, need.disk - dev.d_disk)
    return short


def _better(a: Key, b: Key) -> bool:
    return a[0] < b[0] or (a[0] == b[0] and a[1] < b[1] * (1 - IMPROVE))


def _class_sequences(classes: list[list[int]], k: int, limit: int) -> list[list[int]] | None:
    """Every order of k devices up to interchangeable ones (the first free device of each class), or
    None when there are more than ``limit``."""
    out: list[list[int]] = []

    def grow(order: list[int], used: list[int]) -> bool:
        if len(order) == k:
            out.append(list(order))
            return len(out) <= limit
        for c, group in enumerate(classes):
            if used[c] < len(group):
                order.append(group[used[c]])
                used[c] += 1
                going = grow(order, used)
                used[c] -= 1
                order.pop()
                if not going:
                    return False
        return True

    return out if grow([], [0] * len(classes)) else None


def _neighbours(order: list[int], classes: list[list[int]]) -> Iterator[list[int]]:
    """Swaps of two pieces' devices (of different classes), then a piece given an unused device (the
    first free one of each class)."""
    cls = {d: c for c, group in enumerate(classes) for d in group}
    for a in range(len(order)):
        for b in range(a + 1, len(order)):
            if cls[order[a]] != cls[order[b]]:
                swapped = list(order)
                swapped[a], swapped[b] = order[b], order[a]
                yield swapped
    used = set(order)
    free = [next(d for d in group if d not in used) for group in classes if any(d not in used for d in group)]
    for piece in range(len(order)):
        for d in free:
            if cls[d] != cls[order[piece]]:
                yield [*order[:piece], d, *order[piece + 1 :]]


def _climb(start: list[int], price: _OrderCost, classes: list[list[int]], budget: int) -> list[int]:
    """First-improvement hill-climb from ``start`` until no neighbour is better or ``budget`` orders
    have been priced."""
    best, best_key = start, price(start)
    improved = True
    while improved and len(price.priced) < budget:
        improved = False
        for order in _neighbours(best, classes):
            key = price(order)
            if _better(key, best_key):
                best, best_key, improved = order, key, True
                break
    return best


def _by_memory(price: _OrderCost, fastest: list[int]) -> list[int]:
    """The k devices with the most memory (the faster first among equals), the roomiest for the piece
    that needs the most there (measured on the k fastest, in speed order: what a piece needs hardly
    depends on where it runs)."""
    first = evaluate_assignment(price.cg, price.swarm, price.workload, [fastest[p] for p in price.pieces])
    need = {fastest.index(s.device): s.demand.gpu + s.demand.cpu for s in first.stages}
    devices = price.swarm.devices
    room = sorted(
        range(len(devices)), key=lambda d: (-(devices[d].d_gpu + devices[d].d_cpu), -devices[d].speed, d)
    )
    order = [0] * len(fastest)
    for rank, piece in enumerate(sorted(range(len(fastest)), key=lambda p: (-need.get(p, 0), p))):
        order[piece] = room[rank]
    return order


@dataclass(frozen=True)
class DeviceChoice:
    order: list[int]  # the device index of each piece
    priced: int  # device orders the performance model priced
    every: bool  # whether those were all of them (up to interchangeable devices), or a climb's

    def explain(self) -> str:
        how = "every one there is" if self.every else "a hill-climb from three starts"
        orders = f"{self.priced} order{'' if self.priced == 1 else 's'}"
        return f"cut at placement.cuts; devices chosen from {orders} priced ({how})"


def choose_devices(
    graph: IRGraph, cg: CostGraph, swarm: Swarm, workload: Workload, assignment: Mapping[str, int]
) -> DeviceChoice:
    """The device of each piece of ``assignment`` (op -> piece): the search of the module's text.
    ``PlanError`` naming the constraint when no order fits the devices' memories."""
    k = max(assignment.values(), default=0) + 1
    devices = swarm.devices
    price = _OrderCost(cg, swarm, workload, [assignment[op.name] for op in cg.ops])
    classes = device_classes(swarm, list(range(len(devices))))
    starts = device_orders(graph, devices, assignment)
    every = _class_sequences(classes, k, SEARCH_BUDGET)
    if every is None:
        starts.append(_by_memory(price, starts[0]))
        candidates = [_climb(s, price, classes, SEARCH_BUDGET) for s in starts]
    else:
        candidates = [*starts, *every]
    best = starts[0]
    for order in candidates:
        if _better(price(order), price(best)):
            best = order
    if price(best)[0] >= NO_PIPELINE:
        raise PlanError(f"placement.cuts: the {k} pieces do not make a pipeline on any device order")
    if price(best)[0]:
        assign = [best[p] for p in price.pieces]
        why = evaluate_assignment(cg, swarm, workload, assign, price.op_times).memory_violation(swarm)
        raise PlanError(f"placement.cuts: no {k} of the {len(devices)} device(s) hold the pieces: {why}")
    return DeviceChoice(best, len(price.priced), every is not None)


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
    """The job's cut (``dag.cuts.cut_assignment``) placed on k of ``devices`` as the module's text says.
    ``links``: (i, j) indices into ``devices`` -> ``Link``, or one ``Link`` for every pair.
    ``PlanError`` when there are fewer devices than pieces, or no k of them hold the pieces."""
    k = max(assignment.values(), default=0) + 1
    if len(devices) < k:
        raise PlanError(f"placement.cuts make {k} sub-DAGs, but there are {len(devices)} device(s)")
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    workload = Workload(microbatches, graph.task, pipeline_schedule)
    every = make_swarm(devices, links, default_link)  # the explanation numbers devices as given
    choice = choose_devices(graph, cg, every, workload, assignment)
    order = choice.order
    ops = {op.name: assignment[op.name] for op in cg.ops}
    swarm = make_swarm([devices[d] for d in order], _by_piece(links, order), default_link)
    plan = plan_for_assignment(cg, swarm, workload, ops)
    planned = per_subdag(plan, assignment, order)
    explanation = explain_plan(plan, every, order, planned.predicted_seconds, k)
    notes = choice.explain()
    return replace(planned, explanation=f"{explanation}\n{notes}", notes=notes)
