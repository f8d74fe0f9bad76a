"""``--slowdown``: the throttle hook (on a fake clock, so timing is exact and the tests take no time), a
real executor throttled on its compute thread, the slowed hardware profile, and the configuration checks."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fusionnet.compnode.daemon import CompnodeConfig
from fusionnet.compnode.throttle import Throttle, check_slowdown, slowed_hardware, throttle_hooks
from fusionnet.dag.hooks import HookChain, Phase, StepReport
from fusionnet.dht.records import HardwareInfo
from fusionnet.perfmodel.types import ClassCost, Overheads


class FakeClock:
    """Time that moves only when told: compute ``advance``s it, sleeping advances it by what was slept."""

    def __init__(self, overshoot: float = 0.0) -> None:
        self.now = 0.0
        self.overshoot = overshoot  # every sleep lasts this much longer than asked, as a busy host's do
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.overshoot


class FakeSteps:
    """Drives a hook chain the way ``SubDagExecutor.run_step`` does: per micro-batch a wait for the input
    (the event loop's, outside any stretch), FP compute, a send; BP compute and a send in reverse; one
    Update. Logs when each message left."""

    def __init__(self, clock: FakeClock, chain: HookChain, *, fp: float, bp: float, up: float, wait: float):
        self.clock, self.chain = clock, chain
        self.fp, self.bp, self.up, self.wait = fp, bp, up, wait
        self.sent_at: list[tuple[str, float]] = []

    def stretch(self, phase: Phase, step: int, mb: int, seconds: float) -> None:
        self.chain.run(phase, step, mb, lambda: self.clock.advance(seconds))

    def send(self, what: str) -> None:
        self.sent_at.append((what, self.clock.now))
        self.clock.advance(self.wait)

    def forward(self, step: int, mb: int) -> None:
        self.clock.advance(self.wait)  # the input arrives
        self.stretch("fp", step, mb, self.fp)
        self.send(f"act {mb}")

    def run_step(self, step: int, mbs: int, bp: Any = None) -> StepReport:
        self.chain.step_started(step)
        for mb in range(mbs):
            self.forward(step, mb)
        for mb in reversed(range(mbs)):
            if bp is None:
                self.stretch("bp", step, mb, self.bp)
            else:
                self.chain.run("bp", step, mb, bp)
            self.send(f"grad {mb}")
        self.stretch("update", step, 0, self.up)
        seconds = self.chain.timer.seconds
        report = StepReport(step, fp_seconds=seconds["fp"], bp_seconds=seconds["bp"])
        report.update_seconds = seconds["update"]
        self.chain.step_finished(step, report)
        return report


def _throttled(
    factor: float, overshoot: float = 0.0, **times: float
) -> tuple[FakeClock, FakeSteps, Throttle]:
    clock = FakeClock(overshoot)
    hooks = throttle_hooks(factor, clock=clock, sleep=clock.sleep)
    [debt] = hooks
    assert isinstance(debt, Throttle)
    chain = HookChain(hooks)
    chain.timer.clock = clock
    return clock, FakeSteps(clock, chain, **times), debt


def test_factor_one_adds_no_hook() -> None:
    assert throttle_hooks(1) == [] and throttle_hooks(1.0) == []


def test_forward_sleeps_for_its_compute_not_for_its_waits() -> None:
    clock, steps, debt = _throttled(3.0, fp=2.0, bp=0.0, up=0.0, wait=5.0)
    steps.forward(0, 0)
    # 5 s waiting for the input, 2 s compute, 5 s sending: only the compute is charged, (3-1) x 2 s.
    assert clock.sleeps == [pytest.approx(4.0)]
    assert debt.charged == pytest.approx(2.0) and debt.slept == pytest.approx(4.0)
    assert clock.now == pytest.approx(5 + 2 + 4 + 5)


def test_output_leaves_when_the_slow_device_would_have_produced_it() -> None:
    _, steps, _ = _throttled(4.0, fp=1.0, bp=0.0, up=0.0, wait=0.5)
    steps.forward(0, 0)
    (_what, sent_at), *_ = steps.sent_at
    assert sent_at == pytest.approx(0.5 + 4 * 1.0)  # input wait, then the compute at a quarter speed


def test_update_debt_is_slept_off_on_the_compute_thread() -> None:
    clock, steps, debt = _throttled(2.0, fp=0.0, bp=0.0, up=3.0, wait=0.0)
    steps.stretch("update", 0, 0, 3.0)
    assert clock.sleeps == [pytest.approx(3.0)] and debt.debt == 0


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0, 4.0])
def test_a_step_takes_factor_times_its_compute_plus_the_waits(factor: float) -> None:
    fp, bp, up, wait, mbs = 0.3, 0.5, 0.2, 0.1, 4
    clock, steps, debt = _throttled(factor, fp=fp, bp=bp, up=up, wait=wait)
    report = steps.run_step(0, mbs)
    compute = mbs * (fp + bp) + up
    waits = mbs * 2 * wait + mbs * wait  # FP: a recv and a send each; BP: a send each
    assert clock.now == pytest.approx(factor * compute + waits)
    assert sum(clock.sleeps) == pytest.approx((factor - 1) * compute)
    assert all(s >= 0 for s in clock.sleeps) and debt.debt == pytest.approx(0, abs=1e-9)
    # The step reports the slow device's compute times.
    assert report.fp_seconds == pytest.approx(factor * mbs * fp)
    assert report.bp_seconds == pytest.approx(factor * mbs * bp)
    assert report.update_seconds == pytest.approx(factor * up)


def test_a_sleep_that_ran_long_is_credited_against_the_next_one() -> None:
    clock, steps, _ = _throttled(2.0, overshoot=0.5, fp=1.0, bp=1.0, up=0.0, wait=0.0)
    steps.run_step(0, 1)
    # FP: 1 s compute, asked 1 s, slept 1.5 s; BP: 1 s compute owes 1 s less the 0.5 s credit.
    assert clock.sleeps == [pytest.approx(1.0), pytest.approx(0.5)]
    assert clock.now == pytest.approx(2 * 2.0 + 0.5)  # only the last sleep's overshoot remains


def test_a_failed_stretch_still_pays_and_a_new_step_owes_nothing_old() -> None:
    clock, steps, debt = _throttled(2.0, fp=1.0, bp=0.0, up=0.0, wait=0.0)

    def broken() -> None:
        clock.advance(0.5)
        raise RuntimeError("boom")

    debt.charge(7.0)  # left over from a step that was cut short
    with pytest.raises(RuntimeError, match="boom"):
        steps.run_step(1, 1, bp=broken)
    assert sum(clock.sleeps) == pytest.approx(1.0 + 0.5)  # FP's and the failed BP's; the old debt dropped
    assert debt.debt == 0 and not debt.running


def test_real_sleep_is_at_least_the_debt() -> None:
    """Real clocks: 20 ms of CPU at F=3 sleeps >= 40 ms (compute is charged in the thread's CPU time, so
    the busy loop counts CPU time too: on a loaded machine its wall time is more)."""
    import time

    def busy() -> None:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    [debt] = throttle_hooks(3.0)
    assert isinstance(debt, Throttle)
    started = time.perf_counter()
    HookChain([debt]).run("fp", 0, 0, busy)
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
