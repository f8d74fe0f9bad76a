"""The broker's placement policy as pure functions: pools for first placement, failover, hand-over and
growth; the performance model choosing cuts and compnodes for a fixed number of sub-DAGs; the
balanced fallback when hardware is unknown; the elastic-join threshold."""

from __future__ import annotations

import pytest

from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import Link
from fusionnet.planning.placement import (
    BALANCED,
    SCHEDULER,
    Candidate,
    JobShape,
    first_pool,
    grown_pool,
    idle_stages,
    plan_placement,
    pool_after_loss,
    predicted_step,
    worth_replanning,
)
from tests.planning_support import cand


def test_first_pool_keeps_the_backups_standing_by() -> None:
    pool = first_pool([cand("b1", 9e11, backup=True), cand("r1", 1e11), cand("r2", 2e11)])
    assert [c.peer_id for c in pool] == ["r2", "r1"]  # fastest first, no backup
    only_backups = first_pool([cand("b1", backup=True)])
    assert [c.peer_id for c in only_backups] == ["b1"]
    with pytest.raises(PlanError, match="no ONLINE compnode"):
        first_pool([])


def test_pool_after_loss_prefers_backups_then_free_regular_nodes() -> None:
    everyone = [cand("a"), cand("b"), cand("c"), cand("bk", backup=True), cand("free", 5e11)]
    pool = pool_after_loss(["a", "b", "c"], {"b"}, everyone)
    assert [c.peer_id for c in pool] == ["a", "c", "bk"]  # the backup fills the hole, not "free"
    no_backup = [c for c in everyone if c.peer_id != "bk"]
    assert [c.peer_id for c in pool_after_loss(["a", "b", "c"], {"b"}, no_backup)] == ["a", "c", "free"]
    alone = [cand("a"), cand("b")]
    assert [c.peer_id for c in pool_after_loss(["a", "b"], {"b"}, alone)] == ["a"]  # shrink
    with pytest.raises(PlanError, match="every compnode of the job is gone"):
        pool_after_loss(["a"], {"a"}, [])


def test_grown_pool_offers_only_free_regular_nodes() -> None:
    assert grown_pool(["a"], [cand("a"), cand("bk", backup=True)]) is None
    assert [c.peer_id for c in grown_pool(["a"], [cand("a"), cand("n", 3e11)])] == ["a", "n"]
    assert grown_pool(["a", "gone"], [cand("a"), cand("n")]) is None  # a failure is handled first


def test_performance_model_places_more_work_on_the_faster_node(gpt: JobShape) -> None:
    pool = [cand("slow", 5e10), cand("fast", 2e11)]
    placement = plan_placement(gpt, pool)
    assert placement.policy == SCHEDULER
    assert len(placement.peers) == 2  # wanted 3, but only 2 compnodes
    partition = build_partition(gpt.graph, placement.assignment)
    flops = [sum(gpt.graph.node(n).cost.get("flops_fwd", 0) for n in s.nodes) for s in partition.subdags]
    fast = placement.peers.index("fast")
    assert flops[fast] > 2 * flops[1 - fast]
    # ... and it beats the equal (FLOP-balanced) split on the same two compnodes, as the model sees it
    balanced = plan_placement(gpt, [cand("slow", None), cand("fast", 2e11)])  # no hardware: balanced
    assert balanced.policy == BALANCED and balanced.predicted_step is None
    equal = predicted_step(gpt, balanced, pool)
    assert equal is not None and placement.predicted_step is not None
    assert placement.predicted_step < 0.9 * equal
    assert set(placement.predicted or {}) == {0, 1}


def test_fixed_stage_count_and_determinism(gpt: JobShape) -> None:
    pool = [cand(f"n{i}", 1e11 * (i + 1)) for i in range(4)]
    one = plan_placement(gpt, pool, stages=3)
    assert len(one.peers) == 3 and one == plan_placement(gpt, pool, stages=3)
    assert len(build_partition(gpt.graph, one.assignment).subdags) == 3
    with pytest.raises(PlanError, match="cannot place"):
        plan_placement(gpt, pool, stages=5)


def test_compnodes_without_work_go_back_to_the_pool(gpt: JobShape) -> None:
    # Over a crawling link the model puts all the work on one compnode; forced to 3 stages it would
    # keep the others as stubs of a few ops (issue 16's "idle stages"). They are left out instead.
    pool = [cand(f"n{i}", 1e11) for i in range(3)]
    slow = Link.from_bandwidth(0.001, 1e7)  # 80 Mbit/s
    links = {(a.peer_id, b.peer_id): slow for a in pool for b in pool if a is not b}
    forced = plan_placement(gpt, pool, links=links, stages=3)  # an explicit count is kept, stubs and all
    assert len(forced.peers) == 3 and len(idle_stages(forced.predicted or {})) == 2
    placement = plan_placement(gpt, pool, links=links)
    assert len(placement.peers) == 1 and set(placement.assignment.values()) == {0}
    assert idle_stages(placement.predicted or {}) == []
    assert placement.predicted_step is not None and forced.predicted_step is not None
    assert placement.predicted_step < forced.predicted_step
    # On loopback links the same pool splits the work, every stage with some.
    fast = plan_placement(gpt, pool)
    assert len(fast.peers) >= 2 and idle_stages(fast.predicted or {}) == []
    assert idle_stages({0: 1.0, 1: 0.001, 2: 0.5}) == [1] and idle_stages({0: 0.0}) == []


