"""The cost of one placement: an assignment op -> device turned into stages, transfers and objectives.

This is the single ground truth every planner is measured against (the DP, the local search and
the exact solver all call ``evaluate_assignment``).

- Stages: the devices used, in a topological order of the sub-DAG graph (ties: first op first). An
  assignment whose sub-DAG graph has a cycle is refused (``PartitionError``): no executor could
  start it.
- Transfers: a producer's output goes once to every other device that reads it (FusionAI Table 3's
  "outwards data"); everything stage i sends stage j per micro-batch travels as one message
  (``alpha + beta * bytes`` over ``Swarm.link(i, j)``). Gradients of the same bytes go back
  (``Swarm.link(j, i)``) when a gradient reaches the producer (``CostGraph.needs_grad``).
- ``makespan`` is problem (2)'s objective with retrieval time R put on the link that carries it (as
  eq. (4) does by taking ``max(C_p, R_p)``): the largest of every device's compute time per step
  (``m * (FP + BP) + Update``) and every directed link's busy time per step.
- ``step_seconds`` runs the schedule simulator on the same stage and link times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from fusionnet.errors import PartitionError
from fusionnet.perfmodel.memory import MemoryBreakdown, MemoryDemand, stage_memory
from fusionnet.perfmodel.simulator import Hop, SimResult, StageTimes, simulate
from fusionnet.perfmodel.timing import op_bp_seconds, op_fp_seconds, op_update_seconds, stage_fixed_seconds
from fusionnet.perfmodel.types import CostGraph, Swarm, Workload


@dataclass(frozen=True)
class StageCost:
    device: int
    ops: tuple[str, ...]  # in graph order
    fp: float  # seconds per micro-batch, local part of eq. (1) summed over the ops
    bp: float  # seconds per micro-batch
    update: float  # seconds per step
    recv_fwd: float  # seconds per micro-batch receiving activations (R_p of eq. (3))
    recv_bwd: float  # seconds per micro-batch receiving gradients
    in_bytes: int  # activation bytes received per micro-batch
    out_bytes: int  # activation bytes sent per micro-batch
    memory: MemoryBreakdown
    demand: MemoryDemand


@dataclass(frozen=True)
class Transfer:
    src: int  # stage index (pipeline order)
    dst: int  # later stage index
    nbytes: int  # activation bytes per micro-batch
    grad_bytes: int  # gradient bytes per micro-batch going back
    fwd: float  # seconds per micro-batch on src -> dst
    bwd: float  # seconds per micro-batch on dst -> src
    once_bytes: int = 0  # bytes once per step (parameters read across the cut; their gradients back)
    fwd_once: float = 0.0  # seconds once per step on src -> dst
    bwd_once: float = 0.0  # seconds once per step on dst -> src


@dataclass(frozen=True)
class AssignmentCost:
    stages: tuple[StageCost, ...]
    transfers: tuple[Transfer, ...]
    workload: Workload

    def compute_seconds(self, stage: int) -> float:
        """A stage's compute time per step: ``m * (FP + BP) + Update``."""
        s = self.stages[stage]
        m = self.workload.microbatches
        bp = s.bp if self.workload.backward else 0.0
        up = s.update if self.workload.update else 0.0
        return m * (s.fp + bp) + up

    @cached_property
    def link_loads(self) -> dict[tuple[int, int], float]:
        """Busy seconds per step of every directed link between stages, keyed by (from, to) stage."""
        m = self.workload.microbatches
        loads: dict[tuple[int, int], float] = {}
        for t in self.transfers:
            loads[(t.src, t.dst)] = loads.get((t.src, t.dst), 0.0) + m * t.fwd + t.fwd_once
            if self.workload.backward and t.bwd + t.bwd_once > 0:
                loads[(t.dst, t.src)] = loads.get((t.dst, t.src), 0.0) + m * t.bwd + t.bwd_once
        return loads

    @cached_property
    def makespan_and_bottleneck(self) -> tuple[float, str]:
        best, label = -1.0, ""
        for i in range(len(self.stages)):
            t = self.compute_seconds(i)
            if t > best:
                best, label = t, f"stage {i} compute (device {self.stages[i].device})"
        for (a, b), t in sorted(self.link_loads.items()):
            if t > best:
                best, label = (
                    t,
                    f"link stage {a} -> stage {b} "
                    f"(device {self.stages[a].device} -> {self.stages[b].device})",
                )
        return best, label

    @property
    def makespan(self) -> float:
        return self.makespan_and_bottleneck[0]

    @cached_property
    def simulation(self) -> SimResult:
        w = self.workload
        times = [
            StageTimes(s.fp, s.bp if w.backward else 0.0, s.update if w.update else 0.0) for s in self.stages
        ]
        hops = [
            Hop(
                t.src,
                t.dst,
                t.fwd,
                t.bwd if w.backward else 0.0,
                t.fwd_once,
                t.bwd_once if w.backward else 0.0,
            )
            for t in self.transfers
        ]
        return simulate(times, hops, w.microbatches, schedule=w.schedule, task=w.task, chunks=w.chunks)

    @property
    def step_seconds(self) -> float:
        return self.simulation.step_seconds

    def objective(self, name: str) -> float:
        if name == "step_time":
            return self.step_seconds
        if name == "makespan":
            return self.makespan
        raise ValueError(f"objective {name!r} must be 'step_time' or 'makespan'")

    def memory_violation(self, swarm: Swarm) -> str | None:
        """The first memory constraint of problem (2) this placement breaks, as text; None if none."""
        for i, s in enumerate(self.stages):
            why = s.demand.violation(swarm.devices[s.device])
            if why is not None:
                return f"stage {i} ({len(s.ops)} ops, e.g. {s.ops[0]!r}) {why}"
        return None


