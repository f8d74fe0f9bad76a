"""Local refinement of an assignment against the true objective (simulator step time or makespan).

The DPs optimise a bottleneck over cuts of one order with cut bytes approximated for DAGs; this
hill-climb works on the assignment itself, evaluated exactly (``evaluate_assignment``), so it can
fix what the DP could not see: skip connections, fill time of the schedule, per-pair links.

Moves, tried in a fixed order (first improvement wins, then the pass restarts):

1. move one op at a sub-DAG border to the device of one of its neighbours (ops of the bottleneck
   stage first), kept only if the sub-DAG graph stays acyclic; on small graphs also any op to an
   unused device (a new sub-DAG of its own);
2. give a stage an unused device (one per class of interchangeable devices), or swap two stages'
   devices (heterogeneous speeds, memories and links);
3. merge a stage into a neighbouring stage (fewer cuts when communication dominates);
4. split the bottleneck stage in two, the second half on an unused device.

On small graphs, once no move improves, iterated local search kicks the best plan with two random
moves (fixed seed) and climbs again. Everything is deterministic; ``budget`` caps the number of
evaluations so planning time stays bounded on large graphs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from fusionnet.errors import PartitionError
from fusionnet.perfmodel.placement_cost import AssignmentCost, OpTimes, evaluate_assignment
from fusionnet.perfmodel.types import CostGraph, Swarm, Workload

IMPROVE = 1e-9  # relative improvement a move must bring (guards against float ping-pong)
KICKS_WITHOUT_GAIN = 40  # iterated local search stops after this many perturbations without a gain


class Evaluator:
    """Scores assignments (lists in op order); infeasible or cyclic ones score infinity."""

    def __init__(
        self, graph: CostGraph, swarm: Swarm, workload: Workload, objective: str, stages: int | None = None
    ) -> None:
        self.graph, self.swarm, self.workload, self.objective = graph, swarm, workload, objective
        self.stages = stages  # when set, only assignments with exactly this many stages are feasible
        self.evaluations = 0
        self.op_times = OpTimes(graph, swarm)
        self._cache: dict[tuple[int, ...], tuple[float, AssignmentCost | None]] = {}

    def __call__(self, assign: list[int]) -> tuple[float, AssignmentCost | None]:
        key = tuple(assign)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.stages is not None and len(set(key)) != self.stages:
            return (float("inf"), None)
        self.evaluations += 1
        try:
            cost = evaluate_assignment(self.graph, self.swarm, self.workload, list(assign), self.op_times)
        except PartitionError:
            result: tuple[float, AssignmentCost | None] = (float("inf"), None)
        else:
            if cost.memory_violation(self.swarm) is not None:
                result = (float("inf"), cost)
            else:
                result = (cost.objective(self.objective), cost)
        if len(self._cache) < 20000:
            self._cache[key] = result
        return result


def _bottleneck_stage(cost: AssignmentCost) -> int:
    return max(range(len(cost.stages)), key=lambda i: (cost.compute_seconds(i), -i))


def _unused_representatives(swarm: Swarm, used: set[int], classes: list[list[int]]) -> list[int]:
    reps = []
    for group in classes:
        free = [d for d in group if d not in used]
        if free:
            reps.append(free[0])
    return reps


def _moves(
    graph: CostGraph,
    assign: list[int],
    cost: AssignmentCost,
    swarm: Swarm,
    classes: list[list[int]],
    max_stages: int,
    small: bool,
):
    """Candidate assignments around ``assign`` in the order of the module docstring."""
    n = len(assign)
    stages = [s.device for s in cost.stages]
    hot = stages[_bottleneck_stage(cost)]
    border = []
    for i in range(n):
        targets = sorted({assign[j] for j in (*graph.preds[i], *graph.succs[i])} - {assign[i]})
        if targets:
            border.append((assign[i] != hot and hot not in targets, i, targets))
    border.sort()
    for _, i, targets in border:
        if sum(1 for d in assign if d == assign[i]) == 1:
            continue  # emptying a stage is what merges are for
        for d in targets:
            new = list(assign)
            new[i] = d
            yield new
    used = set(stages)
    if small and len(stages) < max_stages:
        for i in range(n):
            if sum(1 for d in assign if d == assign[i]) > 1:
                for q in _unused_representatives(swarm, used, classes):
                    new = list(assign)
                    new[i] = q
                    yield new
    for p in stages:
        for q in _unused_representatives(swarm, used, classes):
            yield [q if d == p else d for d in assign]
    for x in range(len(stages)):
        for y in range(x + 1, len(stages)):
            p, q = stages[x], stages[y]
            if small or hot in (p, q):  # large plans: only swaps that move the bottleneck
                yield [q if d == p else p if d == q else d for d in assign]
    for x in range(len(stages) - 1):
        p, q = stages[x], stages[x + 1]
        yield [q if d == p else d for d in assign]
        yield [p if d == q else d for d in assign]
    if len(stages) < max_stages:
        ops = [i for i in range(n) if assign[i] == hot]
        reps = _unused_representatives(swarm, used, classes)
        if len(ops) > 1 and reps:
            work = [graph.ops[i].flops_fwd + graph.ops[i].flops_bwd for i in ops]
            total, run, cut = sum(work), 0, len(ops) - 1
            for k, w in enumerate(work):
                run += w
                if run * 2 >= total:
                    cut = max(1, min(k + 1, len(ops) - 1))
                    break
            for q in reps:
                new = list(assign)
                for i in ops[cut:]:
                    new[i] = q
                yield new


def refine(
    evaluate: Callable[[list[int]], tuple[float, AssignmentCost | None]],
    graph: CostGraph,
    swarm: Swarm,
    assign: list[int],
    classes: list[list[int]],
    max_stages: int,
    budget: int,
    small: bool = False,
) -> list[int]:
    """Hill-climb from ``assign`` until no move improves or ``budget`` evaluations are spent. On
    small graphs the rest of the budget goes to iterated local search: two random moves from the
    best plan (fixed seed), a new climb, kept when better."""
    spent = [0]

    def climb(start: list[int]) -> tuple[list[int], float, AssignmentCost | None]:
        cur = list(start)
        val, cost = evaluate(cur)
        improved = cost is not None
        while improved and spent[0] < budget:
            improved = False
            for cand in _moves(graph, cur, cost, swarm, classes, max_stages, small):
                if len(set(cand)) > max_stages:
                    continue
                spent[0] += 1
                v, c = evaluate(cand)
                if c is not None and v < val * (1 - IMPROVE):
                    cur, val, cost = cand, v, c
                    improved = True
                    break
                if spent[0] >= budget:
                    break
        return cur, val, cost

    best, best_val, best_cost = climb(assign)
    if not small or best_cost is None:
        return best
    rng = random.Random(0)
    stale = 0
    while spent[0] < budget and stale < KICKS_WITHOUT_GAIN:
        cand, cost = best, best_cost
        for _ in range(2):
            options = [
                m
                for m in _moves(graph, cand, cost, swarm, classes, max_stages, small)
                if len(set(m)) <= max_stages
            ]
            if not options:
                break
            pick = rng.choice(options)
            spent[0] += 1
            _v, c = evaluate(pick)
            if c is None:
                break
            cand, cost = pick, c
        got, val, _cost = climb(cand)
        if val < best_val * (1 - IMPROVE):
            best, best_val, best_cost, stale = got, val, _cost, 0
        else:
            stale += 1
    return best
