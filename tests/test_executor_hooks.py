"""Executor hooks and the compute thread: hooks run in order around every FP, BP and Update, on the thread
that computes; a compute thread gives the same bits as inline compute and leaves the event loop free; a
send that fails ends the step instead of hanging it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.dag.executor import SubDagExecutor
from fusionnet.dag.hooks import ExecutorHook, HookChain, Phase, StepReport
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dag.trace import trace_model
from fusionnet.errors import ExecutionError
from fusionnet.runtime.batches import iter_steps
from fusionnet.runtime.local import InMemorySwarm
from tests.dag_models import SkipEverywhere, make_data

pytestmark = pytest.mark.timeout(120)


class Recorder(ExecutorHook):
    """Logs every callback as (name, phase, step, mb, thread name)."""

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    def before(self, phase: Phase, step: int, mb: int) -> None:
        self.log.append((self.name, "before", phase, step, mb, threading.current_thread().name))

    def after(self, phase: Phase, step: int, mb: int, failed: bool) -> None:
        self.log.append((self.name, "after" + ("!" if failed else ""), phase, step, mb))

    def step_started(self, step: int) -> None:
        self.log.append((self.name, "started", step))

    def step_finished(self, step: int, report: StepReport) -> None:
        self.log.append((self.name, "finished", step))


def _swarm(
    pieces: int = 2, microbatches: int = 2, *, samples: int = 8, steps: int = 3, schedule: str = "gpipe"
) -> tuple[InMemorySwarm, list[Any]]:
    """A swarm of ``pieces`` in-process executors training SkipEverywhere, and its steps (one batch of
    all ``samples`` each)."""
    torch.manual_seed(0)
    x, y = make_data("skip", n=samples)
    traced = trace_model(SkipEverywhere(), x, y, F.cross_entropy, "train")
    partition = build_partition(traced.graph, balanced_assignment(traced.graph, pieces))

    def sgd(named: Any) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(list(named.values()), lr=0.1, momentum=0.9)]

    state = {k: v.clone() for k, v in traced.state.items()}
    swarm = InMemorySwarm.from_parts(traced.graph, state, partition, task="train", make_optimizers=sgd)
    for ex in swarm.executors:
        ex.schedule = schedule
    return swarm, list(iter_steps("train", x, y, samples, microbatches, steps))


def _train(swarm: InMemorySwarm, steps: list[Any]) -> list[list[StepReport]]:
    async def run() -> list[list[StepReport]]:
        return [await swarm.step(s) for s in steps]

    return asyncio.run(run())


def test_hooks_run_in_order_around_every_phase() -> None:
    swarm, steps = _swarm(pieces=2, microbatches=2)
    log: list[tuple[Any, ...]] = []
    ex = swarm.executors[0]
    ex.hooks.add(Recorder("outer", log))
    ex.hooks.add(Recorder("inner", log))
    _train(swarm, steps[:1])
    here = threading.current_thread().name
    stretches = [("fp", 0), ("fp", 1), ("bp", 1), ("bp", 0), ("update", 0)]
    want: list[tuple[Any, ...]] = [("outer", "started", 0), ("inner", "started", 0)]
    for phase, mb in stretches:
        want += [("outer", "before", phase, 0, mb, here), ("inner", "before", phase, 0, mb, here)]
        want += [("inner", "after", phase, 0, mb), ("outer", "after", phase, 0, mb)]
    want += [("inner", "finished", 0), ("outer", "finished", 0)]
    assert log == want
    timer = ex.hooks.timer.seconds
    assert timer["fp"] > 0 and timer["bp"] > 0 and timer["update"] > 0


def test_after_hooks_run_when_a_stretch_fails() -> None:
    log: list[tuple[Any, ...]] = []
    chain = HookChain([Recorder("a", log), Recorder("b", log)])

    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        chain.run("bp", 3, 1, boom)
    assert [entry[:2] for entry in log] == [
        ("a", "before"),
        ("b", "before"),
        ("b", "after!"),
        ("a", "after!"),
    ]


def test_a_compute_thread_gives_the_same_bits_and_runs_every_stretch() -> None:
    inline, steps = _swarm(pieces=3)
    inline_reports = _train(inline, steps)
    threaded, _ = _swarm(pieces=3)
    log: list[tuple[Any, ...]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        for ex in threaded.executors:
            ex.compute = pool
            ex.hooks.add(Recorder(str(ex.subdag.index), log))
        threaded_reports = _train(threaded, steps)
    befores = [entry for entry in log if entry[1] == "before"]
    assert befores and all(entry[-1].startswith("compute") for entry in befores)
    for a, b in zip(inline.executors, threaded.executors):
        sa, sb = a.state(), b.state()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    losses = [[r.loss for r in reports] for reports in inline_reports]
    assert losses == [[r.loss for r in reports] for reports in threaded_reports]


class StallingHook(ExecutorHook):
    def before(self, phase: Phase, step: int, mb: int) -> None:
        time.sleep(0.3)  # a long stretch of compute, as far as the event loop can tell


async def longest_loop_stall(work: Awaitable[Any]) -> float:
    """Awaits ``work`` while a ticker measures the event loop's longest gap between 10 ms ticks."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    try:
        await work
    finally:
        done.set()
        await ticker
    return max(gaps, default=0.0)


