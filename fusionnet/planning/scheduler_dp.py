"""Segment dynamic programs: cut one topological order into contiguous stages and give each a device.

Both DPs minimise the bottleneck of problem (2) in its overlapped form (``AssignmentCost.makespan``):
the largest stage compute time per step or directed link busy time per step, with every stage
fitting its device's D_gpu / D_cpu / D_disk. They run from the end of the pipeline backwards so a
stage knows how many stages follow it, which fixes its 1F1B in-flight micro-batches (Confidant's and
PAC's recurrences, generalised to heterogeneous devices and memory).

- ``class_dp``: devices grouped into classes of interchangeable devices (same spec; with per-pair
  links each device is its own class). State = (cut, multiset of classes used after it); with
  per-pair links also the class of the next stage. Exact for chains (whose only order is the chain),
  over all device choices and orders. Used when the state space is small.
- ``prefix_dp``: a fixed device sequence; the pipeline with s stages uses ``seq[:s]`` with ``seq[0]``
  last. Scales to thousands of devices; the scheduler tries a few sequences and refines.

Both fill their tables by increasing stage count. On large instances (``patience`` given) the
bottleneck DPs prune with the best complete plan found so far (a state that cannot beat it can never
be part of a better plan) and stop adding stages once ``patience`` more stopped improving it; on
small ones every stage count keeps its own optimum, which the step-time search needs.

Each returns, for every stage count s, the best segmentation found: ``{s: (value, [(a, b, device),
...] in pipeline order)}``.

Given a ``bound``, both solve the latency variant instead: minimise the sum of all terms (stage
compute plus cut transfer times, i.e. m x the pipeline's fill latency) with every term at most the
bound. Step time behaves like ``latency + (m - 1) x bottleneck`` (eq. (4)), so trying a few bounds
above the optimal bottleneck finds splits that trade a slightly slower bottleneck for a shorter fill,
which matters when the micro-batches are few compared with the stages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from fusionnet.perfmodel.types import DeviceSpec, Swarm, Workload
from fusionnet.planning.scheduler_linear import LinearModel

INF = math.inf
Segments = list[tuple[int, int, int]]  # (start position, end position, device index)


@dataclass(frozen=True)
class DevCost:
    """A device's constants for O(1) segment costs."""

    index: int
    inv_speed: float
    inv_bw: float
    gpu: bool
    cap_resident: int  # memory holding params/grads/state/activations
    cap_staging: int  # memory holding network buffers (shared with resident on CPU devices)
    cap_disk: int

    @classmethod
    def of(cls, index: int, d: DeviceSpec) -> DevCost:
        gpu = d.kind == "gpu"
        resident = d.d_gpu if gpu else d.d_cpu
        return cls(index, 1.0 / d.speed, 1.0 / d.mem_bandwidth, gpu, resident, d.d_cpu, d.d_disk)


