"""Interleaved 1F1B (``fusionnet.schedules.interleaved_1f1b``): several sub-DAGs per device, as data
(text form with chunks), validated per stage and per device, deadlock-free on chains and skip edges
across any cut, and priced by the simulator with each device's chunks sharing it: the bubble shrinks
to about 1/v of 1F1B's, as the theory says."""

from __future__ import annotations

import itertools
import random

import pytest

from fusionnet.perfmodel.simulator import Hop, StageTimes, simulate
from fusionnet.schedules import (
    INTERLEAVED,
    Action,
    Schedule,
    ScheduleError,
    check,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
)

SIZES = [(p, v, m) for p in (1, 2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)]


def test_text_form_names_chunks_and_round_trips() -> None:
    s = interleaved_1f1b(2, 2, 2)
    assert s.text() == (
        "interleaved-1f1b p=2 m=2 v=2\n"
        "0: F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1 U\n"
        "1: F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1 U"
    )
    for p, v, m in SIZES:
        sched = interleaved_1f1b(p, m, v)
        assert Schedule.parse(sched.text()) == sched
        assert (sched.devices, sched.stages, sched.chunks) == (p, p * v, v)


def test_each_stage_runs_every_micro_batch_once_in_its_devices_order() -> None:
    sched = interleaved_1f1b(3, 6, 2)
    for stage in range(6):
        prog = sched.program(stage)
        assert sorted(a.mb for a in prog if a.kind == "F") == list(range(6))
        assert sorted(a.mb for a in prog if a.kind == "B") == list(range(6))
        assert prog[-1] == Action("U")
        assert {a.chunk for a in prog if a.kind != "U"} == {stage // 3}
    # device d runs stages d and 3 + d; the order within a stage is the device's
    dev = sched.programs[1]
    assert [a for a in dev if a.kind == "U" or a.chunk == 1] == list(sched.program(4))


@pytest.mark.parametrize(("p", "v", "m"), SIZES)
def test_deadlock_free_on_chains_and_for_every_task(p: int, v: int, m: int) -> None:
    sched = interleaved_1f1b(p, m, v)
    for task in ("train", "grad", "infer"):
        check(sched.for_task(task))


def test_deadlock_free_with_skip_edges_across_any_cut() -> None:
    """Any stage may feed any later one (a residual across cuts): the schedule still runs."""
    rng = random.Random(7)
    for p, v, m in SIZES:
        n = p * v
        pairs = list(itertools.combinations(range(n), 2))
        for _ in range(3):
            edges = [(s, s + 1) for s in range(n - 1)] + rng.sample(pairs, min(len(pairs), n))
            check(interleaved_1f1b(p, m, v), edges)
        check(interleaved_1f1b(p, m, v), pairs)  # every stage feeds every later one


def test_bad_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(ScheduleError, match="multiple of the devices"):
        interleaved_1f1b(2, 3, 2)
    with pytest.raises(ScheduleError, match="v >= 2"):
        interleaved_1f1b(2, 4, 1)
    with pytest.raises(ScheduleError, match="dividing the 5 sub-DAGs"):
        make_schedule("interleaved-1f1b", 5, 4, chunks=2)
    with pytest.raises(ScheduleError, match="one sub-DAG per device"):
        make_schedule("1f1b", 4, 4, chunks=2)
    with pytest.raises(ValueError, match="chunk >= 2"):
        Schedule("x", 1, ((Action("F", 0, 2),),), 2)
    with pytest.raises(ValueError, match="chunk"):
        Action.parse("U.1")
    assert Action.parse("B7.3") == Action("B", 7, 3)


def test_a_device_program_that_reorders_a_stage_is_refused() -> None:
    good = interleaved_1f1b(2, 2, 2)
    prog = list(good.programs[0])
    i, j = prog.index(Action("F", 0, 1)), prog.index(Action("B", 0, 1))
    prog[i], prog[j] = prog[j], prog[i]  # B0.1 before F0.1
    bad = Schedule(good.name, 2, (tuple(prog), good.programs[1]), 2)
    with pytest.raises(ScheduleError, match="stage 2: backward of micro-batch 0 before its forward"):
        check(bad)


def test_a_device_that_would_wait_on_itself_is_named() -> None:
    # device 0 runs stage 2 (chunk 1) before stage 0 fed stage 1 on device 1: nobody can move
    bad = Schedule("mine", 1, ((Action("F", 0, 1), Action("F", 0)), (Action("F", 0), Action("F", 0, 1))), 2)
    with pytest.raises(ScheduleError, match=r"device 0 \(stage 2\) waits at F0.1 for activations"):
        check(bad)


def _chain(n: int, f: float, b: float, u: float, link: float = 0.0) -> tuple[list[StageTimes], list[Hop]]:
    return [StageTimes(f, b, u) for _ in range(n)], [Hop(i, i + 1, link, link) for i in range(n - 1)]


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 4, 8), (3, 3, 9)])
def test_simulated_step_matches_the_theory(p: int, v: int, m: int) -> None:
    """Equal chunks, free links: 1F1B takes (m + p - 1)(f + b) + u; interleaved m (f + b) + (p - 1)(f + b)
    / v + u, the bubble cut to 1/v (Narayanan et al. 2021, section 2.2). Both less a W (half a B) per
    hop of the last backward wave, a chunk's W with interleaving: a B sends its input gradients after
    its I half (``dag.backward_pass``)."""
    f, b, u = 1.0, 2.0, 0.3
    w = b / 2
    stages, hops = _chain(p, f, b, u)
    plain = simulate(stages, hops, m, schedule="1f1b").step_seconds
    assert plain == pytest.approx((m + p - 1) * (f + b) + u - (p - 1) * w)
    stages, hops = _chain(p * v, f / v, b / v, u / v)
    inter = simulate(stages, hops, m, schedule=interleaved_1f1b(p, m, v))
    assert inter.step_seconds == pytest.approx(m * (f + b) + (p - 1) * (f + b - w) / v + u)
    assert inter.step_seconds < plain
    # a device's chunks share it: busy time per device is the whole of its stages' work
    for d in range(p):
        assert sum(inter.stage_busy[c * p + d] for c in range(v)) == pytest.approx(m * (f + b) + u)