def test_the_event_loop_stays_free_while_the_compute_thread_works() -> None:
    swarm, steps = _swarm(pieces=2, microbatches=2)
    with ThreadPoolExecutor(1) as pool:
        for ex in swarm.executors:
            ex.compute = pool
            ex.hooks.add(StallingHook())

        started = time.perf_counter()
        worst = asyncio.run(longest_loop_stall(swarm.step(steps[0])))  # 10 stretches of >= 0.3 s each
    assert time.perf_counter() - started >= 10 * 0.3
    assert worst < 0.1, f"the event loop stalled {worst * 1e3:.0f} ms"


class BrokenSends(Channel):
    """Sends fail; receives never complete (the peer never got our data, so it never answers)."""

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        raise ConnectionError(f"link to sub-DAG {dst} is down")

    async def recv(self, src: int, key: MessageKey) -> Any:
        await asyncio.Event().wait()


def test_a_failed_send_ends_the_step_at_the_next_receive() -> None:
    swarm, steps = _swarm(pieces=2, microbatches=2)
    first = swarm.executors[0]
    ex = SubDagExecutor(
        first.graph, first.subdag, first.state(), BrokenSends(), task="train", make_optimizers=None
    )
    data = [{k: v for k, v in mb.items() if k == "inputs"} for mb in steps[0].microbatches]

    async def run() -> None:
        await asyncio.wait_for(ex.run_step(0, data, steps[0].sizes), timeout=30)

    with pytest.raises(ConnectionError, match="link to sub-DAG 1 is down"):
        asyncio.run(run())


def test_a_failing_forward_names_the_sub_dag_and_micro_batch() -> None:
    swarm, steps = _swarm(pieces=1, microbatches=2)
    ex = swarm.executors[0]
    bad = [{"inputs": mb["inputs"][:, :1], "labels": mb["labels"]} for mb in steps[0].microbatches]
    with pytest.raises(ExecutionError, match="FP of step 0 micro-batch 0"):
        asyncio.run(ex.run_step(0, bad, steps[0].sizes))


def test_the_step_call_timeout_scales_with_the_step() -> None:
    from fusionnet.broker.failures import STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_FLOOR, step_timeout

    assert step_timeout(None, None) == STEP_TIMEOUT_FLOOR
    assert step_timeout(0.5, 2.0) == STEP_TIMEOUT_FLOOR  # short steps: the floor
    assert step_timeout(120.0, None) == 120.0 * STEP_TIMEOUT_FACTOR  # minutes-long sub-tasks: scaled
    assert step_timeout(10.0, 300.0) == 300.0 * STEP_TIMEOUT_FACTOR  # the longer of predicted and measured


