"""An emulated slow device (``fusionnet compnode --slowdown F``): heterogeneous swarms on one machine.

Scheduling experiments need compnodes of different speeds, and on one machine (a laptop, a CI runner,
two shared cores) every compnode is the same CPU. Limiting threads is not enough (with fewer cores than
threads it only changes who waits for the scheduler), so a slowed compnode instead *sleeps* after its
own work: every stretch of compute in FP, BP or Update is followed by a pause of (F-1) times its length,
so that it appears to take F times as long. Sleeping costs no CPU, so the other compnodes keep theirs
and the emulation stays faithful even on an oversubscribed machine.

What is charged: the CPU time (of the event-loop thread, where the executor runs) the executor spends
*running* in ``forward``/``backward``/``update`` (not wall time: time the host's scheduler gives to
other processes is contention on this machine, not slowness of the emulated device, and should not be
multiplied by F-1), minus the time it waits in its channel (activations or gradients from peers that
are not here yet, and sending, which is the network's business, not the device's). The debt is paid,
asynchronously, at the next await point: before any message leaves (so a peer receives an activation
when a slow device would have produced it), at the end of an FP or BP call, and at the end of the step
for the Update (which runs on the event loop; ``time.sleep`` there would stall the node's heartbeats
and data path). The step's reported FP/BP/Update seconds are multiplied by F, as the slow device would
measure them.

The announced profile says the same (``slowed_hardware``): λp and the memory bandwidth divided by F, the
fixed per-op overheads multiplied by F, so that the broker's performance model sees the device it gets.
Not emulated: memory and network speeds of the data path, and two jobs on one slowed node do not slow
each other down more than two jobs on a normal node would (each job's executor pays its own debt).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.dht.records import HardwareInfo

if TYPE_CHECKING:  # torch-free at import: the compnode daemon validates --slowdown before torch loads
    from fusionnet.dag.executor import StepReport, SubDagExecutor

MIN_SLEEP = 1e-4  # smaller debts wait for the next pay: a sleep costs an event-loop turn

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]


def check_slowdown(factor: float) -> float:
    """``factor`` as a float when it is a usable slow-down (finite, >= 1), else ``ValueError``."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"--slowdown must be a number >= 1, got {factor!r}") from None
    if not math.isfinite(value) or value < 1.0:
        raise ValueError(f"--slowdown must be a finite number >= 1 (1 = full speed), got {factor!r}")
    return value


class Throttle:
    """The compute debt of one executor: ``charge`` adds (F-1) x seconds of compute, ``pay`` sleeps it off.

    ``clock`` and ``sleep`` are injectable so that tests run on a fake clock instead of real time."""

    def __init__(
        self,
        factor: float,
        *,
        clock: Clock = time.perf_counter,
        sleep: Sleep = asyncio.sleep,
        work_clock: Clock | None = None,
    ):
        self.factor = check_slowdown(factor)
        self.clock = clock  # wall time: what a sleep lasted
        self.work_clock = work_clock or clock  # what a compute stretch cost the device
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
        """The compute stretch ends now (a wait begins, or the call returns): charge it."""
        if self._mark is not None:
            self.charge(self.work_clock() - self._mark)
            self._mark = None

    async def pay(self) -> None:
        """Sleeps off the debt (the event loop stays free). A sleep that ran long (timer granularity, or
        the loop busy with other callbacks when it was due) is credited against the next debt:
        uncorrected, some 20 sleeps a step overshot by ~2 ms each on a busy 2-core machine, which made
        a 4x-slowed stage 15% slower still."""
        if self.debt < MIN_SLEEP:
            return  # a crumb (or a credit): carried to the next pay
        debt, started = self.debt, self.clock()
        await self.sleep(debt)
        slept = self.clock() - started
        self.slept += slept
        self.debt = debt - slept  # <= 0 after an overshoot: a credit

    async def settle(self) -> None:
        """At an await point: end the current compute stretch and pay for it; the wait is not charged."""
        self.stop()
        await self.pay()


class ThrottledChannel(Channel):
    """The executor's channel, with the debt paid before every wait and the waits left uncharged."""

    def __init__(self, inner: Channel, throttle: Throttle) -> None:
        self.inner = inner
        self.throttle = throttle

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        running = self.throttle.running
        await self.throttle.settle()
        try:
            await self.inner.send(dst, key, value)
        finally:
            if running:
                self.throttle.start()

    async def recv(self, src: int, key: MessageKey) -> Any:
        running = self.throttle.running
        await self.throttle.settle()
        try:
            return await self.inner.recv(src, key)
        finally:
            if running:
                self.throttle.start()

    def __getattr__(self, name: str) -> Any:  # mailbox, refused, ... of the wrapped channel
        return getattr(self.inner, name)


def throttle(
    executor: SubDagExecutor,
    factor: float,
    *,
    clock: Clock = time.perf_counter,
    sleep: Sleep = asyncio.sleep,
    work_clock: Clock | None = None,
) -> Throttle | None:
    """Makes ``executor`` emulate a device ``factor`` times slower (see the module docstring); returns the
    ``Throttle`` (for its counters), or None when ``factor`` is 1 and nothing is wrapped. Compute is
    charged by ``work_clock``: the thread's CPU time on the real clock, ``clock`` itself on a fake one."""
    factor = check_slowdown(factor)
    if factor == 1.0:
        return None
    if work_clock is None:
        work_clock = time.thread_time if clock is time.perf_counter else clock
    debt = Throttle(factor, clock=clock, sleep=sleep, work_clock=work_clock)
    executor.channel = ThrottledChannel(executor.channel, debt)
    forward, backward, update = executor.forward, executor.backward, executor.update
    run_step = executor.run_step

    async def fp(step: int, mb: int, data: Any) -> Any:
        debt.start()
        try:
            return await forward(step, mb, data)
        finally:
            await debt.settle()

    async def bp(step: int, mb: int, loss_weight: float) -> None:
        debt.start()
        try:
            await backward(step, mb, loss_weight)
        finally:
            await debt.settle()

    def up() -> None:
        # Runs on the event loop inside run_step: charge now, sleep when run_step next yields (below).
        debt.start()
        try:
            update()
        finally:
            debt.stop()

    async def whole_step(
        step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        debt.debt = 0.0  # nothing owed (or credited) from an earlier step, or one that was cut short
        try:
            report = await run_step(step, microbatches, sizes)
        finally:
            await debt.pay()  # the Update's debt
        report.fp_seconds *= factor
        report.bp_seconds *= factor
        report.update_seconds *= factor
        return report

    executor.forward, executor.backward, executor.update = fp, bp, up  # type: ignore[method-assign]
    executor.run_step = whole_step  # type: ignore[method-assign]
    return debt


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
