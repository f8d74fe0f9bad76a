"""The schedules FusionNet provides, as generators ``(stages p, micro-batches m) -> Schedule``.

- ``gpipe``: every stage runs F0 .. F(m-1), then B(m-1) .. B0, then U. m micro-batches of
  activations live at once on every stage.
- ``1f1b`` (PipeDream-flush): stage s warms up with ``min(p-s-1, m)`` forwards, then alternates one
  forward and one backward, then drains the remaining backwards: at most ``p-s`` micro-batches live.
- ``zero-bubble`` (ZB-H1, Qi et al. 2023): the backward is split into I (input gradients, on the
  critical path of the earlier stages) and W (weight gradients, which nobody waits for). Each stage
  holds at most p micro-batches between F and W (1F1B's peak, on stage 0) and, where it would otherwise
  wait, runs a pending W: the gradient wave travels back at I's speed and the Ws fill the bubbles.
- ``interleaved-1f1b`` (Narayanan et al. 2021, Megatron-LM's order): each of p devices holds v chunks
  (sub-DAGs d, p + d, ...), so the model is cut into p v stages that loop over the devices. Forwards go
  in groups of p micro-batches, chunk 0 first; backwards in the same groups, last chunk first. Device d
  warms up with ``2 (p - d - 1) + (v - 1) p`` forwards, then alternates, then drains. The bubble shrinks
  to about 1/v of 1F1B's, for v times the messages and somewhat more live activations. Training needs
  m to be a multiple of p (as in Megatron-LM and torch's first version of it): with a short last group
  the order deadlocks for some (p, m, v). Forwards alone run any m (the last group is shorter): an
  ``infer`` job's last batch may hold fewer micro-batches than the others.
"""

from __future__ import annotations

import functools
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
    unit F, I, W the step takes ``3m + p - 1`` units against 1F1B's ``3(m + p - 1)``, or ``3m + 2p - 2``
    with 1F1B's BPs sending their input gradients after their I half, as the executor runs them
    (``dag.schedule_loop.run_device_step``)."""
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


def interleaved_1f1b(p: int, m: int, v: int = 2, *, forwards_only: bool = False) -> Schedule:
    """Interleaved 1F1B on p devices of v chunks each (p v stages; device d's chunk c is stage c p + d);
    ``forwards_only`` (what an ``infer`` job runs of it): any m, not only multiples of p."""
    _sizes(p, m)
    if not isinstance(v, int) or v < 2:
        raise ScheduleError(f"interleaved-1f1b needs v >= 2 chunks per device, got {v!r}")
    if m % p and not forwards_only:
        raise ScheduleError(
            f"interleaved-1f1b needs the micro-batches ({m}) to be a multiple of the devices ({p})"
        )
    total = m * v

    def order(backward: bool) -> list[tuple[int, int]]:  # (chunk, micro-batch) in the device's order
        seq = []
        for g in range(0, m, p):
            for c in reversed(range(v)) if backward else range(v):
                seq += [(c, k) for k in range(g, min(g + p, m))]
        return seq

    fwd = [Action("F", k, c) for c, k in order(False)]
    bwd = [Action("B", k, c) for c, k in order(True)]
    progs = []
    for d in range(p):
        warm = min(2 * (p - d - 1) + (v - 1) * p, total)
        prog = fwd[:warm]
        for i in range(total - warm):
            prog += [fwd[warm + i], bwd[i]]
        prog += bwd[total - warm :]
        progs.append(tuple([*prog, UPDATE]))
    return Schedule("interleaved-1f1b", m, tuple(progs), v)


_GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zero-bubble": zero_bubble_h1,
}
INTERLEAVED = "interleaved-1f1b"


@functools.lru_cache(maxsize=64)
def make_schedule(
    name: str, stages: int, microbatches: int, task: str = "train", chunks: int = 1
) -> Schedule:
    """The schedule ``name`` for ``stages`` sub-DAGs x ``microbatches``, cut down to what ``task`` runs;
    ``chunks``: sub-DAGs per device (interleaved-1f1b only: ``stages`` / ``chunks`` devices).

    Kept for the next call with the same arguments (a schedule is immutable): every executor asks for
    its program every step, and the broker's simulator of a step's compute path once per stage, and
    64 stages x 512 micro-batches are 65 536 actions to build each time."""
    if name == INTERLEAVED:
        if not isinstance(chunks, int) or chunks < 2 or stages % chunks:
            raise ScheduleError(
                f"interleaved-1f1b runs {chunks!r} chunks per device: it needs >= 2, dividing the "
                f"{stages} sub-DAGs"
            )
        forwards_only = task == "infer"
        return interleaved_1f1b(stages // chunks, microbatches, chunks, forwards_only=forwards_only).for_task(
            task
        )
    if name not in _GENERATORS:
        raise ScheduleError(f"schedule {name!r} must be one of {', '.join((*NAMES, INTERLEAVED))}")
    if chunks != 1:
        raise ScheduleError(f"schedule {name!r} runs one sub-DAG per device, not {chunks}")
    return _GENERATORS[name](stages, microbatches).for_task(task)
