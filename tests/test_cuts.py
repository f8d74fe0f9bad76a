"""The job's own cuts (``placement.cuts``): resolved on the IR as pure functions, checked where a job is
submitted, honoured by the broker's placement and by ``fusionnet run --local`` (exact against plain
PyTorch). ``fusionnet plan`` of such a job is in ``test_cli_plan.py``, a swarm run in
``test_swarm_jobs.py``."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from fusionnet.broker.submission import check_submission
from fusionnet.dag.cuts import cut_assignment, cut_positions, piece_work
from fusionnet.dag.partition import build_partition
from fusionnet.errors import JobError, PartitionError, PlanError
from fusionnet.job.loader import load_job
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.jobwire import RunSpec
from fusionnet.perfmodel.types import Workload
from fusionnet.planning import cut_plan
from fusionnet.planning.costgraph import cost_graph
from fusionnet.planning.cut_plan import plan_cuts
from fusionnet.planning.placement import CUTS, SCHEDULER, Candidate, JobShape, plan_placement, predicted_step
from fusionnet.planning.scheduler import plan_for_assignment
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.prepare import prepare_job
from fusionnet.runtime.submit import submission_payload
from tests.jobfiles import example_job
from tests.planning_support import cand, device

BLOCKS = ("blocks.1", "ln_f")  # the bundled GPT: embeddings + block 0 | block 1 | final norm + head
SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
TOL = 1e-5


def _ops(shape: JobShape) -> list[str]:
    return [n.name for n in shape.graph.nodes if n.kind not in ("placeholder", "variable", "output")]


def _modules(graph, partition, index: int) -> set[str]:
    """The modules whose parameters sub-DAG ``index`` reads (``blocks.1``, ``ln_f``, ...)."""
    keys = [k for n in partition.subdags[index].nodes for k in graph.node(n).param_keys()]
    return {".".join(k.split(".")[:2]) if k.startswith("blocks.") else k.split(".")[0] for k in keys}


def test_module_cuts_begin_a_sub_dag_at_each_module(gpt: JobShape) -> None:
    partition = build_partition(gpt.graph, cut_assignment(gpt.graph, BLOCKS))
    assert len(partition.subdags) == 3
    assert _modules(gpt.graph, partition, 0) == {"wpe", "blocks.0"}
    assert _modules(gpt.graph, partition, 1) == {"blocks.1"}
    assert _modules(gpt.graph, partition, 2) == {
        "wte",
        "ln_f",
    }  # the tied embedding's variable: with its first user


def test_pieces_are_contiguous_runs_of_the_op_order(gpt: JobShape) -> None:
    assignment = cut_assignment(gpt.graph, ("blocks.0.attn", "blocks.0.fc", "blocks.1", "ln_f"))
    labels = [assignment[name] for name in _ops(gpt)]
    assert labels == sorted(labels) and sorted(set(labels)) == [0, 1, 2, 3, 4]
    leaves = [n.name for n in gpt.graph.nodes if n.kind in ("placeholder", "variable")]
    assert leaves and all(assignment[name] in range(5) for name in leaves)


def test_an_op_name_cuts_where_its_module_does(gpt: JobShape) -> None:
    ops = _ops(gpt)
    positions = cut_positions(gpt.graph, BLOCKS)
    by_name = [ops[p] for p in positions]
    assert gpt.graph.node(by_name[0]).param_keys()[0].startswith("blocks.1.")
    assert cut_assignment(gpt.graph, by_name) == cut_assignment(gpt.graph, BLOCKS)
    mixed = (by_name[0], "ln_f")
    assert cut_assignment(gpt.graph, mixed) == cut_assignment(gpt.graph, BLOCKS)


@pytest.mark.parametrize(
    ("cuts", "message"),
    [
        (
            ("lm.h.1", "ln_f"),
            r"placement\.cuts\[0\] 'lm\.h\.1' names no op of the traced graph and no module "
            r"with parameters \(modules: wte, wpe, blocks, blocks\.0",
        ),
        (
            ("ln_f", "blocks.1"),
            r"placement\.cuts\[1\] 'blocks\.1' begins at op #\d+ \(layer_norm_2\), not after "
            r"placement\.cuts\[0\] 'ln_f'",
        ),
        (("blocks.1", "blocks.1"), r"placement\.cuts\[1\] 'blocks\.1' begins at op #\d+ .* not after"),
        (
            ("size", "ln_f"),
            r"placement\.cuts\[0\] 'size' begins at the graph's first op \(size\): sub-DAG 0 "
            r"would be empty",
        ),
    ],
)
def test_a_cut_that_cannot_be_is_refused_by_its_index(
    gpt: JobShape, cuts: tuple[str, ...], message: str
) -> None:
    with pytest.raises(PartitionError, match=message):
        cut_assignment(gpt.graph, cuts)


def test_the_run_spec_carries_as_many_cuts_as_sub_dags_less_one() -> None:
    doc = {"name": "j", "task": "grad", "batch_size": 4, "microbatches": 2, "steps": 1, "n_samples": 8}
    assert RunSpec.parse({**doc, "compnodes": 3, "cuts": list(BLOCKS)}).cuts == list(BLOCKS)
    assert RunSpec.parse({**doc, "compnodes": 3}).cuts == []  # an older submitter sends none
    with pytest.raises(JobError, match=r"cuts: 2 cut\(s\) for 2 sub-DAGs"):
        RunSpec.parse({**doc, "compnodes": 2, "cuts": list(BLOCKS)})
    with pytest.raises(JobError, match="cuts"):
        RunSpec.parse({**doc, "compnodes": 2, "cuts": [""]})


@pytest.mark.timeout(120)
def test_a_submission_whose_cuts_miss_the_ir_is_refused_on_both_sides(tmp_path: Path) -> None:
    path = example_job("gpt", tmp_path, steps=1, cuts=["blocks.1", "ln_f"])
    bad = example_job("gpt", tmp_path / "bad", steps=1, cuts=["blocks.7", "ln_f"])
    try:
        payload = submission_payload(load_job(path))
        with pytest.raises(JobError, match=r"^placement\.cuts\[0\] 'blocks\.7' names no op"):
            submission_payload(load_job(bad))
    finally:
        path.unlink()
        bad.unlink()
    from fusionnet.dag.codec import decode_ir

    graph = decode_ir(payload.ir)
    state = unpack_tensors(payload.state, "state")
    data = unpack_tensors(payload.data, "data")
    check_submission(graph, state, data, payload.spec)
    forged = payload.spec.model_copy(
        update={"cuts": ["blocks.1", "nope"]}
    )  # a submitter that skips the check
    with pytest.raises(JobError, match=r"submission: placement\.cuts\[1\] 'nope' names no op"):
        check_submission(graph, state, data, forged)


def test_the_broker_places_the_jobs_cuts_on_the_fastest_compnodes(gpt: JobShape) -> None:
    shape = replace(gpt, cuts=BLOCKS)
    pool = [cand("slow", 5e10), cand("fast", 2e11), cand("mid", 1e11), cand("spare", 1e10)]
    placement = plan_placement(shape, pool)
    assert placement.policy == CUTS and placement.peers == ("fast", "mid", "slow")
    assert placement.assignment == cut_assignment(gpt.graph, BLOCKS)
    assert placement.predicted is not None and set(placement.predicted) == {0, 1, 2}
    assert placement.predicted_step == pytest.approx(predicted_step(shape, placement, pool), rel=1e-9)
    assert placement.schedule is not None and placement.schedule.name == "gpipe"
    # compnodes that announced no hardware: the same cuts, unpriced
    unknown = plan_placement(shape, [cand("x", None), cand("y", None), cand("z", None)])
    assert unknown.policy == CUTS and unknown.assignment == placement.assignment
    assert unknown.predicted_step is None


def test_the_heaviest_piece_goes_to_the_fastest_compnode(gpt: JobShape) -> None:
    """Pieces of unequal work: the block's MLP and the next block in the middle, the embeddings and one
    attention first, the final norm and a 41-token head last. Matched by work, the middle piece gets the
    fastest compnode, and the model predicts that order faster than piece i on the i-th fastest."""
    cuts = ("blocks.0.ln2", "ln_f")
    shape = replace(gpt, cuts=cuts)
    work = piece_work(gpt.graph, cut_assignment(gpt.graph, cuts), 3)
    assert work[1] > work[0] > work[2]
    pool = [cand("slow", 2e10), cand("fast", 2e11), cand("mid", 1e11)]
    placement = plan_placement(shape, pool)
    assert placement.policy == CUTS and placement.peers == ("mid", "fast", "slow")
    in_speed_order = replace(placement, peers=("fast", "mid", "slow"))
    assert placement.predicted_step < predicted_step(shape, in_speed_order, pool)
    # equal compnodes: nothing to match, piece i on the i-th in the pool's order
    assert plan_placement(shape, [cand("a"), cand("b"), cand("c")]).peers == ("a", "b", "c")


def test_fewer_compnodes_than_the_cuts_need_are_cut_by_the_policy(gpt: JobShape) -> None:
    """After a loss with no backup, the job goes on over the survivors: the cuts make too many sub-DAGs
    for them, so the performance model cuts the graph for as many as are left."""
    shape = replace(gpt, cuts=BLOCKS)
    placement = plan_placement(shape, [cand("a"), cand("b")], stages=2)
    assert placement.policy == SCHEDULER and len(placement.peers) == 2
    assert set(placement.assignment.values()) == {0, 1}


def test_auto_chooses_a_schedule_for_the_cut_but_never_recuts_it(gpt: JobShape) -> None:
    """``schedule: auto`` prices the schedules on the job's cut; interleaving would cut the graph again
    into p x chunks even pieces, so a job with its own cuts is never interleaved, however much faster."""
    shape = replace(gpt, wanted=2, cuts=("blocks.1",), schedule="auto", interleave_gain=-1.0)  # any gain
    placement = plan_placement(shape, [cand("a"), cand("b")])
    assert placement.policy == CUTS and placement.assignment == cut_assignment(gpt.graph, ("blocks.1",))
    assert placement.schedule is not None and placement.schedule.name in ("gpipe", "1f1b", "zero-bubble")
    assert placement.chunks == 1
    free = plan_placement(replace(shape, cuts=()), [cand("a"), cand("b")])
    assert free.chunks > 1  # the same job without cuts does interleave at that margin


def test_interleaved_chunks_at_the_jobs_cuts(gpt: JobShape) -> None:
    cuts = ("blocks.0.fc", "blocks.1", "blocks.1.fc")
    shape = replace(gpt, wanted=2, cuts=cuts, schedule="interleaved-1f1b", chunks=2)
    placement = plan_placement(shape, [cand("a", 1e11), cand("b", 2e11)])
    assert placement.policy == CUTS and placement.peers == ("b", "a", "b", "a")
    assert placement.assignment == cut_assignment(gpt.graph, cuts)
    assert placement.predicted_step is not None and placement.chunks == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("placement", "cuts"),
    [
        ({"compnodes": 3, "schedule": "1f1b"}, ["blocks.1", "ln_f"]),
        ({"compnodes": 2, "schedule": "interleaved-1f1b", "chunks": 2}, ["blocks.0.fc", "blocks.1", "ln_f"]),
    ],
)
def test_run_local_at_the_jobs_cuts_equals_plain_pytorch(
    placement: dict, cuts: list[str], tmp_path: Path
) -> None:
    path = example_job("gpt", tmp_path, steps=2, optimizer=SGD, microbatches=4, cuts=cuts, **placement)
    try:
        job = load_job(path)
        prepared = prepare_job(job)
        want = cut_assignment(prepared.traced.graph, cuts)
        ops = [
            n.name for n in prepared.traced.graph.nodes if n.kind not in ("placeholder", "variable", "output")
        ]
        assert [prepared.partition.assignment[op] for op in ops] == [want[op] for op in ops]
        got = run_local(load_job(path), placement["compnodes"])
        ref = run_reference(load_job(path))
        with pytest.raises(
            JobError, match=r"^placement\.cuts: \d cut\(s\) make \d sub-DAGs, this run asks for"
        ):
            prepare_job(job, placement["compnodes"] + 1)
    finally:
        path.unlink()
    assert (
        max((got.weights[k].double() - ref.weights[k].double()).abs().max().item() for k in ref.weights)
        <= TOL
    )
    assert max(abs(a["loss"] - b) for a, b in zip(got.metrics, ref.losses)) <= 1e-5


def test_cuts_no_order_of_the_compnodes_can_hold_are_refused(gpt: JobShape) -> None:
    cut = cut_assignment(gpt.graph, ("blocks.1",))
    tiny = [device(f"tiny{i}", memory=64 << 10, disk=0) for i in range(2)]
    with pytest.raises(
        PlanError, match=r"placement\.cuts: no 2 of the 2 device\(s\) hold the pieces: stage \d"
    ):
        plan_cuts(gpt.graph, tiny, cut, microbatches=2, batch_size=8, optimizer=gpt.optimizer)
    with pytest.raises(PlanError, match=r"placement\.cuts make 2 sub-DAGs, but there are 1 device"):
        plan_cuts(gpt.graph, [device()], cut, microbatches=2)
    planned = plan_cuts(gpt.graph, [device("a"), device("b")], cut, microbatches=2, optimizer=gpt.optimizer)
    assert planned.devices == [0, 1]
    # equal devices: one order of them, and the order matched by work (the pieces' work differs)
    assert "cut at placement.cuts; devices chosen from 2 orders priced (every one there is)" in (
        planned.explanation
    )


def _priced(gpt: JobShape, devices: list, cut: dict[str, int], order: tuple[int, ...]) -> float:
    """The predicted step of piece i on ``devices[order[i]]``; infinity when it does not fit."""
    cg = cost_graph(gpt.graph, gpt.optimizer, microbatches=2)
    swarm = cut_plan.make_swarm([devices[d] for d in order], None, None)
    try:
        ops = {op.name: cut[op.name] for op in cg.ops}
        plan = plan_for_assignment(cg, swarm, Workload(2, gpt.graph.task, "gpipe"), ops)
    except PlanError:
        return float("inf")
    return plan.predicted_step_seconds


def _best_of_every_order(gpt: JobShape, devices: list, cut: dict[str, int]) -> float:
    """The brute force: every order of k of ``devices`` priced, the fastest that fits."""
    k = max(cut.values()) + 1
    return min(_priced(gpt, devices, cut, order) for order in itertools.permutations(range(len(devices)), k))


def test_the_pieces_get_the_fastest_order_of_any_k_compnodes(gpt: JobShape) -> None:
    """Few compnodes: every order of k of them is priced, so the answer is the brute force's."""
    cut = cut_assignment(gpt.graph, ("blocks.0.ln2", "ln_f"))
    devices = [
        device("a", flops=2e10),
        device("b", flops=2e11),
        device("c", flops=1e11),
        device("d", flops=7e10),
    ]
    planned = plan_cuts(gpt.graph, devices, cut, microbatches=2, optimizer=gpt.optimizer)
    assert planned.predicted_step_seconds == pytest.approx(_best_of_every_order(gpt, devices, cut), rel=1e-9)
    assert len(set(planned.devices)) == 3 and 0 not in planned.devices  # the slowest one sits out
    assert "devices chosen from 24 orders priced (every one there is)" in planned.explanation


