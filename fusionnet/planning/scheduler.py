"""The scheduler for FusionAI problem (2): which device runs which ops, and how many devices to use.

``schedule`` minimises the predicted step time (schedule simulator; or ``objective="makespan"``,
problem (2)'s bottleneck) subject to every device's D_gpu / D_cpu / D_disk. The assignment is always
contiguous segments of a topological order, so the sub-DAG graph is acyclic (the executor needs
that). The search, all deterministic:

1. a few topological orders (``scheduler_linear``: the chain itself for chains);
2. per order, a segment DP over cuts x devices (``scheduler_dp``): exact over device classes when
   that state space is small (chains: the exact optimum of the makespan), over a few device
   sequences otherwise; it yields the best split for every stage count, which is how the number of
   devices worth using is decided (more devices, more cuts, more communication and fill time). For
   the step-time objective the DP's latency variant adds the splits with the shortest pipeline fill
   under a few bottleneck bounds (step time ~ fill + (m - 1) x bottleneck, eq. (4)'s shape);
3. the most promising candidates are evaluated exactly (``evaluate_assignment`` + the simulator)
   and the best (three on small graphs) refined by local search on the true objective, iterated
   with seeded kicks on small graphs (``scheduler_refine``). An evaluation budget bounds the time.

Infeasible instances raise ``PlanError`` naming the binding constraint. ``balanced_split`` is the
plain default policy (FLOP-balanced contiguous pieces) and ``plan_for_assignment`` predicts any
given assignment. ``scheduler_exact`` holds the exact solver the tests and benchmark compare with.
"""

from __future__ import annotations

from collections.abc import Mapping

from fusionnet.errors import PlanError
from fusionnet.perfmodel.memory import fmt_bytes, inflight_microbatches, optimizer_state_bytes
from fusionnet.perfmodel.placement_cost import evaluate_assignment
from fusionnet.perfmodel.types import CostGraph, Swarm, Workload
from fusionnet.planning.scheduler_dp import (
    SegmentCoster,
    Segments,
    class_dp,
    class_dp_size,
    device_classes,
    prefix_dp,
)
from fusionnet.planning.scheduler_linear import build_linear_model, candidate_orders
from fusionnet.planning.scheduler_plan import Plan, plan_from_cost
from fusionnet.planning.scheduler_refine import Evaluator, refine

OBJECTIVES = ("step_time", "makespan")
MAX_CUTS = 160  # cut positions the DP considers on large graphs (all of them below this)
CLASS_DP_LIMIT = 60_000  # states above which the class DP gives way to the sequence DP
CHAIN_DP_LIMIT = 2_000_000  # states the exact chain DP accepts
SMALL_GRAPH = 40  # ops up to which the search is exhaustive over orders and multi-start
SMALL_ORDERS = 64  # a small DAG with at most this many topological orders gets all of them
BOUND_FACTORS_SMALL = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0)
BOUND_FACTORS_LARGE = (1.0, 1.1, 1.25, 1.5, 2.0)
PATIENCE = 8  # large instances: stop adding stages after this many stopped improving the best plan
WORK_BUDGET = 300_000  # evaluation work units (see _budget)
LATENCY_RUNS = 4  # DP runs (order x device sequence) that also get the latency variant


def _check_args(
    graph: CostGraph, swarm: Swarm, workload: Workload, max_devices: int | None, objective: str
) -> int:
    for value, cls, name in (
        (graph, CostGraph, "graph"),
        (swarm, Swarm, "swarm"),
        (workload, Workload, "workload"),
    ):
        if not isinstance(value, cls):
            raise PlanError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r} must be one of {', '.join(OBJECTIVES)}")
    if max_devices is None:
        return len(swarm.devices)
    if not isinstance(max_devices, int) or isinstance(max_devices, bool) or max_devices < 1:
        raise PlanError(f"max_devices must be a positive integer, got {max_devices!r}")
    return min(max_devices, len(swarm.devices))


def _sequences(swarm: Swarm, classes: list[list[int]], cap: int) -> list[list[int]]:
    """Device sequences for the prefix DP; ``seq[0]`` runs the last stage, ``seq[:s]`` are used."""
    pool = sorted(d for group in classes for d in group[:cap])
    devs = swarm.devices
    by_speed = sorted(pool, key=lambda d: (-devs[d].speed, -devs[d].compute_memory, d))
    by_memory = sorted(pool, key=lambda d: (-devs[d].compute_memory, -devs[d].speed, d))
    seqs = [by_speed, by_memory]
    if not swarm.uniform_links:
        # chain of good links starting from the fastest device
        probe = 1 << 20
        chain, rest = [by_speed[0]], set(pool) - {by_speed[0]}
        while rest:
            last = chain[-1]
            nxt = min(
                rest,
                key=lambda d: (
                    swarm.link(d, last).time(probe) + swarm.link(last, d).time(probe),
                    -devs[d].speed,
                    d,
                ),
            )
            chain.append(nxt)
            rest.remove(nxt)
        seqs.append(chain)
    unique: list[list[int]] = []
    for s in seqs:
        if s not in unique:
            unique.append(s)
    return unique


