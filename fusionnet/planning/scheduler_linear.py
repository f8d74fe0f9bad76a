"""Linearising a DAG for the segment DP: topological orders and per-position prefix sums.

Every acyclic assignment is a set of contiguous segments of *some* topological order (order the
sub-DAG graph topologically, then each sub-DAG's ops), so the scheduler searches over a few good
orders and, for each, over cuts of that order. A good order keeps cheap cuts available: sources
(data placeholders, parameters) next to their first user, branches kept together, small live sets.

``LinearModel`` precomputes, for one order, what makes a segment's cost O(1): prefix sums of work
and memory, the bytes crossing every cut (communication buffers) and, per pair of cuts, the bytes a
segment sends on (its outputs read later, each once). For chains these are exact; for DAGs the DP
puts everything a stage sends on the link to the next stage, and the exact evaluation of the final
assignment corrects that.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from fusionnet.perfmodel.memory import optimizer_state_bytes
from fusionnet.perfmodel.timing import bp_bytes, fp_bytes, update_bytes, update_flops
from fusionnet.perfmodel.types import CostGraph, Workload


def _kahn(graph: CostGraph, pick) -> list[int]:
    n = len(graph.ops)
    indeg = [len(p) for p in graph.preds]
    ready = [i for i in range(n) if indeg[i] == 0]
    order: list[int] = []
    while ready:
        i = pick(ready, order)
        ready.remove(i)
        order.append(i)
        for s in graph.succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    assert len(order) == n, "CostGraph validation guarantees a DAG"
    return order


def sources_late_order(graph: CostGraph) -> list[int]:
    """As late as possible: the reverse of a reverse-Kahn order taking the latest op first. Puts data
    placeholders and parameters right before their first user."""
    n = len(graph.ops)
    outdeg = [len(s) for s in graph.succs]
    heap = [-i for i in range(n) if outdeg[i] == 0]
    heapq.heapify(heap)
    rev: list[int] = []
    while heap:
        i = -heapq.heappop(heap)
        rev.append(i)
        for p in graph.preds[i]:
            outdeg[p] -= 1
            if outdeg[p] == 0:
                heapq.heappush(heap, -p)
    return rev[::-1]


def depth_first_order(graph: CostGraph) -> list[int]:
    """Finish the most recently opened branch first (keeps a branch inside one segment)."""
    return _kahn(graph, lambda ready, order: max(ready))


def min_live_order(graph: CostGraph) -> list[int]:
    """Greedy: next the ready op that leaves the fewest live bytes (cheapest cuts along the way)."""
    out_b = graph.out_bytes
    remaining_users = [len(s) for s in graph.succs]

    def pick(ready: list[int], order: list[int]) -> int:
        def delta(i: int) -> tuple[int, int]:
            freed = sum(out_b[p] for p in graph.preds[i] if remaining_users[p] == 1)
            return (out_b[i] - freed, i)

        best = min(ready, key=delta)
        for p in graph.preds[best]:
            remaining_users[p] -= 1
        return best

    return _kahn(graph, pick)


def all_orders(graph: CostGraph, limit: int) -> list[list[int]] | None:
    """Every topological order, or None when there are more than ``limit``."""
    n = len(graph.ops)
    indeg = [len(p) for p in graph.preds]
    out: list[list[int]] = []
    prefix: list[int] = []

    def walk() -> bool:
        if len(prefix) == n:
            out.append(list(prefix))
            return len(out) <= limit
        for i in range(n):
            if indeg[i] == 0 and i not in prefix:
                prefix.append(i)
                for s in graph.succs[i]:
                    indeg[s] -= 1
                ok = walk()
                for s in graph.succs[i]:
                    indeg[s] += 1
                prefix.pop()
                if not ok:
                    return False
        return True

    return out if walk() else None


def candidate_orders(graph: CostGraph, small_limit: int = 0) -> list[list[int]]:
    """Distinct topological orders worth trying, the given one first (a chain has exactly one).

    With ``small_limit``, a small graph with at most that many topological orders gets all of them
    (the segment DP then sees every acyclic split), one with more a fixed-seed sample of that many.
    """
    if graph.is_chain:
        return [list(range(len(graph.ops)))]
    orders: list[list[int]] = []
    for order in (
        list(range(len(graph.ops))),
        sources_late_order(graph),
        depth_first_order(graph),
        min_live_order(graph),
    ):
        if order not in orders:
            orders.append(order)
    if small_limit and len(graph.ops) <= 16:
        every = all_orders(graph, small_limit)
        if every is None:
            # too many to list: a fixed-seed sample of random topological orders
            rng = random.Random(len(graph.ops))
            every = [_kahn(graph, lambda ready, order: rng.choice(sorted(ready))) for _ in range(small_limit)]
        for o in every:
            if o not in orders:
                orders.append(o)
    return orders


@dataclass
class LinearModel:
    """Prefix sums over one topological order; positions 0..L, segment [a, b) = order[a:b]."""

    order: list[int]
    work_flops: list[float]  # m*(fwd+bwd) FLOPs + update FLOPs, prefix
    work_bytes: list[float]  # m*(fwd+bwd) memory traffic + update traffic, prefix
    state_bytes: list[int]  # params + grads + optimizer state, prefix
    act_bytes: list[int]  # activation bytes per micro-batch, prefix
    ckpt_bytes: list[int]  # params + optimizer state, prefix
    cut_fwd: list[int]  # bytes crossing the cut before position i (staging buffers, cut choice)
    cuts: list[int]  # cut positions the DP may use, ascending, first 0 and last L
    out_fwd: list[list[int]]  # [ai][bi]: bytes produced in [cuts[ai], cuts[bi]) and read at or after cuts[bi]
    out_bwd: list[list[int]]  # the same, counting only outputs a gradient flows back into


def build_linear_model(graph: CostGraph, workload: Workload, order: list[int], max_cuts: int) -> LinearModel:
    m = workload.microbatches
    pos = [0] * len(order)
    for p, i in enumerate(order):
        pos[i] = p
    grad = graph.needs_grad
    wf, wb, st, ac, ck = [0.0], [0.0], [0], [0], [0]
    for i in order:
        op = graph.ops[i]
        flops = m * op.flops_fwd
        traffic = m * fp_bytes(op)
        state = op.param_bytes
        ckpt = op.param_bytes
        if workload.backward and grad[i]:
            flops += m * op.flops_bwd
            traffic += m * bp_bytes(op)
        if workload.backward:
            state += op.param_bytes
        if workload.update:
            flops += update_flops(op)
            traffic += update_bytes(op)
            state += optimizer_state_bytes(op)
            ckpt += optimizer_state_bytes(op)
        wf.append(wf[-1] + flops)
        wb.append(wb[-1] + traffic)
        st.append(st[-1] + state)
        ac.append(ac[-1] + op.activation_bytes)
        ck.append(ck[-1] + ckpt)
    n = len(order)
    dfw = [0] * (n + 2)
    out_b = graph.out_bytes
    for i in range(len(graph.ops)):
        if graph.succs[i]:
            last = max(pos[s] for s in graph.succs[i])
            # the output of op i crosses every cut c with pos[i] < c <= last
            dfw[pos[i] + 1] += out_b[i]
            dfw[last + 1] -= out_b[i]
    cut_fwd = [0] * (n + 1)
    run = 0
    for c in range(n + 1):
        run += dfw[c]
        cut_fwd[c] = run
    cut_fwd[0] = cut_fwd[n] = 0
    cuts = choose_cuts(wf, cut_fwd, max_cuts)
    out_fwd, out_bwd = _segment_out_bytes(graph, pos, cuts)
    return LinearModel(order, wf, wb, st, ac, ck, cut_fwd, cuts, out_fwd, out_bwd)


def _segment_out_bytes(
    graph: CostGraph, pos: list[int], cuts: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """What a stage [cuts[ai], cuts[bi]) sends on: its outputs read at or after cuts[bi].

    A stage is charged only for tensors it produces (each once), not for tensors that merely skip
    over it, so a skip edge is counted once rather than at every cut it crosses. For a chain this
    equals the bytes crossing the cut.
    """
    nc = len(cuts)
    # cut index of the first cut strictly after each position, and of the last cut at or before it
    after = [0] * (cuts[-1] + 1)
    upto = [0] * (cuts[-1] + 1)
    j = 0
    for p in range(cuts[-1] + 1):
        while cuts[j] < p:
            j += 1
        upto[p] = j if cuts[j] == p else j - 1
        after[p] = j if cuts[j] > p else j + 1 if j + 1 < nc else nc
    diff_f = [[0] * (nc + 1) for _ in range(nc)]
    diff_b = [[0] * (nc + 1) for _ in range(nc)]
    out_b, grad = graph.out_bytes, graph.needs_grad
    for u in range(len(graph.ops)):
        if not graph.succs[u] or out_b[u] == 0:
            continue
        p = pos[u]
        last = max(pos[s] for s in graph.succs[u])
        lo, hi = after[p], upto[last]  # bi range: p < cuts[bi] <= last
        if lo > hi:
            continue
        for ai in range(upto[p] + 1):
            diff_f[ai][lo] += out_b[u]
            diff_f[ai][hi + 1] -= out_b[u]
            if grad[u]:
                diff_b[ai][lo] += out_b[u]
                diff_b[ai][hi + 1] -= out_b[u]
    out_fwd = [[0] * nc for _ in range(nc)]
    out_bwd = [[0] * nc for _ in range(nc)]
    for ai in range(nc):
        run_f = run_b = 0
        for bi in range(nc):
            run_f += diff_f[ai][bi]
            run_b += diff_b[ai][bi]
            out_fwd[ai][bi], out_bwd[ai][bi] = run_f, run_b
    return out_fwd, out_bwd


def choose_cuts(work: list[float], cut_fwd: list[int], max_cuts: int) -> list[int]:
    """All positions when there are few; otherwise the cheapest cut in each of ``max_cuts // 2``
    equal-work buckets (coverage) plus the globally cheapest cuts (e.g. transformer block borders)."""
    n = len(work) - 1
    if n + 1 <= max_cuts:
        return list(range(n + 1))
    inner = range(1, n)
    chosen = {0, n}
    buckets = max(1, max_cuts // 2)
    total = work[-1] or 1.0
    best: dict[int, int] = {}
    for c in inner:
        b = min(buckets - 1, int(work[c] / total * buckets)) if work[-1] > 0 else c * buckets // n
        if b not in best or cut_fwd[c] < cut_fwd[best[b]]:
            best[b] = c
    chosen.update(best.values())
    for c in sorted(inner, key=lambda c: (cut_fwd[c], c)):
        if len(chosen) >= max_cuts:
            break
        chosen.add(c)
    return sorted(chosen)
