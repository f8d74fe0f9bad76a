"""``--slowdown``: the throttled executor (on a fake clock, so timing is exact and the tests take no time),
the slowed hardware profile, and the configuration checks."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from fusionnet.compnode.daemon import CompnodeConfig
from fusionnet.compnode.throttle import Throttle, check_slowdown, slowed_hardware, throttle
from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.dag.executor import StepReport
from fusionnet.dht.records import HardwareInfo
from fusionnet.perfmodel.types import ClassCost, Overheads


class FakeClock:
    """Time that moves only when told: compute ``advance``s it, sleeping advances it by what was slept."""

    def __init__(self, overshoot: float = 0.0) -> None:
        self.now = 0.0
        self.overshoot = overshoot  # every sleep lasts this much longer than asked, as a busy loop's do
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.overshoot
        await asyncio.sleep(0)  # a real await point, as asyncio.sleep is


class FakeChannel(Channel):
    """Waits ``wait`` seconds of fake time in every recv and send; logs when each message left."""

    def __init__(self, clock: FakeClock, wait: float) -> None:
        self.clock, self.wait = clock, wait
        self.sent_at: list[tuple[MessageKey, float]] = []
        self.mailbox = "the wrapped channel's attribute"

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        self.sent_at.append((key, self.clock.now))
        self.clock.advance(self.wait)

    async def recv(self, src: int, key: MessageKey) -> Any:
        self.clock.advance(self.wait)
        return 1.0


class FakeExecutor:
    """Shaped like ``SubDagExecutor``: run_step calls self.forward/backward/update; FP receives, computes
    ``fp`` seconds and sends; BP computes ``bp`` seconds and sends; Update computes ``up`` seconds."""

    def __init__(self, clock: FakeClock, *, fp: float, bp: float, up: float, wait: float) -> None:
        self.clock, self.fp, self.bp, self.up = clock, fp, bp, up
        self.channel: Channel = FakeChannel(clock, wait)
        self.updates = 0

    async def forward(self, step: int, mb: int, data: Any) -> tuple[Any, ...]:
        x = await self.channel.recv(0, ("act", step, mb, "x"))
        self.clock.advance(self.fp)
        await self.channel.send(1, ("act", step, mb, "y"), x)
        return (x,)

    async def backward(self, step: int, mb: int, loss_weight: float) -> None:
        self.clock.advance(self.bp)
        await self.channel.send(0, ("grad", step, mb, "x"), loss_weight)

    def update(self) -> None:
        self.clock.advance(self.up)
        self.updates += 1

    async def run_step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        for mb, data in enumerate(microbatches):
            await self.forward(step, mb, data)
        for mb in reversed(range(len(microbatches))):
            await self.backward(step, mb, 0.5)
        self.update()
        n = len(microbatches)
        return StepReport(step, fp_seconds=n * self.fp, bp_seconds=n * self.bp, update_seconds=self.up)


def _throttled(factor: float, **times: float) -> tuple[FakeClock, FakeExecutor, Throttle]:
    clock = FakeClock()
    executor = FakeExecutor(clock, **times)
    debt = throttle(executor, factor, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert debt is not None
    return clock, executor, debt


def test_factor_one_wraps_nothing() -> None:
    clock = FakeClock()
    executor = FakeExecutor(clock, fp=1, bp=1, up=1, wait=0)
    channel, forward = executor.channel, executor.forward
    assert throttle(executor, 1) is None  # type: ignore[arg-type]
    assert executor.channel is channel and executor.forward == forward


def test_forward_sleeps_for_its_compute_not_for_its_waits() -> None:
    clock, executor, debt = _throttled(3.0, fp=2.0, bp=0.0, up=0.0, wait=5.0)
    asyncio.run(executor.forward(0, 0, {}))
    # 5 s waiting for the input, 2 s compute, 5 s sending: only the compute is charged, (3-1) x 2 s.
    assert clock.sleeps == [pytest.approx(4.0)]
    assert debt.charged == pytest.approx(2.0) and debt.slept == pytest.approx(4.0)
    assert clock.now == pytest.approx(5 + 2 + 4 + 5)


def test_output_leaves_when_the_slow_device_would_have_produced_it() -> None:
    _, executor, _ = _throttled(4.0, fp=1.0, bp=0.0, up=0.0, wait=0.5)
    asyncio.run(executor.forward(0, 0, {}))
    (_key, sent_at), *_ = executor.channel.inner.sent_at  # type: ignore[attr-defined]
    assert sent_at == pytest.approx(0.5 + 4 * 1.0)  # input wait, then the compute at a quarter speed


def test_update_debt_is_paid_asynchronously_at_the_end_of_the_step() -> None:
    clock, executor, debt = _throttled(2.0, fp=0.0, bp=0.0, up=3.0, wait=0.0)
    executor.update()  # synchronous, on the event loop: it may not sleep
    assert clock.sleeps == [] and debt.debt == pytest.approx(3.0)
    asyncio.run(debt.pay())
    assert clock.sleeps == [pytest.approx(3.0)] and debt.debt == 0


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0, 4.0])
def test_a_step_takes_factor_times_its_compute_plus_the_waits(factor: float) -> None:
    fp, bp, up, wait, mbs = 0.3, 0.5, 0.2, 0.1, 4
    clock, executor, debt = _throttled(factor, fp=fp, bp=bp, up=up, wait=wait)
    report = asyncio.run(executor.run_step(0, [{}] * mbs, [8] * mbs))
    compute = mbs * (fp + bp) + up
    waits = mbs * 2 * wait + mbs * wait  # FP: a recv and a send each; BP: a send each
    assert clock.now == pytest.approx(factor * compute + waits)
    assert sum(clock.sleeps) == pytest.approx((factor - 1) * compute)
    assert all(s >= 0 for s in clock.sleeps) and debt.debt == pytest.approx(0, abs=1e-9)
    # The step reports the slow device's compute times.
    assert report.fp_seconds == pytest.approx(factor * mbs * fp)
    assert report.bp_seconds == pytest.approx(factor * mbs * bp)
    assert report.update_seconds == pytest.approx(factor * up)
    assert executor.updates == 1


def test_a_sleep_that_ran_long_is_credited_against_the_next_one() -> None:
    clock = FakeClock(overshoot=0.5)
    executor = FakeExecutor(clock, fp=1.0, bp=1.0, up=0.0, wait=0.0)
    debt = throttle(executor, 2.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert debt is not None
    asyncio.run(executor.run_step(0, [{}], [8]))
    # FP: 1 s compute, asked 1 s, slept 1.5 s; BP: 1 s compute owes 1 s less the 0.5 s credit.
    assert clock.sleeps == [pytest.approx(1.0), pytest.approx(0.5)]
    assert clock.now == pytest.approx(2 * 2.0 + 0.5)  # only the last sleep's overshoot remains


def test_the_wrapped_channel_passes_other_attributes_through() -> None:
    _, executor, _ = _throttled(2.0, fp=0, bp=0, up=0, wait=0)
    assert executor.channel.mailbox == "the wrapped channel's attribute"  # type: ignore[attr-defined]


def test_a_failed_call_still_pays_and_a_new_step_owes_nothing_old() -> None:
    clock = FakeClock()
    executor = FakeExecutor(clock, fp=1.0, bp=0.0, up=0.0, wait=0.0)

    async def broken(step: int, mb: int, loss_weight: float) -> None:
        clock.advance(0.5)
        raise RuntimeError("boom")

    executor.backward = broken  # type: ignore[method-assign]
    debt = throttle(executor, 2.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert debt is not None
    debt.charge(7.0)  # left over from a step that was cut short
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(executor.run_step(1, [{}], [8]))
    assert sum(clock.sleeps) == pytest.approx(1.0 + 0.5)  # FP's and the failed BP's; the old debt dropped
    assert debt.debt == 0 and not debt.running


def test_real_sleep_is_at_least_the_debt() -> None:
    """Real clocks and asyncio.sleep: 20 ms of CPU at F=3 sleeps >= 40 ms (compute is charged in the
    thread's CPU time, so the busy loop counts CPU time too: on a loaded machine its wall time is more)."""
    import time

    class Busy(FakeExecutor):
        async def forward(self, step: int, mb: int, data: Any) -> tuple[Any, ...]:
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass
            return ()

    executor = Busy(FakeClock(), fp=0, bp=0, up=0, wait=0)
    debt = throttle(executor, 3.0)  # type: ignore[arg-type]
    assert debt is not None
    started = time.perf_counter()
    asyncio.run(executor.forward(0, 0, {}))
    elapsed = time.perf_counter() - started
    assert debt.charged >= 0.02 and debt.slept >= 2 * debt.charged * 0.99
    assert elapsed >= 3 * 0.02 * 0.95


def _hardware(overheads: Overheads | None) -> HardwareInfo:
    return HardwareInfo(
        device_kind="cpu",
        device_name="test cpu",
        peak_flops=1e11,
        speed_factor=0.6,
        mem_bandwidth=1e10,
        threads=1,
        overheads=None if overheads is None else overheads.to_dict(),
    )


def test_slowed_hardware_announces_a_device_factor_times_slower() -> None:
    base = Overheads(
        elementwise=ClassCost(fp=1e-5, bp=2e-5, bp_input=3e-5), stage_fp=1e-4, update_kernel=2e-6
    )
    hw = _hardware(base)
    slow = slowed_hardware(hw, 4.0)
    assert slow.speed_factor == pytest.approx(0.15) and slow.flops == pytest.approx(hw.flops / 4)
    assert slow.mem_bandwidth == pytest.approx(2.5e9)
    assert slow.peak_flops == hw.peak_flops and slow.threads == 1
    got = Overheads.from_dict(slow.overheads or {})
    assert got.elementwise.fp == pytest.approx(4e-5) and got.elementwise.bp_input == pytest.approx(12e-5)
    assert got.stage_fp == pytest.approx(4e-4) and got.update_kernel == pytest.approx(8e-6)
    assert hw.speed_factor == 0.6  # the original (the cached profile) is untouched
    assert slowed_hardware(_hardware(None), 2.0).overheads is None
    assert slowed_hardware(hw, 1.0) is hw


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, math.nan, math.inf, "fast"])
def test_bad_slowdowns_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="--slowdown"):
        check_slowdown(bad)
    with pytest.raises(ValueError, match="--slowdown"):
        CompnodeConfig(slowdown=bad)


def test_config_takes_a_slowdown() -> None:
    assert CompnodeConfig().slowdown == 1.0
    assert CompnodeConfig(slowdown=2.5).slowdown == 2.5
    assert CompnodeConfig(slowdown=3).slowdown == 3.0  # type: ignore[arg-type]


def test_cli_flag_reaches_the_config() -> None:
    import argparse

    from fusionnet.cli import cmd_compnode

    parser = argparse.ArgumentParser()
    cmd_compnode.add_parser(parser.add_subparsers())
    args = parser.parse_args(["compnode", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--slowdown", "3"])
    assert args.slowdown == 3.0
    assert parser.parse_args(["compnode", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x"]).slowdown == 1.0
