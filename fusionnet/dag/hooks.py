"""Executor hooks: code that runs before and after every FP, BP and Update of a ``SubDagExecutor``.

Fault injection (``fusionnet.compnode.faults``), the ``--slowdown`` throttle
(``fusionnet.compnode.throttle``) and the executor's own phase timing are hooks, so nothing replaces an
executor's methods. A hook sees each *compute stretch*: the FP of one micro-batch, the BP of one
micro-batch, or the Update, without the waits for peers' data around it (those happen on the event
loop, between stretches).

Where hooks run: ``before``/``after`` run on the thread that computes (the compnode's compute thread,
or the caller's thread when the executor computes inline, as ``run --local`` does), right around the
torch work, so a hook may block (a throttle sleeps there) without stalling the event loop.
``step_started``/``step_finished`` run on the event loop at the ends of ``run_step``.

Order: ``before`` in the order hooks were added, ``after`` in reverse (hooks nest like context
managers); ``after`` runs even when the stretch raised. The timer is always innermost, so the times
a step reports are the torch work alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Phase = Literal["fp", "bp", "update"]
PHASES: tuple[Phase, ...] = ("fp", "bp", "update")
T = TypeVar("T")


@dataclass
class StepReport:
    """What one sub-DAG did in one step (what ``step_finished`` hooks see). Torch-free: the compnode
    validates its flags before torch loads."""

    step: int
    loss: float | None = None  # full-batch loss (only on the sub-DAG holding the loss)
    outputs: list[Any] = field(default_factory=list)  # infer: output value per micro-batch
    fp_seconds: float = 0.0
    bp_seconds: float = 0.0
    update_seconds: float = 0.0
    activation_peak_bytes: int = 0  # train/grad: the most activation bytes held at once in the step
    sent_bytes: int = 0  # tensor bytes sent to other sub-DAGs in the step, as on the wire (a compnode's)


class ExecutorHook:
    """Base class: override the callbacks you need; the defaults do nothing. ``mb`` is the micro-batch
    (0 for the Update)."""

    def before(self, phase: Phase, step: int, mb: int) -> None:
        """A compute stretch is about to run (compute thread)."""

    def after(self, phase: Phase, step: int, mb: int, failed: bool) -> None:
        """The compute stretch ended, ``failed`` when it raised (compute thread)."""

    def step_started(self, step: int) -> None:
        """``run_step`` begins (event loop)."""

    def step_finished(self, step: int, report: StepReport) -> None:
        """``run_step`` succeeded; the hook may adjust ``report`` (event loop)."""


class PhaseTimer(ExecutorHook):
    """Wall seconds of the compute stretches per phase since the last ``step_started``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[Phase, float] = dict.fromkeys(PHASES, 0.0)
        self._mark = 0.0

    def before(self, phase: Phase, step: int, mb: int) -> None:
        self._mark = self.clock()

    def after(self, phase: Phase, step: int, mb: int, failed: bool) -> None:
        self.seconds[phase] += self.clock() - self._mark

    def step_started(self, step: int) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)


class HookChain:
    """The hooks of one executor, with the timer innermost."""

    def __init__(self, hooks: Iterable[ExecutorHook] = (), timer: PhaseTimer | None = None) -> None:
        self.hooks: list[ExecutorHook] = list(hooks)
        self.timer = timer if timer is not None else PhaseTimer()

    def add(self, hook: ExecutorHook) -> None:
        """Adds ``hook`` inside the ones already there (but outside the timer)."""
        self.hooks.append(hook)

    def run(self, phase: Phase, step: int, mb: int, work: Callable[[], T]) -> T:
        """Runs ``work`` between the hooks' ``before`` and ``after`` calls."""
        entered: list[ExecutorHook] = []
        failed = True
        try:
            for hook in (*self.hooks, self.timer):
                hook.before(phase, step, mb)
                entered.append(hook)
            result = work()
            failed = False
            return result
        finally:
            for hook in reversed(entered):
                hook.after(phase, step, mb, failed)

    def step_started(self, step: int) -> None:
        for hook in (*self.hooks, self.timer):
            hook.step_started(step)

    def step_finished(self, step: int, report: StepReport) -> None:
        for hook in reversed((*self.hooks, self.timer)):
            hook.step_finished(step, report)
