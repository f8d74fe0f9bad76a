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
    n, nd = len(graph.ops), len(swarm.devices)
    limit = nd if max_devices is None else min(max_devices, nd)
    if stages is not None:
        limit = min(limit, stages)
    m = workload.microbatches
    grad = graph.needs_grad
    # per op x device: compute seconds per step, resident bytes at the smallest in-flight count
    work = [
        [
            m * (op_fp_seconds(op, d) + (op_bp_seconds(op, d, grad[i]) if workload.backward else 0.0))
            + (op_update_seconds(op, d) if workload.update else 0.0)
            for d in swarm.devices
        ]
        for i, op in enumerate(graph.ops)
    ]
    low_inflight = inflight_microbatches(workload, 0, 1)
    resident = [
        op.param_bytes * (2 if workload.backward else 1)
        + (optimizer_state_bytes(op) if workload.update else 0)
        + low_inflight * op.activation_bytes
        for op in graph.ops
    ]
    caps = [d.compute_memory for d in swarm.devices]
    classes = device_classes(swarm, list(range(nd)))
    out_b = graph.out_bytes
    evaluate = Evaluator(graph, swarm, workload, objective, stages)

    assign = [-1] * n
    load = [0.0] * nd
    mem = [0] * nd
    qedges: dict[int, dict[int, int]] = {}
    sent: dict[tuple[int, int], int] = {}  # (producer op, consumer device) -> uses, for link bounds
    link_bytes: dict[tuple[int, int], int] = {}
    best = [float("inf"), None]
    nodes = [0]

    def link_bound() -> float:
        worst = 0.0
        for (a, b), nbytes in link_bytes.items():
            worst = max(worst, m * swarm.link(a, b).time(nbytes))
        return worst

    def options(i: int) -> list[int]:
        used = set(assign[:i])
        opts = sorted(used)
        if len(used) < limit:
            # a class's devices are taken in index order, so its first unused one stands for all
            for group in classes:
                fresh = next((d for d in group if d not in used), None)
                if fresh is not None:
                    opts.append(fresh)
        return opts

    def place(i: int) -> None:
        nodes[0] += 1
        if nodes[0] > max_nodes:
            raise PlanError(f"exact search exceeded {max_nodes} nodes; the instance is too large for it")
        if i == n:
            val, cost = evaluate(list(assign))
            if cost is not None and val < best[0]:
                best[0], best[1] = val, list(assign)
            return
        for d in options(i):
            if mem[d] + resident[i] > caps[d] or load[d] + work[i][d] >= best[0]:
                continue
            added: list[tuple[int, int]] = []
            ok = True
            for p in graph.preds[i]:
                a = assign[p]
                if a != d:
                    if d not in qedges.get(a, {}) and _reaches(qedges, d, a):
                        ok = False
                        break
                    added.append((p, a))
            if not ok:
                continue
            assign[i] = d
            load[d] += work[i][d]
            mem[d] += resident[i]
            for p, a in added:
                qedges.setdefault(a, {}).setdefault(d, 0)
                qedges[a][d] += 1
                key = (p, d)
                sent[key] = sent.get(key, 0) + 1
                if sent[key] == 1:
                    link_bytes[(a, d)] = link_bytes.get((a, d), 0) + out_b[p]
            if link_bound() < best[0]:
                place(i + 1)
            for p, a in reversed(added):
                key = (p, d)
                sent[key] -= 1
                if sent[key] == 0:
                    del sent[key]
                    link_bytes[(a, d)] -= out_b[p]
                    if link_bytes[(a, d)] == 0:
                        del link_bytes[(a, d)]
                qedges[a][d] -= 1
                if qedges[a][d] == 0:
                    del qedges[a][d]
            assign[i] = -1
            load[d] -= work[i][d]
            mem[d] -= resident[i]

    place(0)
    if best[1] is None:
        raise PlanError("no acyclic assignment fits the devices' memory")
    _val, cost = evaluate(best[1])
    names = {op.name: best[1][i] for i, op in enumerate(graph.ops)}
    return plan_from_cost(cost, swarm, names, objective, candidates=evaluate.evaluations)