def test_slow_links_can_make_interleaving_lose() -> None:
    """v times the messages: on links as slow as the compute, interleaving is no longer ahead."""
    p, v, m = 2, 2, 4
    stages, hops = _chain(p, 1.0, 2.0, 0.0, link=2.0)
    plain = simulate(stages, hops, m, schedule=one_f_one_b(p, m)).step_seconds
    stages, hops = _chain(p * v, 0.5, 1.0, 0.0, link=2.0)
    inter = simulate(stages, hops, m, schedule=interleaved_1f1b(p, m, v)).step_seconds
    assert inter > plain


def test_peak_activations_per_device() -> None:
    """Device 0 holds its warm-up's chunk activations: 2(p-1) + (v-1)p + 1 at most, each 1/v of a
    stage's; 1F1B's device 0 holds p whole micro-batches."""
    for p, v in ((2, 2), (4, 2), (4, 4)):
        m = 2 * p
        res = check(interleaved_1f1b(p, m, v))
        assert res.device_peak[0] == min(2 * (p - 1) + (v - 1) * p + 1, m * v)
        assert check(one_f_one_b(p, m)).device_peak == tuple(p - d for d in range(p))


@pytest.mark.parametrize(("p", "v"), [(2, 2), (3, 2), (2, 3), (4, 3)])
def test_forwards_alone_run_any_microbatch_count(p: int, v: int) -> None:
    """An ``infer`` job's order runs any count (its last batch may be short), also with skip edges;
    training keeps the multiple of p its order needs."""
    n = p * v
    skips = [(a, b) for a in range(n) for b in range(a + 1, n)]
    for m in range(1, 3 * p + 2):
        sched = make_schedule(INTERLEAVED, n, m, "infer", v)
        assert sorted(a.mb for prog in sched.programs for a in prog) == sorted(list(range(m)) * n)
        check(sched, skips)
        if m % p:
            with pytest.raises(ScheduleError, match="multiple of the devices"):
                make_schedule(INTERLEAVED, n, m, "train", v)