class SegmentCoster:
    """Per-cut arrays that make the cost of stage [cuts[ai], cuts[bi]) a few subtractions."""

    def __init__(self, lm: LinearModel, workload: Workload, max_stages: int | None = None) -> None:
        """``max_stages``: the most stages a plan may have, the bound zero-bubble's in-flight count
        takes (``inflight``); None: as many as micro-batches."""
        self.lm = lm
        self.m = workload.microbatches
        self.max_stages = workload.microbatches if max_stages is None else max_stages
        self.backward = workload.backward
        self.schedule = workload.schedule
        cuts = lm.cuts
        self.nc = len(cuts)
        self.work_flops = [lm.work_flops[c] for c in cuts]
        self.work_bytes = [lm.work_bytes[c] for c in cuts]
        self.state = [lm.state_bytes[c] for c in cuts]
        self.act = [lm.act_bytes[c] for c in cuts]
        self.ckpt = [lm.ckpt_bytes[c] for c in cuts]
        self.cut = [lm.cut_fwd[c] for c in cuts]
        self._comp: dict[int, list[float]] = {}
        self._res: dict[int, list[int]] = {}

    def inflight(self, r: int) -> int:
        """Micro-batches in flight on a stage with ``r`` stages after it, as the memory model counts them
        (``perfmodel.memory.inflight_microbatches``): 1F1B's stage holds one per stage from it to the
        end; ZB-H1's every stage up to the pipeline's depth p, which the DP (building from the last stage)
        does not know yet, so it is bounded by the most stages a plan may have; GPipe's all m."""
        if not self.backward:
            return 1
        if self.schedule == "1f1b":
            return min(self.m, r + 1)
        if self.schedule == "zero-bubble":
            return min(self.m, max(self.max_stages, r + 1))
        return self.m

    def comp_row(self, dc: DevCost) -> list[float]:
        """Prefix compute seconds per step on device ``dc`` at every cut."""
        row = self._comp.get(dc.index)
        if row is None:
            row = [f * dc.inv_speed + b * dc.inv_bw for f, b in zip(self.work_flops, self.work_bytes)]
            self._comp[dc.index] = row
        return row

    def resident_row(self, inflight: int) -> list[int]:
        row = self._res.get(inflight)
        if row is None:
            row = [s + inflight * a for s, a in zip(self.state, self.act)]
            self._res[inflight] = row
        return row

    def link_params(self, swarm: Swarm, src: int, dst: int) -> tuple[float, float, float, float]:
        """(alpha, beta) forward src -> dst and (alpha, beta) backward dst -> src (zeros for infer)."""
        f = swarm.link(src, dst)
        if not self.backward:
            return (f.alpha, f.beta, 0.0, 0.0)
        b = swarm.link(dst, src)
        return (f.alpha, f.beta, b.alpha, b.beta)

    def scan(
        self,
        ai: int,
        bi_max: int,
        dc: DevCost,
        inflight: int,
        lp: tuple[float, float, float, float],
        tail: list[float],
        bound: float | None,
        best: float,
    ) -> tuple[float, int]:
        """Best end cut bi in (ai, bi_max] for a stage starting at cut ai on ``dc`` followed by plans
        worth ``tail[bi]``: min of max(compute, link, tail) (or, with ``bound``, of their sum with
        every term <= bound). Returns (value, bi); (best, -1) if nothing beats ``best``."""
        cc, rs, ck, cut = self.comp_row(dc), self.resident_row(inflight), self.ckpt, self.cut
        of, ob = self.lm.out_fwd[ai], self.lm.out_bwd[ai]
        a_cc, a_rs, a_ck, a_cut = cc[ai], rs[ai], ck[ai], cut[ai]
        cap_res, cap_stg, cap_disk, gpu = dc.cap_resident, dc.cap_staging, dc.cap_disk, dc.gpu
        af, bf, ab, bb = lp
        m, backward = self.m, self.backward
        arg = -1
        for bi in range(ai + 1, bi_max + 1):
            comp = cc[bi] - a_cc
            if comp >= best or (bound is not None and comp > bound):
                break
            res = rs[bi] - a_rs
            if res > cap_res or ck[bi] - a_ck > cap_disk:
                break
            t = tail[bi]
            if t >= best:
                continue
            stg = 2 * (a_cut + cut[bi])
            if (stg > cap_stg) if gpu else (res + stg > cap_res):
                continue
            nf = of[bi]
            lk = m * (af + bf * nf) if nf else 0.0
            if backward:
                nb = ob[bi]
                if nb:
                    lb = m * (ab + bb * nb)
                    if lb > lk:
                        lk = lb
            if bound is None:
                val = comp if comp > t else t
                if lk > val:
                    val = lk
            elif lk > bound:
                continue
            else:
                val = comp + lk + t
            if val < best:
                best, arg = val, bi
        return best, arg

    def last_stage(self, ai: int, dc: DevCost, bound: float | None) -> float:
        """Value of a stage covering [cuts[ai], L) as the last one."""
        last = self.nc - 1
        comp = self.comp_row(dc)[last] - self.comp_row(dc)[ai]
        if bound is not None and comp > bound:
            return INF
        rs = self.resident_row(self.inflight(0))
        res = rs[last] - rs[ai]
        stg = 2 * self.cut[ai]
        if self.ckpt[last] - self.ckpt[ai] > dc.cap_disk:
            return INF
        if dc.gpu:
            ok = res <= dc.cap_resident and stg <= dc.cap_staging
        else:
            ok = res + stg <= dc.cap_resident
        return comp if ok else INF


