"""``placement.schedule: auto`` weighing interleaved-1f1b (``planning.auto_interleaved``), as pure
functions of data: the fastest chunk count that runs and fits, the margin it must clear, the placement
the broker then adopts (compnode d holding sub-DAGs d, p + d, ...), and the spec its compnodes get."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusionnet.broker import replanning
from fusionnet.broker.assignment_payloads import iter_assignment_payloads
from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.planning.auto_interleaved import (
    MIN_GAIN,
    InterleavedOption,
    best_interleaved,
    interleaving_pays,
)
from fusionnet.planning.placement import (
    SCHEDULER,
    JobShape,
    consider_growth,
    plan_placement,
    predicted_step,
)
from fusionnet.planning.planner import plan_interleaved
from fusionnet.schedules import INTERLEAVED
from tests.planning_support import cand, device
from tests.test_assignments import _figure3


def _shape(gpt: JobShape, p: int, m: int, schedule: str = "auto") -> JobShape:
    return replace(gpt, wanted=p, microbatches=m, schedule=schedule)


def test_best_interleaved_is_the_fastest_chunk_count_that_runs(gpt: JobShape) -> None:
    devices = [device("a"), device("b")]
    kwargs = {"microbatches": 4, "batch_size": gpt.batch_size, "optimizer": gpt.optimizer}
    option = best_interleaved(gpt.graph, devices, **kwargs)
    assert option is not None
    steps = {v: plan_interleaved(gpt.graph, devices, v, **kwargs).predicted_step_seconds for v in (2, 3, 4)}
    assert option.chunks == min(steps, key=steps.__getitem__)
    assert option.step_seconds == pytest.approx(steps[option.chunks])
    assert set(option.tried) == {2, 3, 4} and all(t.endswith(" s") for t in option.tried.values())
    assert option.planned.devices == [s % 2 for s in range(2 * option.chunks)]


def test_no_interleaving_where_it_cannot_run(gpt: JobShape) -> None:
    kwargs = {"batch_size": gpt.batch_size, "optimizer": gpt.optimizer}
    two = [device("a"), device("b")]
    assert best_interleaved(gpt.graph, [device("a")], microbatches=4, **kwargs) is None  # one compnode
    assert best_interleaved(gpt.graph, two, microbatches=3, **kwargs) is None  # m not a multiple of p
    ops = sum(1 for n in gpt.graph.nodes if n.kind not in ("placeholder", "variable", "output"))
    assert best_interleaved(gpt.graph, two, microbatches=4, chunk_choices=(ops,), **kwargs) is None
    # chunks that do not fit their compnode together are left out, with the reason kept
    roomy = best_interleaved(gpt.graph, two, microbatches=4, chunk_choices=(2,), **kwargs)
    assert roomy is not None
    need = max(s.demand.cpu for s in roomy.planned.plan.stages)
    tiny = [device("a", memory=need // 4), device("b", memory=need // 4)]
    assert best_interleaved(gpt.graph, tiny, microbatches=4, chunk_choices=(2,), **kwargs) is None


def test_interleaving_must_clear_the_margin(gpt: JobShape) -> None:
    planned = plan_interleaved(gpt.graph, [device("a"), device("b")], 2, microbatches=4)
    option = InterleavedOption(2, planned, {2: "x"})
    t = option.step_seconds
    assert interleaving_pays(t / (1 - MIN_GAIN) * 1.001, option)
    assert not interleaving_pays(t / (1 - MIN_GAIN) * 0.999, option)
    assert not interleaving_pays(None, option) and not interleaving_pays(t, None)
    assert interleaving_pays(t * 0.6, option, gain=-0.9) and not interleaving_pays(t * 0.6, option, gain=0.0)
    assert not interleaving_pays(t * 0.4, option, gain=-0.9)  # predicted 2.5x slower: beyond that margin
    assert interleaving_pays(t * 0.01, option, gain=-1.0)  # -1 takes any interleaved cut that runs and fits
    assert not interleaving_pays(t * 0.01, None, gain=-1.0)


def test_auto_adopts_interleaving_only_when_predicted_clearly_faster(gpt: JobShape) -> None:
    pool = [cand("a", 1e11), cand("b", 2e11)]
    shape = _shape(gpt, 2, 4)
    plain = plan_placement(shape, pool)
    # on this model zero-bubble's cut is ahead of any even interleaved cut: auto keeps one per compnode
    option = best_interleaved(
        gpt.graph, [pool[1].device, pool[0].device], microbatches=4, batch_size=gpt.batch_size,
        optimizer=gpt.optimizer,
    )  # fmt: skip
    assert option is not None and plain.schedule is not None
    assert plain.chunks == 1 and plain.schedule.name != INTERLEAVED
    assert not interleaving_pays(plain.predicted_step, option)
    # a margin that lets a slower interleaving through (``--interleave-gain -1``): the interleaved cut
    shape = replace(shape, interleave_gain=-1.0)
    chosen = plan_placement(shape, pool)
    assert chosen.schedule is not None and chosen.schedule.name == INTERLEAVED
    assert chosen.chunks == option.chunks and chosen.policy == SCHEDULER
    assert chosen.peers == tuple(("b", "a")[s % 2] for s in range(2 * option.chunks))  # fastest first
    assert set(chosen.assignment.values()) == set(range(2 * option.chunks))
    assert chosen.predicted_step == pytest.approx(option.step_seconds)
    assert chosen.schedule.predicted[INTERLEAVED] == pytest.approx(option.step_seconds)
    assert plain.schedule.name in chosen.schedule.predicted  # what it was weighed against
    assert "interleaved-1f1b with" in chosen.schedule.why and "chunk counts tried" in chosen.schedule.why
    assert chosen.schedule.to_dict()["chunks"] == option.chunks
    assert f"({option.chunks} chunks per compnode)" in chosen.describe()
    # priced again as the broker re-prices a running placement: the same step
    assert predicted_step(shape, chosen, pool) == pytest.approx(chosen.predicted_step)
    # a named schedule is kept as named
    assert plan_placement(replace(shape, schedule="1f1b"), pool).chunks == 1
    # a misprediction re-plan over an interleaved placement counts each compnode once
    _, now = replanning.prediction_replan("j", shape, chosen, pool, 0.1, None, 10.0, 100)
    assert now == pytest.approx(chosen.predicted_step)
    # and so does the elastic join: the new compnode is offered beside the two, each once
    growth = consider_growth(shape, chosen, [*pool, cand("c", 1e11)], 0.0)
    assert growth is not None and growth.now == pytest.approx(chosen.predicted_step)
    assert set(growth.proposed.peers) <= {"a", "b", "c"}


def test_compnodes_get_the_chosen_chunks_in_their_spec() -> None:
    submitted, _, state = _figure3(2)
    graph = submitted.graph
    partition = build_partition(graph, balanced_assignment(graph, 4))
    ckpt = Checkpoint(0, state, {f"opt::{k}::exp_avg": torch.zeros(1) for k in graph.params})
    submitted.spec = submitted.spec.model_copy(update={"schedule": "auto"})
    requests = _requests(submitted, partition, ["pa", "pb", "pa", "pb"], ckpt, INTERLEAVED, 2)
    assert [(r.spec.schedule, r.spec.chunks, r.subdag) for r in requests] == [
        (INTERLEAVED, 2, s) for s in range(4)
    ]
    # the wire form validates: a compnode parses exactly this
    assert type(requests[0]).model_validate(requests[0].model_dump()).spec.chunks == 2
    plain = _requests(submitted, partition, ["pa", "pb", "pc", "pd"], ckpt, "1f1b", None)
    assert {(r.spec.schedule, r.spec.chunks) for r in plain} == {("1f1b", 1)}


def _requests(submitted, partition, peers, ckpt, schedule, chunks):  # type: ignore[no-untyped-def]
    prepared = iter_assignment_payloads(
        submitted, partition, peers, {}, 1, ckpt, schedule=schedule, chunks=chunks, stage_over=None
    )
    return [p.request for p in prepared]
