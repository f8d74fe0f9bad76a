"""Planning on traced example graphs: IR -> cost graph, scheduler plans that build_partition accepts,
infeasible swarms refused naming the constraint, determinism, predictions of a given partition."""

from __future__ import annotations

import pytest

from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.errors import PlanError
from fusionnet.job.loader import load_job
from fusionnet.perfmodel.types import Link
from fusionnet.planning.costgraph import cost_graph, op_class
from fusionnet.planning.optimizers import job_optimizers, optimizer_profile_name
from fusionnet.planning.planner import plan_graph
from fusionnet.planning.predict import predict_subdags
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO
from tests.planning_support import OVERHEADS, GiB, device


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple]:
    out = {}
    for name in ("mlp", "figure3", "gpt"):
        job = load_job(REPO / "examples" / name / "job.yaml")
        out[name] = (job, trace_job(job).graph)
    return out


@pytest.mark.timeout(120)
def test_cost_graph_folds_placeholders_and_variables_into_their_first_user(traced) -> None:
    job, graph = traced["gpt"]
    cg = cost_graph(graph, job_optimizers(job, graph))
    kinds = {n.name: n.kind for n in graph.nodes}
    assert all(kinds[op.name] in ("parametric", "non_parametric", "loss") for op in cg.ops)
    assert len(cg.ops) == sum(k in ("parametric", "non_parametric", "loss") for k in kinds.values())
    # every parameter byte is owned by exactly one op: the tied embedding, traded as rows to its lookup
    # (``dag.row_lookup``), by its dense user (the LM head), where the partition keeps it
    assert sum(op.param_bytes for op in cg.ops) == sum(int(n.cost.get("param_bytes", 0)) for n in graph.nodes)
    assert {op.optimizer for op in cg.ops if op.param_bytes} == {"adamw"}
    lookup, head = graph.node("var_wte_weight").users
    assert cg.ops[cg.index[head]].param_bytes >= graph.node("var_wte_weight").cost["param_bytes"]
    assert cg.ops[cg.index[lookup]].param_bytes == 0
    # the first layer's data input needs no gradient; later ops' do
    assert not cg.ops[cg.index["embedding"]].input_grad and cg.ops[cg.index["linear"]].input_grad


def test_op_classes_and_optimizer_names(traced) -> None:
    _, fig3 = traced["figure3"]
    _, gpt = traced["gpt"]
    classes = {n.name: op_class(n) for g in (fig3, gpt) for n in g.nodes if n.cost}
    assert classes["conv2d"] == "conv" and classes["max_pool2d"] == "pool" and classes["linear"] == "matmul"
    assert classes["cross_entropy"] == "loss" and classes["embedding"] == "gather"
    assert classes["transpose"] == "view" and classes["add"] == "elementwise" and classes["softmax"] == "norm"
    assert optimizer_profile_name("SGD", {"momentum": 0.9}) == "sgd_momentum"
    assert optimizer_profile_name("SGD", {}) == "sgd" and optimizer_profile_name("AdamW", {}) == "adamw"
    job, graph = traced["mlp"]
    assert set(job_optimizers(job, graph).values()) == {"sgd_momentum"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["mlp", "figure3", "gpt"])
def test_plan_is_a_partition_build_partition_accepts(traced, name: str) -> None:
    job, graph = traced[name]
    devices = [device(f"d{i}", flops=f) for i, f in enumerate((2e10, 5e10, 1e11, 3e10))]
    planned = plan_graph(
        graph, devices, microbatches=2, optimizer=job_optimizers(job, graph), links=Link(0.0, 0.0)
    )
    assert set(planned.assignment) == {n.name for n in graph.nodes}  # every node, output included
    k = len(planned.devices)
    assert sorted(set(planned.assignment.values())) == list(range(k))
    partition = build_partition(graph, planned.assignment)
    assert partition.assignment == planned.assignment  # labels are already build_partition's order
    assert [s.compnode for s in partition.subdags] == list(range(k))
    assert len(set(planned.devices)) == k and all(0 <= d < len(devices) for d in planned.devices)
    assert sorted(planned.predicted_seconds) == list(range(k))
    assert all(t > 0 for t in planned.predicted_seconds.values())
    assert planned.predicted_step_seconds >= max(planned.predicted_seconds.values()) * 0.999
    assert "predicted step time" in planned.explanation
    # placeholders sit with their first user (labels with the loss that reads them), as in Table 3
    for n in graph.nodes:
        if n.kind == "placeholder":
            assert planned.assignment[n.name] == planned.assignment[n.users[0]]


