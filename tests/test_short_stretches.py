"""Short compute stretches on a sandbox worker's loop (``dag.short_stretches``): which stretches may run
inline, that they do once timed short, that long ones, ones behind a pending send and ones while the
compute thread is busy stay on the thread, and that the route does not change a bit of the result."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from fusionnet.dag.hooks import ExecutorHook, Phase
from fusionnet.dag.outbox import Outbox
from fusionnet.dag.short_stretches import RECENT, ShortStretches, TrackedPool
from tests.test_executor_hooks import Recorder, _swarm, _train, longest_loop_stall

pytestmark = pytest.mark.timeout(120)


def test_a_phase_is_short_once_its_recent_stretches_all_were() -> None:
    short = ShortStretches(0.02)
    assert not short.short("fp")  # never timed: to the thread first
    short.observe("fp", 0.005)
    assert short.short("fp") and not short.short("bp")
    short.observe("fp", 0.5)  # one long stretch among the recent ones keeps the phase on the thread
    assert not short.short("fp")
    for _ in range(RECENT - 1):
        short.observe("fp", 0.01)
    assert not short.short("fp")
    short.observe("fp", 0.01)  # the long one has left the window
    assert short.short("fp")


def test_a_zero_limit_keeps_every_stretch_on_the_thread() -> None:
    short = ShortStretches(0.0)
    short.observe("update", 0.0)
    assert not short.short("update")
    with pytest.raises(ValueError, match=">= 0"):
        ShortStretches(-1.0)


def test_a_tracked_pool_is_idle_only_with_nothing_queued_or_running() -> None:
    release = threading.Event()
    with ThreadPoolExecutor(1) as inner:
        pool = TrackedPool(inner)
        assert pool.idle()
        running = pool.submit(release.wait, 30)
        queued = pool.submit(lambda: 1)
        assert not pool.idle()
        release.set()
        assert running.result(30) and queued.result(30) == 1
        assert pool.idle()


def test_the_outbox_is_idle_once_every_send_is_done() -> None:
    async def run() -> None:
        outbox = Outbox()
        outbox.reset()
        assert outbox.idle()
        gate = asyncio.Event()
        outbox.start(gate.wait())
        await outbox.let_go()
        assert not outbox.idle()  # waiting for room in the socket, as far as the executor knows
        gate.set()
        await outbox.drain()
        assert outbox.idle()

    asyncio.run(run())


def _routed(limit: float, pool: ThreadPoolExecutor, log: list[tuple[Any, ...]]) -> Any:
    swarm, steps = _swarm(pieces=3)
    tracked = TrackedPool(pool)
    for ex in swarm.executors:
        ex.compute = tracked
        ex.short_stretches = ShortStretches(limit)
        ex.hooks.add(Recorder(str(ex.subdag.index), log))
    return swarm, steps, tracked


def test_short_stretches_run_inline_and_give_the_same_bits() -> None:
    plain, steps = _swarm(pieces=3)
    plain_reports = _train(plain, steps)
    log: list[tuple[Any, ...]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        routed, _, _ = _routed(10.0, pool, log)  # every stretch counts as short once timed
        routed_reports = _train(routed, steps)
    here = threading.current_thread().name
    befores = [e for e in log if e[1] == "before"]
    for ex in routed.executors:
        mine = [e for e in befores if e[0] == str(ex.subdag.index)]
        for phase in ("fp", "bp", "update"):
            first = next(e for e in mine if e[2] == phase)
            assert first[-1].startswith("compute"), f"the first {phase} is timed on the thread"
        assert any(e[-1] == here for e in mine), "no stretch ran inline"
        assert ex.short_stretches is not None and ex.short_stretches.inline > 0
    for a, b in zip(plain.executors, routed.executors):
        sa, sb = a.state(), b.state()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [[r.loss for r in rs] for rs in plain_reports] == [[r.loss for r in rs] for rs in routed_reports]


class Stall(ExecutorHook):
    def before(self, phase: Phase, step: int, mb: int) -> None:
        time.sleep(0.15)


def test_long_stretches_stay_on_the_thread_and_the_loop_stays_free() -> None:
    log: list[tuple[Any, ...]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        swarm, steps, _ = _routed(0.02, pool, log)
        for ex in swarm.executors:
            ex.hooks.add(Stall())

        async def two_steps() -> None:
            for step in steps[:2]:
                await swarm.step(step)

        worst = asyncio.run(longest_loop_stall(two_steps()))
    assert all(e[-1].startswith("compute") for e in log if e[1] == "before")
    assert worst < 0.1, f"the event loop stalled {worst * 1e3:.0f} ms"
    assert all(ex.short_stretches is not None and ex.short_stretches.inline == 0 for ex in swarm.executors)


def test_a_busy_compute_thread_takes_the_next_stretch_itself() -> None:
    log: list[tuple[Any, ...]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        swarm, steps, tracked = _routed(10.0, pool, log)
        _train(swarm, steps[:1])  # every phase timed
        release = threading.Event()
        tracked.submit(release.wait, 30)  # a snapshot's copy, say
        threading.Timer(0.2, release.set).start()
        log.clear()
        _train(swarm, steps[1:2])
    first = next(e for e in log if e[1] == "before")
    assert first[-1].startswith("compute"), "a stretch ran inline while the compute thread was busy"
    assert any(e[-1] == threading.current_thread().name for e in log if e[1] == "before")


def test_work_beside_the_graph_is_routed_like_a_stretch_of_its_own_phase() -> None:
    """A served batch's output packing (``run_routed("pack", ...)``, ``compnode/serve_steps``): timed on
    the compute thread first, then inline while its packs stay short, back on the thread after a long
    one; the graph's own phases keep their own timings."""
    here = threading.current_thread().name

    def where(seconds: float = 0.0) -> str:
        time.sleep(seconds)
        return threading.current_thread().name

    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        swarm, _, _ = _routed(0.05, pool, [])
        ex = swarm.executors[0]

        async def run() -> list[str]:
            names = [await ex.run_routed("pack", where) for _ in range(3)]
            names.append(await ex.run_routed("pack", lambda: where(0.1)))  # ran inline, timed long
            names.append(await ex.run_routed("pack", where))
            return names

        names = asyncio.run(run())
    assert names[0].startswith("compute") and names[1:4] == [here] * 3 and names[4].startswith("compute")
    assert ex.short_stretches is not None and not ex.short_stretches.short("fp")