class SendOrder(ExecutorHook):
    """Notes, as each compute stretch of the first sub-DAG starts, how many sends it has made."""

    def __init__(self, sent: list[int], seen: list[tuple[Phase, int, int]]) -> None:
        self.sent, self.seen = sent, seen

    def before(self, phase: Phase, step: int, mb: int) -> None:
        self.seen.append((phase, mb, len(self.sent)))


def test_an_fp_s_values_leave_before_the_next_stretch_starts() -> None:
    """On a machine whose cores the compute threads fill, a send still waiting on the loop would leave
    only when the next stretch ends, and its receiver would idle that long: the executor lets it go
    first (``Outbox.let_go``). Inline compute (no thread) makes the order deterministic: without the
    let-go, no send would run before the FPs that follow it."""
    swarm, steps = _swarm(pieces=2, microbatches=3)
    first = swarm.executors[0]
    sent: list[int] = []
    real = first.channel.send_values

    async def counting(dst: int, items: Any) -> None:
        sent.append(dst)  # the send's first step: what runs before its first real wait
        await real(dst, items)

    first.channel.send_values = counting  # type: ignore[method-assign]
    seen: list[tuple[Phase, int, int]] = []
    first.hooks.add(SendOrder(sent, seen))
    asyncio.run(swarm.step(steps[0]))
    fps = [(mb, n) for phase, mb, n in seen if phase == "fp"]
    assert fps == [(0, 0), (1, 1), (2, 2)], fps  # F(k) starts once F(k-1)'s values went


def test_let_go_runs_started_sends_up_to_their_first_wait() -> None:
    from fusionnet.dag.outbox import Outbox

    async def scenario() -> list[str]:
        box, log = Outbox(), []
        box.reset()

        async def send() -> None:
            log.append("written")
            await asyncio.Event().wait()  # the peer's acknowledgement, say

        box.start(send())
        assert log == []  # started, not yet run
        await box.let_go()
        box.cancel()
        return log

    assert asyncio.run(scenario()) == ["written"]


def test_a_later_stage_sends_its_input_gradients_before_its_weight_gradients() -> None:
    """A whole BP (GPipe here) on a stage after the first runs as I, then its input gradients leave,
    and its W waits (``dag.backward_pass``): the producer's BP waits for I only. This last stage never
    waits for a gradient, so both Is run before both Ws, oldest W first (``run_device_step``). The
    result stays the plain backward's (``test_exactness``)."""
    swarm, steps = _swarm(pieces=2, microbatches=2)
    later = swarm.executors[1]
    log: list[tuple[Any, ...]] = []
    later.hooks.add(Recorder("later", log))
    real = later.channel.send_values

    async def logging(dst: int, items: Any) -> None:
        mbs = {key[2] for key, _ in items if key[0] == "grad"}  # one frame: a micro-batch's gradients
        log.extend(("send", "grad", mb) for mb in sorted(mbs))
        await real(dst, items)

    later.channel.send_values = logging  # type: ignore[method-assign]
    asyncio.run(swarm.step(steps[0]))
    sends = [(e[1], e[2]) for e in log if e[0] == "send" and e[1] == "grad"]
    assert sends == [("grad", 1), ("grad", 0)]
    stretch = [("later", "before", "bp"), ("later", "after", "bp")]
    order = [
        (e[1], e[2]) if e[0] == "send" else (e[1], e[2], e[4])
        for e in log
        if (e[0], e[1]) == ("send", "grad") or e[:3] in stretch
    ]
    assert order == [
        *[("before", "bp", 1), ("after", "bp", 1), ("grad", 1)],
        *[("before", "bp", 0), ("after", "bp", 0), ("grad", 0)],
        *[("before", "bp", 1), ("after", "bp", 1), ("before", "bp", 0), ("after", "bp", 0)],
    ], order
