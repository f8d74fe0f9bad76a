"""Schedules as data (``fusionnet.schedules``): text form, validation, deadlock-freedom on real edge
sets (skip edges), peak in-flight activations, and the step-time order the theory predicts."""

from __future__ import annotations

import pytest

from fusionnet.errors import PlanError
from fusionnet.perfmodel.simulator import Hop, StageTimes, simulate
from fusionnet.schedules import (
    NAMES,
    Action,
    Schedule,
    ScheduleError,
    check,
    gpipe,
    make_schedule,
    one_f_one_b,
    zero_bubble_h1,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2), (3, 6), (4, 3), (4, 8), (5, 12)]
# Stage graphs with skip edges: 0 feeds every later stage; a diamond; a long skip only.
SKIPS = {
    3: [(0, 1), (1, 2), (0, 2)],
    4: [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)],
    5: [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (1, 3)],
}


def test_text_form_round_trips_and_reads() -> None:
    s = one_f_one_b(2, 3)
    assert s.text() == "1f1b p=2 m=3\n0: F0 F1 B0 F2 B1 B2 U\n1: F0 B0 F1 B1 F2 B2 U"
    for name in NAMES:
        for p, m in SIZES:
            sched = make_schedule(name, p, m)
            assert Schedule.parse(sched.text()) == sched


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("x p=1", "header"),
        ("x p=2 m=1\n0: F0 B0 U", "p=2 but has 1"),
        ("x p=1 m=1\n1: F0 B0 U", "must start with '0:'"),
        ("x p=1 m=1\n0: F0 Q0 U", "must look like"),
        ("x p=1 m=1\n0: F B0 U", "needs a micro-batch"),
        ("x p=1 m=1\n0: F0 B0 U3", "takes no micro-batch"),
    ],
)
def test_parse_refuses_malformed_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule.parse(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("x p=1 m=2\n0: F0 B0 U", "exactly one F"),
        ("x p=1 m=1\n0: B0 F0 U", "before its forward"),
        ("x p=1 m=1\n0: F0 W0 I0 U", "W0 before I0"),
        ("x p=1 m=1\n0: F0 B0 I0 W0 U", "one B, or one I and one W"),
        ("x p=1 m=1\n0: F0 U B0", "ends with exactly one update"),
        ("x p=1 m=1\n0: F3 B3 U", "outside 0..0"),
        ("x p=2 m=1\n0: F0 B0 U\n1: F0 B0", "ends with exactly one update"),
    ],
)
def test_check_refuses_malformed_programs(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        check(Schedule.parse(text))


def test_check_finds_a_deadlock_and_names_the_waits() -> None:
    # Stage 0 wants B0's gradient before it sends F1; stage 1 wants F1 before it runs B0.
    bad = Schedule.parse("x p=2 m=2\n0: F0 B0 F1 B1 U\n1: F0 F1 B0 B1 U")
    with pytest.raises(ScheduleError, match=r"stage 0 waits at B0 for gradients from stage\(s\) \[1\]"):
        check(bad)


def test_check_uses_the_real_edges() -> None:
    # Stages 0 and 1 both feed stage 2 and not each other: their orders need not agree, which the
    # chain 0 -> 1 -> 2 would forbid. (Stages are numbered topologically, so every edge s -> t is
    # implied by the chain's path s -> s+1 -> .. -> t: what passes on the chain passes on any cut,
    # skip edges included.)
    text = "x p=3 m=2\n0: F0 B0 F1 B1 U\n1: F0 F1 B0 B1 U\n2: F0 B0 F1 B1 U"
    sched = Schedule.parse(text)
    assert check(sched, [(0, 2), (1, 2)]).peak_inflight == (1, 2, 1)
    with pytest.raises(ScheduleError, match="deadlocks"):
        check(sched)
    with pytest.raises(ScheduleError, match="not between two of the stages"):
        check(sched, [(0, 3)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p, m", SIZES)
def test_provided_schedules_run_on_chains_and_skip_edges(name: str, p: int, m: int) -> None:
    for task in ("train", "grad", "infer"):
        sched = make_schedule(name, p, m, task)
        check(sched)
        if p in SKIPS:
            check(sched, SKIPS[p])


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_inflight_follows_theory(p: int, m: int) -> None:
    assert check(gpipe(p, m)).peak_inflight == (m,) * p
    assert check(one_f_one_b(p, m)).peak_inflight == tuple(min(m, p - s) for s in range(p))
    # ZB-H1 keeps 1F1B's peak (stage 0's) on every stage
    assert max(check(zero_bubble_h1(p, m)).peak_inflight) <= max(check(one_f_one_b(p, m)).peak_inflight)
    assert check(make_schedule("1f1b", p, m, "infer")).peak_inflight == (1,) * p


def _chain(p: int, fp: float, bp: float, link: float = 0.0) -> tuple[list[StageTimes], list[Hop]]:
    return [StageTimes(fp, bp) for _ in range(p)], [Hop(s, s + 1, link, link) for s in range(p - 1)]


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 4)])
def test_zero_bubble_beats_1f1b_when_compute_dominates(p: int, m: int) -> None:
    stages, hops = _chain(p, 1.0, 2.0)  # unit F, I, W as in the paper
    one = simulate(stages, hops, m, schedule=one_f_one_b(p, m)).step_seconds
    zb = simulate(stages, hops, m, schedule="zero-bubble").step_seconds
    # 1F1B's 3 (m + p - 1), less a W per hop of the last backward wave: a B sends its input
    # gradients after its I half (``dag.backward_pass``), so each hop back waits for I only
    assert one == pytest.approx(3 * (m + p - 1) - (p - 1))
    assert zb == pytest.approx(3 * m + p - 1)  # ZB-H1's bubble: (p-1)(F + I - W)
    assert simulate(stages, hops, m, schedule="gpipe").step_seconds == pytest.approx(one)


def test_simulator_takes_schedule_objects_and_refuses_mismatches() -> None:
    stages, hops = _chain(2, 1.0, 1.0)
    with pytest.raises(PlanError, match="is for 3 stages"):
        simulate(stages, hops, 2, schedule=gpipe(3, 2))
    bad = Schedule.parse("x p=2 m=1\n0: B0 F0 U\n1: F0 B0 U")
    with pytest.raises(PlanError, match="before its forward"):
        simulate(stages, hops, 1, schedule=bad)
    r = simulate(stages, hops, 2, schedule=zero_bubble_h1(2, 2), record=True)
    assert {e.kind for e in r.events} == {"F", "I", "W", "U"}


def test_action_validation() -> None:
    assert str(Action("F", 3)) == "F3" and str(Action("U")) == "U"
    with pytest.raises(ValueError):
        Action("F")
    with pytest.raises(ValueError):
        Action("U", 2)
    with pytest.raises(ScheduleError, match="must be one of"):
        make_schedule("pipedream", 2, 2)


def test_make_schedule_is_built_once_per_arguments_and_errors_every_time() -> None:
    # every executor asks for its program every step: the same arguments give the same (immutable) object
    first = make_schedule("1f1b", 3, 6, "train")
    assert make_schedule("1f1b", 3, 6, "train") is first
    assert make_schedule("1f1b", 3, 6, "infer") is not first
    forwards = tuple(a for a in first.program(0) if a.kind == "F")
    assert make_schedule("1f1b", 3, 6, "infer").program(0) == forwards
    for _ in range(2):  # a refusal is not remembered as a result
        with pytest.raises(ScheduleError, match="must be one of"):
            make_schedule("pipedream", 2, 2)