def stage_order(graph: CostGraph, assign: list[int]) -> list[int]:
    """Devices used, in a topological order of the sub-DAG graph; raises if that graph has a cycle."""
    first: dict[int, int] = {}
    for i, d in enumerate(assign):
        first.setdefault(d, i)
    nxt: dict[int, set[int]] = {d: set() for d in first}
    indeg = dict.fromkeys(first, 0)
    for src, dst, _ in graph.edges:
        a, b = assign[graph.index[src]], assign[graph.index[dst]]
        if a != b and b not in nxt[a]:
            nxt[a].add(b)
            indeg[b] += 1
    ready = sorted((first[d], d) for d, k in indeg.items() if k == 0)
    order: list[int] = []
    while ready:
        _, d = ready.pop(0)
        order.append(d)
        for e in nxt[d]:
            indeg[e] -= 1
            if indeg[e] == 0:
                ready.append((first[e], e))
        ready.sort()
    if len(order) != len(first):
        stuck = sorted(d for d, k in indeg.items() if k > 0)
        raise PartitionError(
            f"the assignment makes the sub-DAG graph cyclic (devices {stuck} wait on each other)"
        )
    return order


def assignment_list(graph: CostGraph, swarm: Swarm, assignment: Mapping[str, int]) -> list[int]:
    """Validates a name -> device mapping and returns it as a list in op order."""
    out = []
    for op in graph.ops:
        if op.name not in assignment:
            raise PartitionError(f"op {op.name!r} is not assigned to any device")
        d = assignment[op.name]
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < len(swarm.devices):
            raise PartitionError(
                f"op {op.name!r} is assigned to {d!r}, not a device index in [0, {len(swarm.devices)})"
            )
        out.append(d)
    extra = sorted(set(assignment) - set(graph.index))
    if extra:
        raise PartitionError(f"the assignment names unknown ops: {', '.join(map(repr, extra[:5]))}")
    return out


class OpTimes:
    """Per-op FP / BP / Update seconds on each device, computed once per device on first use (the
    planners evaluate thousands of assignments of the same graph)."""

    def __init__(self, graph: CostGraph, swarm: Swarm) -> None:
        self.graph, self.swarm = graph, swarm
        self._rows: dict[int, tuple[list[float], list[float], list[float]]] = {}

    def __call__(self, device: int) -> tuple[list[float], list[float], list[float]]:
        row = self._rows.get(device)
        if row is None:
            dev, grad = self.swarm.devices[device], self.graph.needs_grad
            ops = self.graph.ops
            row = (
                [op_fp_seconds(op, dev) for op in ops],
                [op_bp_seconds(op, dev, grad[i]) for i, op in enumerate(ops)],
                [op_update_seconds(op, dev) for op in ops],
            )
            self._rows[device] = row
        return row


