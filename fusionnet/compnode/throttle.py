"""An emulated slow device (``fusionnet compnode --slowdown F``): heterogeneous swarms on one machine.

Scheduling experiments need compnodes of different speeds, and on one machine (a laptop, a CI runner,
two shared cores) every compnode is the same CPU. Limiting threads is not enough (with fewer cores than
threads it only changes who waits for the scheduler), so a slowed compnode instead *sleeps* after its
own work: every stretch of compute in FP, BP or Update is followed by a pause of (F-1) times its length,
so that it appears to take F times as long. Sleeping costs no CPU, so the other compnodes keep theirs
and the emulation stays faithful even on an oversubscribed machine.

How: ``Throttle`` is an executor hook (``fusionnet.dag.hooks``). Its ``before``/``after`` run on the
compute thread around each compute stretch (FP or BP of one micro-batch, the Update), never around the
waits for peers' data (those are on the event loop, between stretches). What is charged is the CPU time
of the compute thread during the stretch (not wall time: time the host's scheduler gives to other
processes is contention on this machine, not slowness of the emulated device, and should not be
multiplied by F-1). The debt is slept off at once, on the compute thread, before the stretch's outputs
are sent: a peer receives an activation when a slow device would have produced it, and the event loop
(heartbeats, RPCs, data path) never sleeps. The step's reported FP/BP/Update seconds are multiplied by
F, as the slow device would measure them.

The announced profile says the same (``slowed_hardware``): λp and the memory bandwidth divided by F, the
fixed per-op overheads multiplied by F, so that the broker's performance model sees the device it gets.
Not emulated: memory and network speeds of the data path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fusionnet.dag.hooks import ExecutorHook, Phase
from fusionnet.dht.records import HardwareInfo

if TYPE_CHECKING:  # torch-free at import: the compnode daemon validates --slowdown before torch loads
    from fusionnet.dag.hooks import StepReport

MIN_SLEEP = 1e-4  # smaller debts wait for the next pay: a sleep has a cost of its own

Clock = Callable[[], float]
Sleep = Callable[[float], Any]


def check_slowdown(factor: float) -> float:
    """``factor`` as a float when it is a usable slow-down (finite, >= 1), else ``ValueError``."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"--slowdown must be a number >= 1, got {factor!r}") from None
    if not math.isfinite(value) or value < 1.0:
        raise ValueError(f"--slowdown must be a finite number >= 1 (1 = full speed), got {factor!r}")
    return value


class Throttle(ExecutorHook):
    """The compute debt of one executor: ``charge`` adds (F-1) x seconds of compute, ``pay`` sleeps it off.

    ``clock``, ``work_clock`` and ``sleep`` are injectable so that tests run on a fake clock instead of
    real time. By default compute is charged in the calling thread's CPU time (``time.thread_time``):
    the hook's ``before`` and ``after`` run on the compute thread."""

    def __init__(
        self,
        factor: float,
        *,
        clock: Clock = time.perf_counter,
        sleep: Sleep = time.sleep,
        work_clock: Clock | None = None,
    ):
        self.factor = check_slowdown(factor)
        self.clock = clock  # wall time: what a sleep lasted
        if work_clock is None:
            work_clock = time.thread_time if clock is time.perf_counter else clock
        self.work_clock = work_clock  # what a compute stretch cost the device
        self.sleep = sleep
        self.debt = 0.0  # seconds still to sleep (negative: slept too long, a credit)
        self.charged = 0.0  # compute seconds charged so far (the device's own time)
        self.slept = 0.0  # seconds slept so far
        self._mark: float | None = None  # start of the compute stretch being measured, None when idle

    def charge(self, seconds: float) -> None:
        if seconds > 0:
            self.charged += seconds
            self.debt += (self.factor - 1.0) * seconds

    @property
    def running(self) -> bool:
        """Whether a compute stretch is being measured."""
        return self._mark is not None

    def start(self) -> None:
        """A compute stretch begins now."""
        self._mark = self.work_clock()

    def stop(self) -> None:
        """The compute stretch ends now: charge it."""
        if self._mark is not None:
            self.charge(self.work_clock() - self._mark)
            self._mark = None

    def pay(self) -> None:
        """Sleeps off the debt (on the compute thread). A sleep that ran long (timer granularity, a busy
        host) is credited against the next debt: uncorrected, some 20 sleeps a step overshot by ~2 ms
        each on a busy 2-core machine, which made a 4x-slowed stage 15% slower still."""
        if self.debt < MIN_SLEEP:
            return  # a crumb (or a credit): carried to the next pay
        debt, started = self.debt, self.clock()
        self.sleep(debt)
        slept = self.clock() - started
        self.slept += slept
        self.debt = debt - slept  # <= 0 after an overshoot: a credit

    # -- the hook ----------------------------------------------------------------------------------
    def before(self, phase: Phase, step: int, mb: int) -> None:
        self.start()

    def after(self, phase: Phase, step: int, mb: int, failed: bool) -> None:
        self.stop()
        self.pay()  # a failed stretch cost the device its time too

    def step_started(self, step: int) -> None:
        self.debt = 0.0  # nothing owed (or credited) from an earlier step, or one that was cut short
        self._mark = None

    def step_finished(self, step: int, report: StepReport) -> None:
        report.fp_seconds *= self.factor
        report.bp_seconds *= self.factor
        report.update_seconds *= self.factor


def throttle_hooks(factor: float, **clocks: Any) -> list[ExecutorHook]:
    """The hooks that make an executor emulate a device ``factor`` times slower (none at 1); ``clocks``
    go to ``Throttle`` (tests)."""
    factor = check_slowdown(factor)
    return [] if factor == 1.0 else [Throttle(factor, **clocks)]


def slowed_hardware(hw: HardwareInfo, factor: float) -> HardwareInfo:
    """The profile of a device ``factor`` times slower than ``hw``: what a ``--slowdown`` node announces.
    λp and the memory bandwidth divide by ``factor``; every fixed overhead multiplies by it (``scaled``
    takes a speed-up, hence 1/factor)."""
    from fusionnet.perfmodel.types import Overheads

    factor = check_slowdown(factor)
    if factor == 1.0:
        return hw
    update: dict[str, Any] = {
        "speed_factor": hw.speed_factor / factor,
        "mem_bandwidth": hw.mem_bandwidth / factor,
    }
    if hw.overheads is not None:
        update["overheads"] = Overheads.from_dict(hw.overheads).scaled(1.0 / factor).to_dict()
    return hw.model_copy(update=update)
