"""The schedules FusionNet provides, as generators ``(stages p, micro-batches m) -> Schedule``.

- ``gpipe``: every stage runs F0 .. F(m-1), then B(m-1) .. B0, then U. m micro-batches of
  activations live at once on every stage.
- ``1f1b`` (PipeDream-flush): stage s warms up with ``min(p-s-1, m)`` forwards, then alternates one
  forward and one backward, then drains the remaining backwards: at most ``p-s`` micro-batches live.
- ``zero-bubble`` (ZB-H1, Qi et al. 2023): the backward is split into I (input gradients, on the
  critical path of the earlier stages) and W (weight gradients, which nobody waits for). Each stage
  holds at most p micro-batches between F and W (1F1B's peak, on stage 0) and, where it would otherwise
  wait, runs a pending W: the gradient wave travels back at I's speed and the Ws fill the bubbles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fusionnet.schedules.actions import Action, Schedule
from fusionnet.schedules.check import ScheduleError

# The names a job file may give (``placement.schedule``; ``auto`` is resolved by the planner).
NAMES = ("gpipe", "1f1b", "zero-bubble")
UPDATE = Action("U")


def _sizes(p: int, m: int) -> None:
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ScheduleError(f"a schedule needs p >= 1 stages and m >= 1 micro-batches, got p={p!r} m={m!r}")


def gpipe(p: int, m: int) -> Schedule:
    _sizes(p, m)
    prog = [Action("F", k) for k in range(m)] + [Action("B", k) for k in reversed(range(m))] + [UPDATE]
    return Schedule("gpipe", m, tuple(tuple(prog) for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    _sizes(p, m)
    progs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        prog = [Action("F", k) for k in range(warm)]
        for i in range(m - warm):
            prog += [Action("F", warm + i), Action("B", i)]
        prog += [Action("B", k) for k in range(m - warm, m)]
        progs.append(tuple([*prog, UPDATE]))
    return Schedule("1f1b", m, tuple(progs))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up, then F, I pairs; stage s defers its first ``s`` Ws (the later stages'
    warm-up bubble is where they would have waited for gradients), so every stage holds at most p
    micro-batches between F and W, 1F1B's peak, while the gradient wave runs back at I's speed. With
    unit F, I, W the step takes ``3m + p - 1`` units against 1F1B's ``3(m + p - 1)``."""
    _sizes(p, m)
    progs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        prog = [Action("F", k) for k in range(warm)]
        pending: deque[int] = deque()
        for j in range(m - warm):
            prog += [Action("F", warm + j), Action("I", j)]
            pending.append(j)
            if j >= s:
                prog.append(Action("W", pending.popleft()))
        for j in range(m - warm, m):
            prog.append(Action("I", j))
            pending.append(j)
            prog.append(Action("W", pending.popleft()))
        prog += [Action("W", k) for k in pending]
        progs.append(tuple([*prog, UPDATE]))
    return Schedule("zero-bubble", m, tuple(progs))


_GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero-bubble": zero_bubble_h1,
}


def make_schedule(name: str, stages: int, microbatches: int, task: str = "train") -> Schedule:
    """The schedule ``name`` for ``stages`` x ``microbatches``, cut down to what ``task`` runs."""
    if name not in _GENERATORS:
        raise ScheduleError(f"schedule {name!r} must be one of {', '.join(NAMES)}")
    return _GENERATORS[name](stages, microbatches).for_task(task)