def device_classes(swarm: Swarm, pool: list[int]) -> list[list[int]]:
    """Groups of interchangeable devices (sorted by first index). With per-pair links, singletons."""
    if not swarm.uniform_links:
        return [[d] for d in pool]
    groups: dict[tuple, list[int]] = {}
    for d in pool:
        s = swarm.devices[d]
        groups.setdefault((s.kind, s.speed, s.mem_bandwidth, s.d_gpu, s.d_cpu, s.d_disk), []).append(d)
    return sorted(groups.values(), key=lambda g: g[0])


def class_dp_size(classes: list[list[int]], ncuts: int, max_stages: int) -> int:
    """Number of (count vector, cut) states class_dp would fill."""
    caps = [min(len(c), max_stages, ncuts - 1) for c in classes]
    return math.prod(c + 1 for c in caps) * ncuts * (1 if len(classes) == 1 else len(classes))


def class_dp(
    coster: SegmentCoster,
    swarm: Swarm,
    classes: list[list[int]],
    max_stages: int,
    bound: float | None = None,
    patience: int | None = None,
) -> dict[int, tuple[float, Segments]]:
    """DP over multisets of device classes (module docstring)."""
    nc = coster.nc
    last = nc - 1
    k = len(classes)
    uniform = swarm.uniform_links
    reps = [DevCost.of(c[0], swarm.devices[c[0]]) for c in classes]
    caps = [min(len(c), max_stages, nc - 1) for c in classes]
    vectors = [v for v in itertools.product(*(range(c + 1) for c in caps)) if 0 < sum(v) <= max_stages]
    vectors.sort(key=lambda v: (sum(v), v))
    vid = {v: i for i, v in enumerate(vectors)}
    # H[v][c][ai]: best value covering [cuts[ai], L) with the classes in v, the stage at cuts[ai] on c
    H = [[[INF] * nc for _ in range(k)] for _ in vectors]
    choice = [[[(-1, -1)] * nc for _ in range(k)] for _ in vectors]
    best_rest = [[INF] * nc for _ in vectors]  # min over c of H[v][c][ai] (uniform links)
    links = {
        (c, c2): coster.link_params(swarm, reps[c].index, reps[c2].index)
        for c in range(k)
        for c2 in ((c,) if uniform else range(k))
    }
    prune = bound is None and patience is not None
    ub = best_full = INF
    best_t, t_prev = 0, 0
    for v in vectors:
        iv, t = vid[v], sum(v)
        if t != t_prev:
            if patience is not None and best_t and t > best_t + patience:
                break
            t_prev = t
        r = t - 1
        fl = coster.inflight(r)
        rest = None
        for c in range(k):
            if v[c] == 0:
                continue
            dc = reps[c]
            if t == 1:
                for ai in range(last):
                    val = coster.last_stage(ai, dc, bound)
                    if val < INF:
                        H[iv][c][ai], choice[iv][c][ai] = val, (last, -1)
                continue
            rest = list(v)
            rest[c] -= 1
            irest = vid[tuple(rest)]
            for ai in range(last - r - 1, -1, -1):
                if uniform:
                    val, bi = coster.scan(ai, last - r, dc, fl, links[(c, c)], best_rest[irest], bound, ub)
                    arg = (bi, -1)
                else:
                    val, arg = ub, (-1, -1)
                    for c2 in range(k):
                        if rest[c2]:
                            got, bi = coster.scan(
                                ai, last - r, dc, fl, links[(c, c2)], H[irest][c2], bound, val
                            )
                            if bi >= 0:
                                val, arg = got, (bi, c2)
                if arg[0] >= 0:
                    H[iv][c][ai], choice[iv][c][ai] = val, arg
        row = best_rest[iv]
        for ai in range(nc):
            row[ai] = min(H[iv][c][ai] for c in range(k))
        if row[0] < best_full:
            best_full, best_t = row[0], t
            if prune:
                ub = best_full
    return _best_per_stage_count(vectors, vid, H, choice, classes, coster.lm.cuts, uniform)