def test_balanced_fallback_when_hardware_is_unknown(gpt: JobShape) -> None:
    placement = plan_placement(gpt, [cand("x", None), cand("y", 1e11), cand("z", None)])
    assert placement.policy == BALANCED
    assert placement.peers[0] == "y"  # the one with a known speed first
    assert placement.assignment == balanced_assignment(gpt.graph, 3)


def test_replanning_needs_a_predicted_gain_above_the_threshold(gpt: JobShape) -> None:
    now = plan_placement(gpt, [cand("a", 1e11)])
    grown = plan_placement(gpt, [cand("a", 1e11), cand("b", 1e11), cand("c", 1e11)])
    assert now.predicted_step is not None and grown.predicted_step is not None
    gain = 1 - grown.predicted_step / now.predicted_step
    assert gain > 0.1  # three compnodes pipeline the step, less the transfers they add
    assert worth_replanning(now.predicted_step, grown, gain - 0.01)
    assert not worth_replanning(now.predicted_step, grown, gain + 0.01)
    assert not worth_replanning(None, grown, 0.0)
    assert not worth_replanning(now.predicted_step, now, 0.0)  # equal is no gain


def test_balanced_policy_on_known_hardware_is_predicted_and_slower_on_unequal_nodes(gpt: JobShape) -> None:
    pool = [cand("slow", 2e10), cand("fast", 2e11)]
    balanced = plan_placement(gpt, pool, policy=BALANCED)
    model = plan_placement(gpt, pool)
    assert balanced.policy == BALANCED and balanced.assignment == balanced_assignment(gpt.graph, 2)
    assert balanced.predicted_step == pytest.approx(predicted_step(gpt, balanced, pool))
    assert model.predicted_step is not None and balanced.predicted_step > model.predicted_step
    with pytest.raises(PlanError, match="placement policy"):
        plan_placement(gpt, pool, policy="random")


def test_consider_growth_adopts_only_a_predicted_gain_from_new_free_nodes(gpt: JobShape) -> None:
    from fusionnet.planning.placement import consider_growth

    alone = [cand("a", 1e11)]
    current = plan_placement(gpt, alone)
    assert consider_growth(gpt, current, alone, 0.0) is None  # nobody new
    assert consider_growth(gpt, current, [*alone, cand("bk", backup=True)], 0.0) is None  # backups wait
    grown = consider_growth(gpt, current, [*alone, cand("b", 1e11)], 0.0)
    assert grown is not None and grown.adopt and set(grown.proposed.peers) == {"a", "b"}
    assert grown.now == pytest.approx(current.predicted_step)
    assert not consider_growth(gpt, current, [*alone, cand("b", 1e11)], 0.99).adopt  # gain too small
    balanced = plan_placement(gpt, alone, policy=BALANCED)
    assert consider_growth(gpt, balanced, [*alone, cand("b", 1e11)], 0.0) is None  # not the model's plan
    assert "predicted step" in grown.describe()


def test_interleaved_chunks_must_fit_their_compnode_together(gpt: JobShape) -> None:
    """Each chunk of an interleaved placement fits by itself, but a compnode holds all of its chunks at
    once: the placement is refused, naming the compnode, when they do not fit there together."""
    from dataclasses import replace

    from fusionnet.planning.planner import plan_interleaved
    from tests.planning_support import device

    shape = replace(gpt, schedule="interleaved-1f1b", chunks=2, microbatches=4)
    kwargs = {"microbatches": 4, "batch_size": shape.batch_size, "optimizer": shape.optimizer}
    roomy = plan_interleaved(shape.graph, [device("a"), device("b")], 2, **kwargs)
    need = [s.demand.cpu for s in roomy.plan.stages]  # CPU devices: d_cpu (and d_disk) only
    # device 0 gets disk for its own chunks' checkpoints, no more: its memory is what binds
    disk = roomy.plan.stages[0].demand.disk + roomy.plan.stages[2].demand.disk
    disk_b = sum(s.demand.disk for s in roomy.plan.stages)
    together = need[0] + need[2]  # device 0 holds sub-DAGs 0 and 2
    alone = max(need[0], need[2])
    tight = [device("a", memory=(alone + together) // 2, disk=disk), device("b", disk=disk_b)]
    with pytest.raises(PlanError, match=r"the 2 chunks of device 0 \('a'\) together: needs .* of d_cpu"):
        plan_interleaved(shape.graph, tight, 2, **kwargs)
    pool = [Candidate("a", False, tight[0]), Candidate("b", False, tight[1])]
    with pytest.raises(PlanError, match=r"the 2 chunks of device 0 \('a'\)"):
        plan_placement(shape, pool)  # the broker refuses it the same way
    too_small = [device("a", memory=min(need[0], need[2]) // 2, disk=disk), device("b", disk=disk_b)]
    with pytest.raises(PlanError, match=r"interleaved-1f1b: sub-DAG [02] .* needs"):
        plan_interleaved(shape.graph, too_small, 2, **kwargs)
    roomier = [device("a", memory=together + 1024, disk=disk), device("b", disk=disk_b)]
    assert plan_interleaved(shape.graph, roomier, 2, **kwargs).predicted_step_seconds > 0