def _to_assignment(order: list[int], segs: Segments, n_ops: int) -> list[int]:
    assign = [-1] * n_ops
    for a, b, d in segs:
        for p in range(a, b):
            assign[order[p]] = d
    return assign


def _dp_candidates(
    graph: CostGraph, swarm: Swarm, workload: Workload, max_stages: int, small: bool, objective: str
) -> list[tuple[float, int, list[int]]]:
    """(estimated objective, stage count, assignment) from every order x DP run, most promising first.

    The estimate is eq. (4)'s shape: a per-micro-batch fill latency plus ``m - 1`` bottleneck periods.
    """
    classes = device_classes(swarm, list(range(len(swarm.devices))))
    m = workload.microbatches
    found: dict[tuple[int, ...], float] = {}

    def keep(order: list[int], segs: Segments, est: float) -> None:
        key = tuple(_to_assignment(order, segs, len(graph.ops)))
        if key not in found or est < found[key]:
            found[key] = est

    patience = None if small else PATIENCE
    runs = []  # (best bottleneck, order, solver)
    for order in candidate_orders(graph, small_limit=SMALL_ORDERS if small else 0):
        lm = build_linear_model(graph, workload, order, MAX_CUTS)
        cap = min(max_stages, len(lm.cuts) - 1)
        coster = SegmentCoster(lm, workload, cap)
        if class_dp_size(classes, len(lm.cuts), max_stages) <= CLASS_DP_LIMIT:
            solvers = [lambda bound, c=coster: class_dp(c, swarm, classes, max_stages, bound, patience)]
        else:
            solvers = [
                (lambda bound, c=coster, seq=seq: prefix_dp(c, swarm, seq, max_stages, bound, patience))
                for seq in _sequences(swarm, classes, cap)
            ]
        for solve in solvers:
            per_s = solve(None)
            if per_s:
                for s, (val, segs) in per_s.items():
                    keep(order, segs, val if objective == "makespan" else val * (m + s - 1) / m)
                runs.append((min(val for val, _ in per_s.values()), len(runs), order, solve))
    if objective == "step_time":
        # the latency variant, for the runs whose bottleneck is best
        factors = BOUND_FACTORS_SMALL if small else BOUND_FACTORS_LARGE
        for bottleneck, _i, order, solve in sorted(runs, key=lambda r: (r[0], r[1]))[:LATENCY_RUNS]:
            for f in factors:
                bound = bottleneck * f
                for _s, (total, segs) in solve(bound).items():
                    keep(order, segs, (total + (m - 1) * bound) / m)
    return sorted(((est, len(set(k)), list(k)) for k, est in found.items()), key=lambda t: (t[0], t[1], t[2]))


def _fallbacks(graph: CostGraph, swarm: Swarm, max_stages: int, stages: int | None) -> list[list[int]]:
    """Plain plans tried only when no DP candidate fits (the DP's cut model over-counts tensors that
    skip stages, so on a DAG it can miss a plan that fits): FLOP-balanced pieces on the devices with
    the most memory, for every piece count."""
    by_memory = sorted(range(len(swarm.devices)), key=lambda d: (-swarm.devices[d].compute_memory, d))
    out = []
    counts = [stages] if stages is not None else range(1, min(max_stages, len(graph.ops), 128) + 1)
    for k in counts:
        pieces = balanced_split(graph, k)
        out.append([by_memory[pieces[op.name]] for op in graph.ops])
    return out


