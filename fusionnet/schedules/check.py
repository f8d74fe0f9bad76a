"""Validation of a schedule against the stage graph it runs on: well-formed programs, and no deadlock.

The runtime's rules (``fusionnet.dag.executor``): a stage's F of micro-batch k waits for k's
activations from every producer stage, its B or I of k waits for k's gradients from every consumer
stage, W and U wait for nothing outside the stage; sends never wait (messages are buffered in the
receiver's mailbox). ``check`` runs the programs under exactly these rules on the real edge set of the
cut (skip edges included) and refuses a schedule that would stop with a clear message naming what
every stuck stage waits for. Fewer edges only remove waits, so a schedule that passes on a superset
of the edges passes on the real ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionnet.schedules.actions import Action, Schedule

Edge = tuple[int, int]  # (producer stage, consumer stage): activations go this way, gradients back


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot run on the given stage graph."""


def chain_edges(stages: int) -> list[Edge]:
    """A plain pipeline: each stage feeds the next."""
    return [(s, s + 1) for s in range(stages - 1)]


@dataclass(frozen=True)
class CheckResult:
    order: tuple[tuple[int, Action], ...]  # one order in which the actions can all run
    peak_inflight: tuple[int, ...]  # micro-batches whose activations a stage held at once
    # per device, the most (chunk, micro-batch) activations it held at once over all its chunks
    device_peak: tuple[int, ...] = ()


def _check_program(s: int, prog: Sequence[Action], m: int, backward: bool, update: bool) -> None:
    where = f"stage {s}"
    bad = sorted({a.mb for a in prog if a.kind != "U" and not 0 <= a.mb < m})
    if bad:
        raise ScheduleError(f"{where}: micro-batches {bad} outside 0..{m - 1}")
    count = Counter((a.kind, a.mb) for a in prog)
    pos = {(a.kind, a.mb): i for i, a in enumerate(prog)}
    for k in range(m):
        if count[("F", k)] != 1:
            raise ScheduleError(f"{where}: micro-batch {k} needs exactly one F, has {count[('F', k)]}")
        b, i, w = count[("B", k)], count[("I", k)], count[("W", k)]
        if not backward:
            if b or i or w:
                raise ScheduleError(f"{where}: backward of micro-batch {k} in a forward-only schedule")
            continue
        if not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
            raise ScheduleError(
                f"{where}: micro-batch {k} needs one B, or one I and one W (has B{b} I{i} W{w})"
            )
        first = pos[("B", k)] if b else pos[("I", k)]
        if first < pos[("F", k)]:
            raise ScheduleError(f"{where}: backward of micro-batch {k} before its forward")
        if i and pos[("W", k)] < pos[("I", k)]:
            raise ScheduleError(f"{where}: W{k} before I{k}")
    updates = [i for i, a in enumerate(prog) if a.kind == "U"]
    if update and updates != [len(prog) - 1]:
        raise ScheduleError(f"{where}: a training schedule ends with exactly one update U")
    if not update and updates:
        raise ScheduleError(f"{where}: U in a schedule that does not update")


def _check_form(schedule: Schedule) -> None:
    progs, m = schedule.programs, schedule.microbatches
    if m < 1 or not progs:
        raise ScheduleError(f"schedule {schedule.name!r} needs at least one stage and one micro-batch")
    backward = any(a.kind in ("B", "I") for prog in progs for a in prog)
    update = any(a.kind == "U" for prog in progs for a in prog)
    for d, prog in enumerate(progs):
        if update and [i for i, a in enumerate(prog) if a.kind == "U"] != [len(prog) - 1]:
            raise ScheduleError(f"device {d}: a training schedule ends with exactly one update U")
    for s in range(schedule.stages):
        _check_program(s, schedule.program(s), m, backward, update)


def _ready(
    a: Action, s: int, preds: list[list[int]], succs: list[list[int]], fwd: list[set], grad: list[set]
) -> bool:
    if a.kind == "F":
        return all(a.mb in fwd[src] for src in preds[s])
    if a.kind in ("B", "I"):
        return all(a.mb in grad[dst] for dst in succs[s])
    return True


def _stuck(schedule: Schedule, pos: list[int], preds: list[list[int]], succs: list[list[int]]) -> str:
    waits = []
    for d, prog in enumerate(schedule.programs):
        if pos[d] < len(prog):
            a = prog[pos[d]]
            s = schedule.stage_of(d, a)
            peers = preds[s] if a.kind == "F" else succs[s]
            what = "activations" if a.kind == "F" else "gradients"
            where = f"stage {s}" if schedule.chunks == 1 else f"device {d} (stage {s})"
            waits.append(f"{where} waits at {a} for {what} from stage(s) {peers}")
    return "; ".join(waits)


def check(schedule: Schedule, edges: Iterable[Edge] | None = None) -> CheckResult:
    """Validates ``schedule`` on the stage graph ``edges`` (default: a chain) and returns one feasible
    execution order and the peak in-flight micro-batches per stage; raises ``ScheduleError``."""
    _check_form(schedule)
    n = schedule.stages
    edge_set = set(chain_edges(n) if edges is None else edges)
    for src, dst in edge_set:
        if not (0 <= src < n and 0 <= dst < n) or src == dst:
            raise ScheduleError(f"edge {src} -> {dst} is not between two of the stages 0..{n - 1}")
    preds = [sorted(src for src, dst in edge_set if dst == s) for s in range(n)]
    succs = [sorted(dst for src, dst in edge_set if src == s) for s in range(n)]
    progs = schedule.programs  # one per device: a device runs its actions in order, whatever chunk
    fwd: list[set[int]] = [set() for _ in range(n)]
    grad: list[set[int]] = [set() for _ in range(n)]
    held, peak = [0] * n, [0] * n
    pos = [0] * len(progs)
    device_peak = [0] * len(progs)
    backward = schedule.splits_backward() or any(a.kind == "B" for p in progs for a in p)
    order: list[tuple[int, Action]] = []
    while any(pos[d] < len(progs[d]) for d in range(len(progs))):
        progressed = False
        for d, prog in enumerate(progs):
            while pos[d] < len(prog):
                a = prog[pos[d]]
                s = schedule.stage_of(d, a)
                if not _ready(a, s, preds, succs, fwd, grad):
                    break
                pos[d] += 1
                progressed = True
                order.append((s, a))
                if a.kind == "F":
                    fwd[s].add(a.mb)
                    held[s] += 1 if backward else 0
                    peak[s] = max(peak[s], held[s] if backward else 1)
                elif a.kind in ("B", "I"):
                    grad[s].add(a.mb)
                if a.kind in ("B", "W"):
                    held[s] -= 1
                on_device = sum(held[c * len(progs) + d] for c in range(schedule.chunks))
                device_peak[d] = max(device_peak[d], on_device if backward else 1)
        if not progressed:
            raise ScheduleError(
                f"schedule {schedule.name!r} deadlocks on edges {sorted(edge_set)}: "
                + _stuck(schedule, pos, preds, succs)
            )
    return CheckResult(tuple(order), tuple(peak), tuple(device_peak))