def test_a_fast_compnode_too_small_for_any_piece_sits_out(gpt: JobShape) -> None:
    """The two fastest cannot hold the cut (the fastest has no room), so the pieces go to two that can:
    the broker looks beyond the k fastest, and so does ``fusionnet plan``."""
    shape = replace(gpt, wanted=2, cuts=("blocks.1",))
    tiny = device("fast", flops=4e11, memory=64 << 10, disk=0)
    pool = [Candidate("fast", False, tiny), cand("mid", 1e11), cand("slow", 5e10)]
    placement = plan_placement(shape, pool)
    assert placement.policy == CUTS and set(placement.peers) == {"mid", "slow"}
    assert placement.predicted_step == pytest.approx(predicted_step(shape, placement, pool), rel=1e-9)


@pytest.mark.parametrize("budget", [3, 40, 1000])
def test_many_compnodes_are_searched_by_a_climb_that_finds_room(
    gpt: JobShape, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More orders than the budget prices: a hill-climb from the speed order, the order matched by work
    and the roomiest devices. Ranked by the bytes they lack first, it climbs out of orders that do not
    fit, and it never ends slower than where it started."""
    monkeypatch.setattr(cut_plan, "SEARCH_BUDGET", budget)
    cut = cut_assignment(gpt.graph, ("blocks.0.ln2", "ln_f"))
    devices = [
        device("fast", flops=4e11, memory=64 << 10, disk=0),
        device("quick", flops=3e11, memory=64 << 10, disk=0),
        *(device(f"d{i}", flops=(i + 1) * 1e10) for i in range(4)),
    ]
    planned = plan_cuts(gpt.graph, devices, cut, microbatches=2, optimizer=gpt.optimizer)
    assert sorted(planned.devices) == [3, 4, 5]  # the three fastest that have room
    every = "from 120 orders priced (every one there is)"  # 6 kinds of device, 3 pieces: 6 x 5 x 4
    assert (every in planned.explanation) == (budget >= 120)
    assert ("(a hill-climb from three starts)" in planned.explanation) == (budget < 120)
    speed_order_with_room = _priced(gpt, devices, cut, (5, 4, 3))
    assert speed_order_with_room < float("inf")
    assert planned.predicted_step_seconds <= speed_order_with_room * (1 + 1e-9)
