"""The schedule simulator against hand-computed GPipe and 1F1B timelines and against eq. (4)."""

from __future__ import annotations

import random

import pytest

from fusionnet.errors import PlanError
from fusionnet.perfmodel.simulator import Hop, StageTimes, compute_path, simulate, stage_program
from fusionnet.perfmodel.timing import pipelined_eq4


def timeline(result):
    return {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in result.events}


def test_gpipe_two_stages_two_microbatches_by_hand():
    # stage 0: F=1, B=2, U=0.5; stage 1: F=2, B=3, U=0.25; link: 0.5 forward, 1 backward
    stages = [StageTimes(1, 2, 0.5), StageTimes(2, 3, 0.25)]
    r = simulate(stages, [Hop(0, 1, 0.5, 1.0)], 2, schedule="gpipe", task="train", record=True)
    t = timeline(r)
    assert t[(0, "F", 0)] == (0, 1) and t[(0, "F", 1)] == (1, 2)
    assert t[(1, "F", 0)] == (1.5, 3.5)  # arrives at 1.5
    assert t[(1, "F", 1)] == (3.5, 5.5)  # arrived at 2.5, stage busy until 3.5
    # GPipe: backwards in reverse micro-batch order. A B on a stage that sends gradients back runs
    # its I half (1.5 of 3), sends, and leaves its W half pending: stage 1 never waits for a gradient,
    # so both Is run first and both Ws before the update
    assert t[(1, "I", 1)] == (5.5, 7.0)
    assert t[(1, "I", 0)] == (7.0, 8.5)
    assert t[(1, "W", 1)] == (8.5, 10.0) and t[(1, "W", 0)] == (10.0, 11.5)
    assert t[(0, "B", 1)] == (8.0, 10.0)  # gradient sent at 7.0, arrives + 1
    assert t[(0, "B", 0)] == (10.0, 12.0)  # sent 8.5, arrived 9.5, stage busy until 10.0
    assert t[(1, "U", -1)] == (11.5, 11.75)
    assert t[(0, "U", -1)] == (12.0, 12.5)
    assert r.step_seconds == pytest.approx(12.5)  # 13.5 had each W run right after its I
    assert r.peak_inflight == (2, 2)
    assert r.stage_busy == pytest.approx((2 + 4 + 0.5, 4 + 6 + 0.25))


def test_1f1b_two_stages_three_microbatches_by_hand():
    stages = [StageTimes(1, 1), StageTimes(1, 1)]
    r = simulate(stages, [Hop(0, 1, 0.0, 0.0)], 3, schedule="1f1b", task="grad", record=True)
    t = timeline(r)
    assert stage_program("1f1b", "grad", 0, 2, 3) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("B", 2),
    ]
    assert stage_program("1f1b", "grad", 1, 2, 3) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
    ]
    # stage 1's F0 waited for its input, so B0 runs its I half, sends, and its W half before the next F
    # (no activation held longer)
    assert t[(1, "F", 0)] == (1, 2) and t[(1, "I", 0)] == (2, 2.5) and t[(1, "W", 0)] == (2.5, 3)
    # stage 0 did F0, F1 and waits for B0's gradient, sent when B0's I half ends (2.5)
    assert t[(0, "B", 0)] == (2.5, 3.5)
    assert t[(0, "F", 2)] == (3.5, 4.5) and t[(1, "F", 1)] == (3, 4)
    # F1 found its input there (stage 0 keeps ahead) and an F follows B1: it runs whole, sends at its end
    assert t[(1, "B", 1)] == (4, 5) and t[(0, "B", 1)] == (5, 6)
    assert t[(1, "F", 2)] == (5, 6) and t[(1, "I", 2)] == (6, 6.5) and t[(0, "B", 2)] == (6.5, 7.5)
    assert t[(1, "W", 2)] == (6.5, 7)  # no F after B2: it splits, and the end runs what is pending
    assert r.step_seconds == pytest.approx(7.5)  # 8.0 had each B sent its gradients at its end
    assert r.peak_inflight == (2, 1)  # 1F1B: stage k holds at most S - k micro-batches


