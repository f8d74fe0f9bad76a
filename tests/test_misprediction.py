"""Issue 16: measured step times that contradict the plan make the broker look at the placement again,
with hysteresis. ``PredictionWatch`` (when to look) and ``replanning.prediction_replan`` (what to do)
are pure: tested here on numbers and on the GPT shape of the planning tests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fusionnet.broker import replanning
from fusionnet.planning.misprediction import PredictionWatch
from fusionnet.planning.placement import BALANCED, Candidate, JobShape, Placement, plan_placement
from tests.planning_support import cand


def test_the_watch_needs_patience_and_skips_warmup_short_steps_and_cooldown() -> None:
    watch = PredictionWatch(tolerance=0.25, patience=2, warmup=1, cooldown=3, min_seconds=0.2)
    assert not watch.observe(4.0)  # nothing predicted: nothing judged
    watch.placed(1.0)
    assert not watch.observe(4.0)  # the warm-up step after a placement
    assert not watch.observe(4.0)  # one contradicting step is not enough ...
    assert watch.observe(4.0)  # ... two in a row are
    assert watch.looks == 1
    assert [watch.observe(4.0) for _ in range(3)] == [False, False, False]  # cooldown
    assert not watch.observe(4.0)
    assert watch.observe(4.0)  # contradicts again: another look
    # within tolerance (|m - p| / m <= 25%) resets the count
    watch.placed(1.0)
    assert [watch.observe(s) for s in (1.0, 1.3, 1.0, 1.3, 1.1)] == [False] * 5
    # a run of steps much faster than predicted contradicts too
    assert [watch.observe(s) for s in (0.5, 0.5)] == [False, True]
    # steps too short to be worth a re-plan are never judged
    watch.placed(0.01)
    assert [watch.observe(0.1) for _ in range(5)] == [False] * 5


def test_a_repriced_prediction_stops_the_looks() -> None:
    watch = PredictionWatch(patience=1, warmup=0, cooldown=0)
    watch.placed(1.0)
    assert watch.observe(3.0)
    watch.repredicted(2.9)  # the plan priced again with the measured speeds: now it agrees
    assert not watch.observe(3.0)
    watch.repredicted(None)  # the model could not say: the last figure stays
    assert watch.predicted == 2.9
    with pytest.raises(ValueError):
        PredictionWatch(tolerance=0.0)
    # the plan priced on loopback figures, then on the probed links: 0.57 s against 4.26 s (issue 16)
    assert watch.contradicts(0.57, 4.26) and watch.contradicts(4.26, 0.57)
    assert not watch.contradicts(1.0, 1.2) and not watch.contradicts(None, 1.0)


def slowed(c: Candidate, slowness: float) -> Candidate:
    """What ``SpeedBook.device`` hands the planner once a compnode was measured ``slowness`` x slower."""
    assert c.device is not None
    return replace(c, device=c.device.scaled(1.0 / slowness))


def nodes_on(placement: Placement, peer: str) -> int:
    """IR nodes the placement gives ``peer`` (0 when it is not in it)."""
    if peer not in placement.peers:
        return 0
    return sum(1 for s in placement.assignment.values() if s == placement.peers.index(peer))


def test_a_compnode_measured_slower_than_announced_gets_less_work(gpt: JobShape) -> None:
    pool = [cand("a", 1e11), cand("b", 1e11)]
    current = plan_placement(gpt, pool, stages=2)
    assert current.predicted_step is not None
    measured = 0.5  # seconds a step took (the model's figures are those of a far smaller machine)
    # b runs 4x slower than it announced: re-priced, the current plan is slower, and a fresh plan
    # moves work onto a
    learnt = [pool[0], slowed(pool[1], 4.0)]
    replan, now = replanning.prediction_replan("j", gpt, current, learnt, 0.1, None, measured, 100)
    assert now is not None and now > 1.5 * current.predicted_step
    assert replan is not None and replan.reason == "mispredicted" and replan.proposed is not None
    assert replan.proposed.predicted_step is not None and replan.proposed.predicted_step < 0.9 * now
    before = nodes_on(current, "b")
    after = nodes_on(replan.proposed, "b")
    assert after < before
    # ... but with two steps left the move would cost more than it saves
    late, _ = replanning.prediction_replan("j", gpt, current, learnt, 0.1, None, measured, 2)
    assert late is None
    # ... and steps of milliseconds never win back a move's fixed cost (REPLAN_COST_FLOOR), however many
    short = 0.002
    assert 100 * short < replanning.REPLAN_COST_FLOOR
    tiny, _ = replanning.prediction_replan("j", gpt, current, learnt, 0.1, None, short, 100)
    assert tiny is None


def test_no_replan_when_the_plan_is_as_good_as_it_gets(gpt: JobShape) -> None:
    pool = [cand("a", 1e11), cand("b", 1e11)]
    current = plan_placement(gpt, pool, stages=2)
    assert current.predicted_step is not None
    # the steps were slow for a reason the model does not see (the machine was busy): the fresh plan on
    # the same figures is the same plan, so nothing moves, and the re-priced step is handed back
    slow = 5 * current.predicted_step
    replan, now = replanning.prediction_replan("j", gpt, current, pool, 0.1, None, slow, 100)
    assert replan is None
    assert now == pytest.approx(current.predicted_step)
    # one of the job's compnodes is not schedulable now: failure handling comes first
    assert replanning.prediction_replan("j", gpt, current, pool[:1], 0.1, None, 1.0, 100) == (None, None)
    # a placement the model did not make is not re-planned by it
    balanced = plan_placement(gpt, pool, policy=BALANCED)
    assert replanning.prediction_replan("j", gpt, balanced, pool, 0.1, None, 1.0, 100) == (None, None)


def test_mispredicted_is_a_proposing_replan() -> None:
    with pytest.raises(AssertionError):
        replanning.Replan("mispredicted")