def evaluate_assignment(
    graph: CostGraph,
    swarm: Swarm,
    workload: Workload,
    assignment: Mapping[str, int] | list[int],
    op_times: OpTimes | None = None,
) -> AssignmentCost:
    """Stages, transfers, times and memory of ``assignment`` (names -> device, or a list in op order).

    ``op_times`` (an ``OpTimes`` of the same graph and swarm) saves recomputing per-op times."""
    assign = list(assignment) if isinstance(assignment, list) else assignment_list(graph, swarm, assignment)
    times = op_times if op_times is not None else OpTimes(graph, swarm)
    order = stage_order(graph, assign)
    stage_of = {d: i for i, d in enumerate(order)}
    n = len(order)
    grad = graph.needs_grad
    index = graph.index
    # one message per (producer op, consuming device); a step-wide value once per step
    step_wide = {(e[0], e[1]): e[2] for e in graph.step_edges}
    sent: dict[tuple[int, int], int] = {}
    sent_once: dict[tuple[int, int], int] = {}
    for src, dst, nbytes in graph.edges:
        u, v = index[src], index[dst]
        if assign[u] != assign[v]:
            key = (u, stage_of[assign[v]])
            table, size = (sent_once, step_wide[(src, dst)]) if (src, dst) in step_wide else (sent, nbytes)
            if size > table.get(key, -1):
                table[key] = size
    pair_bytes: dict[tuple[int, int], list[int]] = {}
    for once, table in ((0, sent), (2, sent_once)):
        for (u, t), nbytes in sorted(table.items()):
            acc = pair_bytes.setdefault((stage_of[assign[u]], t), [0, 0, 0, 0])
            acc[once] += nbytes
            if grad[u]:
                acc[once + 1] += nbytes
    transfers = []
    in_b, out_b = [0] * n, [0] * n
    recv_f, recv_b = [0.0] * n, [0.0] * n
    for (a, b), (nb, gb, ob, ogb) in sorted(pair_bytes.items()):
        there, back = swarm.link(order[a], order[b]), swarm.link(order[b], order[a])
        fwd = there.time(nb)
        bwd = back.time(gb) if workload.backward else 0.0
        # rides on the first forward's (the last backward's) message; alone, it is a message of its own
        fwd_once = there.beta * ob if nb else there.time(ob)
        bwd_once = (back.beta * ogb if gb else back.time(ogb)) if workload.backward else 0.0
        if graph.resident_step_edges:
            fwd_once = bwd_once = 0.0
        transfers.append(Transfer(a, b, nb, gb, fwd, bwd, ob, fwd_once, bwd_once))
        in_b[b] += nb + ob  # staged on both ends (the step-wide value is held the whole step)
        out_b[a] += nb + ob
        recv_f[b] += fwd
        recv_b[a] += bwd
    stage_ops: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(assign):
        stage_ops[stage_of[d]].append(i)
    stages = []
    for k, d in enumerate(order):
        fp_t, bp_t, up_t = times(d)
        idx = stage_ops[k]
        ops = [graph.ops[i] for i in idx]
        mem = stage_memory(ops, workload, stage_index=k, num_stages=n, in_bytes=in_b[k], out_bytes=out_b[k])
        fixed_fp, fixed_bp, fixed_up = stage_fixed_seconds(
            swarm.devices[d],
            backward=workload.backward and any(grad[i] for i in idx),
            update=workload.update and any(graph.ops[i].param_bytes for i in idx),
        )
        stages.append(
            StageCost(
                device=d,
                ops=tuple(op.name for op in ops),
                fp=fixed_fp + sum(fp_t[i] for i in idx),
                bp=fixed_bp + sum(bp_t[i] for i in idx) if workload.backward else 0.0,
                update=fixed_up + sum(up_t[i] for i in idx) if workload.update else 0.0,
                recv_fwd=recv_f[k],
                recv_bwd=recv_b[k],
                in_bytes=in_b[k],
                out_bytes=out_b[k],
                memory=mem,
                demand=mem.demand(swarm.devices[d].kind),
            )
        )
    return AssignmentCost(stages=tuple(stages), transfers=tuple(transfers), workload=workload)
