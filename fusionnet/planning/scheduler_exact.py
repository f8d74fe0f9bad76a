"""Exact solver for small instances: branch and bound over every acyclic assignment.

Ops are assigned one at a time in graph order (a topological order, so an op's producers are placed
before it). A branch is cut when

- the sub-DAG graph gets a cycle (adding edges never removes one);
- some device's memory that only grows (parameters, gradients, optimizer state, activations at the
  smallest in-flight count) exceeds the device;
- its lower bound reaches the best objective found: every device computes its ops one after another
  and every directed link carries its transfers one after another, in the simulator as in the
  makespan, so partial compute and partial link loads bound both objectives from below.

Interchangeable devices (same spec, uniform links) are symmetric: a fresh device is always the
first unused one of its class. Leaves are scored by ``evaluate_assignment`` like every other plan.
Exponential by nature; ``max_nodes`` bounds the search and ``PlanError`` says when it ran out.
"""

from __future__ import annotations

from fusionnet.errors import PlanError
from fusionnet.perfmodel.memory import inflight_microbatches, optimizer_state_bytes
from fusionnet.perfmodel.timing import op_bp_seconds, op_fp_seconds, op_update_seconds
from fusionnet.perfmodel.types import CostGraph, Swarm, Workload
from fusionnet.planning.scheduler_dp import device_classes
from fusionnet.planning.scheduler_plan import Plan, plan_from_cost
from fusionnet.planning.scheduler_refine import Evaluator


def _reaches(edges: dict[int, dict[int, int]], src: int, dst: int) -> bool:
    stack, seen = [src], {src}
    while stack:
        x = stack.pop()
        if x == dst:
            return True
        for y in edges.get(x, {}):
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return False


class _Search:
    """The branch and bound's state: ops placed so far, per-device load and memory, the sub-DAG
    graph (edge counts, to undo) and the bytes each directed link carries per micro-batch."""

    def __init__(
        self,
        graph: CostGraph,
        swarm: Swarm,
        workload: Workload,
        evaluate: Evaluator,
        limit: int,
        max_nodes: int,
    ) -> None:
        self.graph, self.swarm, self.evaluate = graph, swarm, evaluate
        self.limit, self.max_nodes = limit, max_nodes
        self.m = m = workload.microbatches
        grad = graph.needs_grad
        # per op x device: compute seconds per step, resident bytes at the smallest in-flight count
        self.work = [
            [
                m * (op_fp_seconds(op, d) + (op_bp_seconds(op, d, grad[i]) if workload.backward else 0.0))
                + (op_update_seconds(op, d) if workload.update else 0.0)
                for d in swarm.devices
            ]
            for i, op in enumerate(graph.ops)
        ]
        low_inflight = inflight_microbatches(workload, 0, 1)
        self.resident = [
            op.param_bytes * (2 if workload.backward else 1)
            + (optimizer_state_bytes(op) if workload.update else 0)
            + low_inflight * op.activation_bytes
            for op in graph.ops
        ]
        nd = len(swarm.devices)
        self.caps = [d.compute_memory for d in swarm.devices]
        self.classes = device_classes(swarm, list(range(nd)))
        self.out_b = graph.out_bytes
        self.assign = [-1] * len(graph.ops)
        self.load = [0.0] * nd
        self.mem = [0] * nd
        self.qedges: dict[int, dict[int, int]] = {}
        self.sent: dict[tuple[int, int], int] = {}  # (producer op, consumer device) -> uses
        self.link_bytes: dict[tuple[int, int], int] = {}
        self.best_value = float("inf")
        self.best: list[int] | None = None
        self.nodes = 0

    def link_bound(self) -> float:
        worst = 0.0
        for (a, b), nbytes in self.link_bytes.items():
            worst = max(worst, self.m * self.swarm.link(a, b).time(nbytes))
        return worst

    def options(self, i: int) -> list[int]:
        used = set(self.assign[:i])
        opts = sorted(used)
        if len(used) < self.limit:
            # a class's devices are taken in index order, so its first unused one stands for all
            for group in self.classes:
                fresh = next((d for d in group if d not in used), None)
                if fresh is not None:
                    opts.append(fresh)
        return opts

    def new_edges(self, i: int, d: int) -> list[tuple[int, int]] | None:
        """(producer op, its device) for every input of op ``i`` that would cross to device ``d``,
        or None when that closes a cycle in the sub-DAG graph."""
        added: list[tuple[int, int]] = []
        for p in self.graph.preds[i]:
            a = self.assign[p]
            if a != d:
                if d not in self.qedges.get(a, {}) and _reaches(self.qedges, d, a):
                    return None
                added.append((p, a))
        return added

    def push(self, i: int, d: int, added: list[tuple[int, int]]) -> None:
        self.assign[i] = d
        self.load[d] += self.work[i][d]
        self.mem[d] += self.resident[i]
        for p, a in added:
            self.qedges.setdefault(a, {}).setdefault(d, 0)
            self.qedges[a][d] += 1
            key = (p, d)
            self.sent[key] = self.sent.get(key, 0) + 1
            if self.sent[key] == 1:
                self.link_bytes[(a, d)] = self.link_bytes.get((a, d), 0) + self.out_b[p]

    def pop(self, i: int, d: int, added: list[tuple[int, int]]) -> None:
        for p, a in reversed(added):
            key = (p, d)
            self.sent[key] -= 1
            if self.sent[key] == 0:
                del self.sent[key]
                self.link_bytes[(a, d)] -= self.out_b[p]
                if self.link_bytes[(a, d)] == 0:
                    del self.link_bytes[(a, d)]
            self.qedges[a][d] -= 1
            if self.qedges[a][d] == 0:
                del self.qedges[a][d]
        self.assign[i] = -1
        self.load[d] -= self.work[i][d]
        self.mem[d] -= self.resident[i]

    def place(self, i: int) -> None:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise PlanError(f"exact search exceeded {self.max_nodes} nodes; the instance is too large for it")
        if i == len(self.assign):
            val, cost = self.evaluate(list(self.assign))
            if cost is not None and val < self.best_value:
                self.best_value, self.best = val, list(self.assign)
            return
        for d in self.options(i):
            if (
                self.mem[d] + self.resident[i] > self.caps[d]
                or self.load[d] + self.work[i][d] >= self.best_value
            ):
                continue
            added = self.new_edges(i, d)
            if added is None:
                continue
            self.push(i, d, added)
            if self.link_bound() < self.best_value:
                self.place(i + 1)
            self.pop(i, d, added)


def exact_schedule(
    graph: CostGraph,
    swarm: Swarm,
    workload: Workload,
    *,
    objective: str = "step_time",
    max_devices: int | None = None,
    max_nodes: int = 2_000_000,
    stages: int | None = None,
) -> Plan:
    """The optimal plan over all acyclic assignments using at most ``max_devices`` devices (exactly
    ``stages`` of them when given)."""
    if objective not in ("step_time", "makespan"):
        raise PlanError(f"objective {objective!r} must be 'step_time' or 'makespan'")
    nd = len(swarm.devices)
    limit = nd if max_devices is None else min(max_devices, nd)
    if stages is not None:
        limit = min(limit, stages)
    evaluate = Evaluator(graph, swarm, workload, objective, stages)
    search = _Search(graph, swarm, workload, evaluate, limit, max_nodes)
    search.place(0)
    if search.best is None:
        raise PlanError("no acyclic assignment fits the devices' memory")
    _val, cost = evaluate(search.best)
    names = {op.name: search.best[i] for i, op in enumerate(graph.ops)}
    return plan_from_cost(cost, swarm, names, objective, candidates=evaluate.evaluations)