def test_infer_chain_matches_eq4_exactly():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 6)
        compute = [rng.uniform(0.1, 2.0) for _ in range(n)]
        comm = [0.0] + [rng.uniform(0.0, 3.0) for _ in range(n - 1)]
        m = rng.randint(1, 30)
        hops = [Hop(i, i + 1, comm[i + 1]) for i in range(n - 1)]
        r = simulate([StageTimes(c, 0.0) for c in compute], hops, m, task="infer")
        assert r.step_seconds == pytest.approx(pipelined_eq4(compute, comm, m), rel=1e-12)
        assert r.peak_inflight == (1,) * n


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_random_stage_dags_complete_and_respect_lower_bounds(schedule):
    rng = random.Random(11)
    for _ in range(30):
        n = rng.randint(2, 6)
        stages = [StageTimes(rng.uniform(0.1, 1), rng.uniform(0.1, 2), rng.uniform(0, 0.3)) for _ in range(n)]
        pairs = {(i, i + 1) for i in range(n - 1)} | {
            tuple(sorted(rng.sample(range(n), 2))) for _ in range(rng.randint(0, 3))
        }
        hops = [Hop(a, b, rng.uniform(0, 0.5), rng.uniform(0, 0.5)) for a, b in sorted(pairs)]
        m = rng.randint(1, 6)
        r = simulate(stages, hops, m, schedule=schedule, task="train")
        for i, s in enumerate(stages):
            assert r.stage_busy[i] == pytest.approx(m * (s.fp + s.bp) + s.update)
            assert r.step_seconds >= r.stage_busy[i] - 1e-9
        for h in hops:  # each directed link carries its transfers one after another
            assert r.step_seconds >= m * max(h.fwd, h.bwd) - 1e-9
        limit = [min(m, n - k) for k in range(n)] if schedule == "1f1b" else [m] * n
        assert all(p <= lim for p, lim in zip(r.peak_inflight, limit))


def test_simulator_refuses_bad_input():
    with pytest.raises(PlanError, match="later one"):
        simulate([StageTimes(1, 1), StageTimes(1, 1)], [Hop(1, 0, 1)], 2)
    with pytest.raises(PlanError, match="twice"):
        simulate([StageTimes(1, 1), StageTimes(1, 1)], [Hop(0, 1, 1), Hop(0, 1, 2)], 2)
    with pytest.raises(PlanError, match="microbatches"):
        simulate([StageTimes(1, 1)], [], 0)
    with pytest.raises(PlanError, match="negative"):
        simulate([StageTimes(-1, 1)], [], 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_once_per_step_values_delay_the_first_forward_and_the_last_backward(schedule):
    # A parameter read across the cut (a tied embedding) rides on stage 0's first forward message and
    # its summed gradient on stage 1's last backward message: both lie on the critical path here.
    # (stage 1's W halves are short: GPipe's pending Ws would otherwise hide the gradient's extra time)
    stages = [StageTimes(1.0, 1.0), StageTimes(1.0, 2.0, input_share=0.9)]
    plain = simulate(stages, [Hop(0, 1, 0.1, 0.1)], 4, schedule=schedule).step_seconds
    once = simulate(stages, [Hop(0, 1, 0.1, 0.1, fwd_once=0.5, bwd_once=0.7)], 4, schedule=schedule)
    assert once.step_seconds == pytest.approx(plain + 1.2)
    with pytest.raises(PlanError, match="negative"):
        simulate(stages, [Hop(0, 1, 0.1, 0.1, fwd_once=-1.0)], 4)


def test_compute_path_is_the_step_had_messages_been_free():
    """A step's measured FP / BP / Update per sub-DAG, run through its schedule with free messages: what
    the broker writes to metrics.jsonl as ``compute_path_seconds`` beside the step's wall time."""
    # the 1F1B step above, in the totals a step reports: 3 micro-batches of 1 s FP and 1 s BP each
    assert compute_path([(3.0, 3.0, 0.0)] * 2, [[1], []], 3, schedule="1f1b", task="grad") == 7.5
    # the GPipe step by hand above without its link: stage 1 runs I1, I0 (sent at 8), both Ws (until
    # 11) and its update (0.25); stage 0 runs B0 from 8.5 to 10.5 and its update (0.5)
    gpipe = compute_path([(2.0, 4.0, 0.5), (4.0, 6.0, 0.25)], [[1], []], 2, task="train")
    assert gpipe == pytest.approx(11.25)
    # sub-DAGs that exchange nothing do not wait for each other: the longer one's compute
    assert compute_path([(2.0, 2.0, 0.0), (3.0, 3.0, 0.0)], [[], []], 2, task="grad") == 6.0
    # a skip edge alone (0 -> 2) chains 0 and 2; readers out of range or backwards are ignored
    skip = compute_path([(1.0, 1.0, 0.0)] * 3, [[2, 7], [0], []], 1, task="grad")
    assert skip == pytest.approx(3.5)  # 0's B starts once 2's B is half done (its I half)
    # interleaved: 2 devices x 2 chunks; never shorter than a device's own compute
    chunks = compute_path(
        [(2.0, 2.0, 0.0)] * 4, [[1], [2], [3], []], 2, schedule="interleaved-1f1b", chunks=2
    )
    assert chunks >= 8.0