def _best_per_stage_count(
    vectors, vid, H, choice, classes, cuts, uniform
) -> dict[int, tuple[float, Segments]]:
    """class_dp's table read out: for each number of stages, the best value and its segments."""
    out: dict[int, tuple[float, Segments]] = {}
    for v in vectors:
        iv, t = vid[v], sum(v)
        c0 = min(range(len(classes)), key=lambda c: (H[iv][c][0], c))
        val = H[iv][c0][0]
        if val < INF and (t not in out or val < out[t][0]):
            out[t] = (val, _rebuild_class(v, c0, vid, H, choice, classes, cuts, uniform))
    return out


def _rebuild_class(v, c0, vid, H, choice, classes, cuts, uniform) -> Segments:
    used = [0] * len(classes)
    segs: Segments = []
    v, ai, c = list(v), 0, c0
    while True:
        bi, c2 = choice[vid[tuple(v)]][c][ai]
        segs.append((cuts[ai], cuts[bi], classes[c][used[c]]))
        used[c] += 1
        v[c] -= 1
        if sum(v) == 0:
            return segs
        if uniform:
            iv = vid[tuple(v)]
            c2 = min((cc for cc in range(len(classes)) if v[cc] > 0), key=lambda cc: (H[iv][cc][bi], cc))
        ai, c = bi, c2


def prefix_dp(
    coster: SegmentCoster,
    swarm: Swarm,
    seq: list[int],
    max_stages: int,
    bound: float | None = None,
    patience: int | None = None,
) -> dict[int, tuple[float, Segments]]:
    """DP over a fixed device sequence (module docstring)."""
    cuts = coster.lm.cuts
    nc = coster.nc
    last = nc - 1
    R = min(len(seq), max_stages, nc - 1)
    dcs = [DevCost.of(d, swarm.devices[d]) for d in seq[:R]]
    V = [[INF] * nc for _ in range(R)]  # V[r][ai]: stage at cuts[ai] on seq[r], r stages after it
    arg = [[-1] * nc for _ in range(R)]
    for ai in range(last):
        V[0][ai] = coster.last_stage(ai, dcs[0], bound)
        arg[0][ai] = last
    prune = bound is None and patience is not None
    best_full, best_r = V[0][0], 0
    ub = best_full if prune else INF
    for r in range(1, R):
        if patience is not None and best_full < INF and r > best_r + patience:
            break
        dc, fl = dcs[r], coster.inflight(r)
        lp = coster.link_params(swarm, dc.index, dcs[r - 1].index)
        tail, row, args = V[r - 1], V[r], arg[r]
        for ai in range(last - r - 1, -1, -1):
            val, bi = coster.scan(ai, last - r, dc, fl, lp, tail, bound, ub)
            if bi >= 0:
                row[ai], args[ai] = val, bi
        if row[0] < best_full:
            best_full, best_r = row[0], r
            if prune:
                ub = best_full
    out: dict[int, tuple[float, Segments]] = {}
    for r in range(R):
        if V[r][0] < INF:
            segs: Segments = []
            ai = 0
            for rr in range(r, -1, -1):
                bi = arg[rr][ai]
                segs.append((cuts[ai], cuts[bi], seq[rr]))
                ai = bi
            out[r + 1] = (V[r][0], segs)
    return out