@pytest.mark.timeout(120)
def test_free_links_and_slow_devices_spread_a_big_model(traced) -> None:
    _job, graph = traced["gpt"]
    devices = [device(f"d{i}", flops=1e8) for i in range(3)]
    planned = plan_graph(graph, devices, microbatches=4, links=Link(0.0, 0.0), max_devices=3)
    assert len(planned.devices) >= 2  # pipelining pays when compute dominates and links are free
    one = plan_graph(graph, devices, microbatches=4, links=Link(0.0, 0.0), max_devices=1)
    assert len(one.devices) == 1 and one.predicted_step_seconds > planned.predicted_step_seconds


@pytest.mark.timeout(120)
def test_planning_is_deterministic(traced) -> None:
    job, graph = traced["figure3"]
    devices = [device(f"d{i}", flops=1e9 * (i + 1), overheads=OVERHEADS) for i in range(3)]
    kwargs = {"microbatches": 2, "optimizer": job_optimizers(job, graph), "links": {(0, 1): Link(1e-3, 1e-9)}}
    a, b = plan_graph(graph, devices, **kwargs), plan_graph(graph, devices, **kwargs)
    assert a.assignment == b.assignment and a.devices == b.devices
    assert a.predicted_seconds == b.predicted_seconds and a.explanation == b.explanation


@pytest.mark.timeout(120)
def test_infeasible_swarms_raise_plan_error_naming_the_constraint(traced) -> None:
    _job, graph = traced["gpt"]
    with pytest.raises(PlanError, match="no devices"):
        plan_graph(graph, [], microbatches=2)
    tiny = [device(f"d{i}", memory=64 << 10) for i in range(2)]  # 64 KiB each
    with pytest.raises(PlanError, match=r"d_cpu|computing memory"):
        plan_graph(graph, tiny, microbatches=2, optimizer="adamw")
    # enough memory in total but not on max_devices of them
    small = [device(f"d{i}", memory=300 << 10) for i in range(8)]
    with pytest.raises(PlanError, match=r"max_devices=1|needs"):
        plan_graph(graph, small, microbatches=2, optimizer="adamw", max_devices=1)
    with pytest.raises(PlanError, match="microbatches"):
        plan_graph(graph, small, microbatches=0)


@pytest.mark.timeout(120)
def test_broker_device_specs_plan(traced) -> None:
    from fusionnet.broker.registry import CompnodeEntry
    from fusionnet.dht.records import CompnodeRecord, HardwareInfo, NodeState

    peers = (
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM",
    )
    entries = [
        CompnodeEntry(
            record=CompnodeRecord(
                peer_id=peer,
                state=NodeState.ONLINE,
                hardware=HardwareInfo(
                    device_kind="cpu",
                    device_name="test cpu",
                    peak_flops=1e11,
                    speed_factor=0.5,
                    d_cpu=8 * GiB,
                    d_disk=32 * GiB,
                    mem_bandwidth=1e10,
                ),
            ),
            expires_at=100.0,
            first_seen=0.0,
            last_seen=0.0,
        )
        for peer in peers
    ]
    job, graph = traced["mlp"]
    planned = plan_graph(
        graph, [e.device_spec() for e in entries], microbatches=2, optimizer=job_optimizers(job, graph)
    )
    build_partition(graph, planned.assignment)
    assert planned.plan.stages[0].device_name in peers


@pytest.mark.timeout(120)
def test_predict_subdags_of_a_balanced_partition(traced) -> None:
    job, graph = traced["figure3"]
    opt = job_optimizers(job, graph)
    whole = build_partition(graph, balanced_assignment(graph, 1))
    split = build_partition(graph, balanced_assignment(graph, 3))
    dev = device(overheads=OVERHEADS)
    one = predict_subdags(graph, whole, [dev], microbatches=2, optimizer=opt)
    three = predict_subdags(graph, split, [dev], microbatches=2, optimizer=opt)
    assert sorted(three) == [0, 1, 2] and all(t > 0 for t in three.values())
    # the same ops plus two more sub-DAGs' fixed costs (calls, optimizer steps)
    assert sum(three.values()) > one[0]
    faster = predict_subdags(graph, split, [dev.scaled(2.0)], microbatches=2, optimizer=opt)
    assert faster == pytest.approx({i: t / 2 for i, t in three.items()})
    with pytest.raises(PlanError, match="one device per sub-DAG"):
        predict_subdags(graph, split, [dev, dev], microbatches=2)