def _budget(graph: CostGraph, workload: Workload, stages: int) -> int:
    """Exact evaluations the search may spend. One evaluation costs about the graph's size plus the
    simulated schedule's events; the total is capped so planning time stays bounded."""
    unit = len(graph.ops) + len(graph.edges) + 3 * stages * workload.microbatches
    return max(30, min(4000, WORK_BUDGET // unit))


def schedule(
    graph: CostGraph,
    swarm: Swarm,
    workload: Workload,
    *,
    max_devices: int | None = None,
    objective: str = "step_time",
    stages: int | None = None,
) -> Plan:
    """Plans ``graph`` onto ``swarm`` (see the module docstring); raises ``PlanError`` when nothing fits.

    ``stages`` fixes the number of sub-DAGs (a job that asks for exactly k compnodes): the scheduler
    then chooses only the cuts and which k devices run them."""
    max_stages = _check_args(graph, swarm, workload, max_devices, objective)
    if stages is not None:
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise PlanError(f"stages must be a positive integer, got {stages!r}")
        if stages > min(max_stages, len(graph.ops)):
            raise PlanError(
                f"cannot cut {len(graph.ops)} op(s) into {stages} sub-DAGs on {max_stages} device(s)"
            )
        max_stages = stages
    _check_single_ops(graph, swarm, workload)
    small = len(graph.ops) <= SMALL_GRAPH
    evaluator = Evaluator(graph, swarm, workload, objective, stages)
    candidates = _dp_candidates(graph, swarm, workload, max_stages, small, objective)
    budget = _budget(graph, workload, candidates[0][1] if candidates else 1)
    scored = []
    for rank, (_est, _s, assign) in enumerate(candidates[: max(16, budget // 3)]):
        val, _cost = evaluator(assign)
        if val < float("inf"):
            scored.append((val, rank, assign))
    if not scored:
        fallbacks = _fallbacks(graph, swarm, max_stages, stages)
        for rank, assign in enumerate(fallbacks, start=len(candidates)):
            val, _cost = evaluator(assign)
            if val < float("inf"):
                scored.append((val, rank, assign))
    if not scored:
        raise PlanError(_diagnose(graph, swarm, workload, max_stages))
    scored.sort(key=lambda t: (t[0], t[1]))
    starts = [a for _v, _r, a in scored[: (3 if small else 1)]]
    classes = device_classes(swarm, list(range(len(swarm.devices))))
    best_val, best = float("inf"), None
    for start in starts:
        spent = evaluator.evaluations
        left = max(budget - spent, budget // 4) // len(starts)
        refined = refine(evaluator, graph, swarm, start, classes, max_stages, left, small)
        val, _cost = evaluator(refined)
        if val < best_val:
            best_val, best = val, refined
    assert best is not None
    _val, cost = evaluator(best)
    assert cost is not None
    names = {op.name: best[i] for i, op in enumerate(graph.ops)}
    return plan_from_cost(cost, swarm, names, objective, candidates=evaluator.evaluations)


def chain_dp(graph: CostGraph, swarm: Swarm, workload: Workload, *, max_devices: int | None = None) -> Plan:
    """The exact DP for chain-shaped graphs (Confidant / PAC style, heterogeneous devices and memory):
    the plan minimising problem (2)'s makespan over every assignment, without local search.

    Exact over all cut positions and device choices via the device-class DP; refuses graphs that are
    not chains and swarms whose class state space is too large to enumerate (``schedule`` handles
    those heuristically).
    """
    max_stages = _check_args(graph, swarm, workload, max_devices, "makespan")
    if not graph.is_chain:
        raise PlanError(
            "chain_dp needs a chain-shaped graph (every op feeding only the next); use schedule()"
        )
    _check_single_ops(graph, swarm, workload)
    classes = device_classes(swarm, list(range(len(swarm.devices))))
    lm = build_linear_model(graph, workload, list(range(len(graph.ops))), len(graph.ops) + 1)
    if class_dp_size(classes, len(lm.cuts), max_stages) > CHAIN_DP_LIMIT:
        raise PlanError("too many distinct devices for the exact chain DP; use schedule()")
    per_s = class_dp(
        SegmentCoster(lm, workload, min(max_stages, len(lm.cuts) - 1)), swarm, classes, max_stages
    )
    if not per_s:
        raise PlanError(_diagnose(graph, swarm, workload, max_stages))
    _s, (_val, segs) = min(per_s.items(), key=lambda kv: (kv[1][0], kv[0]))
    assign = _to_assignment(lm.order, segs, len(graph.ops))
    cost = evaluate_assignment(graph, swarm, workload, assign)
    names = {op.name: assign[i] for i, op in enumerate(graph.ops)}
    return plan_from_cost(cost, swarm, names, "makespan", candidates=len(per_s))


def plan_for_assignment(
    graph: CostGraph,
    swarm: Swarm,
    workload: Workload,
    assignment: Mapping[str, int],
    *,
    objective: str = "step_time",
    check_memory: bool = True,
) -> Plan:
    """The performance model's predictions for a given assignment (e.g. ``balanced_split``'s)."""
    _check_args(graph, swarm, workload, None, objective)
    cost = evaluate_assignment(graph, swarm, workload, assignment)
    if check_memory:
        why = cost.memory_violation(swarm)
        if why is not None:
            raise PlanError(f"the assignment does not fit: {why}")
    return plan_from_cost(cost, swarm, assignment, objective)


def balanced_split(graph: CostGraph, n: int) -> dict[str, int]:
    """Cuts the op order into ``n`` contiguous non-empty pieces minimising the largest FP+BP FLOPs."""
    if not isinstance(graph, CostGraph):
        raise PlanError(f"graph must be a CostGraph, got {type(graph).__name__}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise PlanError(f"the number of pieces must be a positive integer, got {n!r}")
    if n > len(graph.ops):
        raise PlanError(f"cannot cut {len(graph.ops)} ops into {n} non-empty pieces")
    w = [op.flops_fwd + op.flops_bwd for op in graph.ops]

    def pieces(bound: int) -> int:
        count, run = 1, 0
        for x in w:
            if run + x > bound:
                count, run = count + 1, 0
            run += x
        return count

    lo, hi = max(w), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if pieces(mid) <= n:
            hi = mid
        else:
            lo = mid + 1
    out: dict[str, int] = {}
    piece, run, filled = 0, 0, 0
    for i, op in enumerate(graph.ops):
        must_open = len(w) - i == n - 1 - piece  # one op left per piece still to open
        if filled and piece < n - 1 and (run + w[i] > lo or must_open):
            piece, run, filled = piece + 1, 0, 0
        out[op.name] = piece
        run += w[i]
        filled += 1
    assert piece == n - 1, "the bound admits n pieces"
    return out


def _op_needs(graph: CostGraph, workload: Workload, i: int) -> tuple[int, int]:
    """(resident bytes, checkpoint bytes) of op i alone at the smallest in-flight count."""
    op = graph.ops[i]
    inflight = inflight_microbatches(workload, 0, 1)
    grads = op.param_bytes if workload.backward else 0
    opt = optimizer_state_bytes(op) if workload.update else 0
    return op.param_bytes + grads + opt + inflight * op.activation_bytes, op.param_bytes + opt


def _check_single_ops(graph: CostGraph, swarm: Swarm, workload: Workload) -> None:
    """Refuses at once an op that no device can hold even alone, naming op and resource."""
    devs = swarm.devices
    top_mem = max(devs, key=lambda d: (d.compute_memory, d.d_disk))
    top_disk = max(devs, key=lambda d: (d.d_disk, d.compute_memory))
    for i, op in enumerate(graph.ops):
        resident, ckpt = _op_needs(graph, workload, i)
        if any(resident <= d.compute_memory and ckpt <= d.d_disk for d in devs):
            continue
        if resident > top_mem.compute_memory:
            where = "d_gpu" if top_mem.kind == "gpu" else "d_cpu"
            raise PlanError(
                f"op {op.name!r} needs {fmt_bytes(resident)} of {where} (parameters, gradients, optimizer "
                f"state, activations) but the largest device ({top_mem.name!r}) has "
                f"{fmt_bytes(top_mem.compute_memory)}"
            )
        if ckpt > top_disk.d_disk:
            raise PlanError(
                f"op {op.name!r} needs {fmt_bytes(ckpt)} of d_disk for its checkpoint but the largest device "
                f"({top_disk.name!r}) has {fmt_bytes(top_disk.d_disk)}"
            )
        raise PlanError(
            f"op {op.name!r} needs {fmt_bytes(resident)} of computing memory and {fmt_bytes(ckpt)} of "
            "d_disk; no single device has both"
        )


def _diagnose(graph: CostGraph, swarm: Swarm, workload: Workload, max_stages: int) -> str:
    """Why no plan fits, naming the binding constraint."""
    need = sum(_op_needs(graph, workload, i)[0] for i in range(len(graph.ops)))
    devs = sorted(swarm.devices, key=lambda d: -d.compute_memory)[:max_stages]
    have = sum(d.compute_memory for d in devs)
    if need > have:
        return (
            f"the model needs at least {fmt_bytes(need)} of computing memory (parameters, gradients, "
            f"optimizer state, activations) but the {len(devs)} largest usable device(s) have "
            f"{fmt_bytes(have)} together"
            + (f" (max_devices={max_stages})" if max_stages < len(swarm.devices) else "")
        )
    return (
        f"no split into at most {max_stages} contiguous sub-DAGs fits the devices' memory: activations of "
        f"{inflight_microbatches(workload, 0, max(1, max_stages))} in-flight micro-batch(es) under "
        f"{workload.schedule} "
        "and communication buffers push every stage over its device; use more devices, fewer micro-batches "
        "or the 1f1b schedule"
    )
