"""Memory accounting per sub-DAG and the cost of whole assignments."""

from __future__ import annotations

import pytest

from fusionnet.errors import PartitionError, PlanError
from fusionnet.perfmodel.memory import MemoryDemand, inflight_microbatches, stage_memory
from fusionnet.perfmodel.placement_cost import evaluate_assignment, stage_order
from fusionnet.perfmodel.timing import op_bp_seconds, op_fp_seconds
from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, OpCost, Swarm, Workload

MiB = 1 << 20


def dev(name, kind="gpu", gpu=1024 * MiB, cpu=1024 * MiB, disk=4096 * MiB, flops=1e12):
    return DeviceSpec(
        name=name,
        kind=kind,
        peak_flops=flops,
        mem_bandwidth=1e11,
        d_gpu=gpu if kind == "gpu" else 0,
        d_cpu=cpu,
        d_disk=disk,
    )


def pop(name, params_mib, act_mib, opt="adam"):
    return OpCost(
        name,
        "parametric",
        10**9,
        2 * 10**9,
        act_mib * MiB,
        act_mib * MiB,
        params_mib * MiB,
        act_mib * MiB,
        opt,
    )


@pytest.mark.parametrize(
    ("opt", "factor"), [("sgd", 0), ("sgd_momentum", 1), ("adam", 2), ("adamw", 2), ("adagrad", 1)]
)
def test_train_memory_counts_params_grads_and_optimizer_state(opt, factor):
    ops = [pop("a", 10, 3, opt), pop("b", 6, 1, opt)]
    mem = stage_memory(
        ops, Workload(4, "train", "gpipe"), stage_index=0, num_stages=2, in_bytes=MiB, out_bytes=2 * MiB
    )
    assert mem.params == 16 * MiB and mem.grads == 16 * MiB
    assert mem.optimizer_state == factor * 16 * MiB
    assert mem.inflight == 4 and mem.activations == 4 * 4 * MiB  # GPipe stashes every micro-batch
    assert mem.staging == 2 * 3 * MiB
    gpu = mem.demand("gpu")
    assert gpu == MemoryDemand(gpu=mem.resident, cpu=mem.staging, disk=16 * MiB * (1 + factor))
    cpu = mem.demand("cpu")
    assert cpu.gpu == 0 and cpu.cpu == mem.resident + mem.staging and cpu.disk == gpu.disk


def test_grad_and_infer_drop_what_they_do_not_need():
    ops = [pop("a", 10, 3)]
    grad = stage_memory(ops, Workload(4, "grad"), stage_index=0, num_stages=1)
    assert grad.grads == 10 * MiB and grad.optimizer_state == 0
    infer = stage_memory(ops, Workload(4, "infer"), stage_index=0, num_stages=1)
    assert (
        infer.grads == 0
        and infer.optimizer_state == 0
        and infer.inflight == 1
        and infer.activations == 3 * MiB
    )


def test_inflight_under_1f1b_decreases_along_the_pipeline():
    w = Workload(3, "train", "1f1b")
    assert [inflight_microbatches(w, k, 5) for k in range(5)] == [3, 3, 3, 2, 1]
    g = Workload(3, "train", "gpipe")
    assert [inflight_microbatches(g, k, 5) for k in range(5)] == [3] * 5
    with pytest.raises(PlanError):
        inflight_microbatches(w, 5, 5)


def test_violation_names_resource_and_device():
    d = dev("small", gpu=10 * MiB)
    assert MemoryDemand(gpu=5 * MiB, cpu=0, disk=0).fits(d)
    why = MemoryDemand(gpu=12 * MiB, cpu=0, disk=0).violation(d)
    assert why is not None and "d_gpu" in why and "'small'" in why and "12.00 MiB" in why


def diamond() -> CostGraph:
    x = OpCost("x", "placeholder", 0, 0, 0, MiB, 0, MiB)
    return CostGraph(
        (x, pop("a", 4, 1), pop("b", 4, 2), pop("c", 4, 1)),
        (("x", "a", MiB), ("a", "b", MiB), ("a", "c", MiB), ("b", "c", 2 * MiB)),
    )


def test_evaluate_assignment_stages_transfers_and_times():
    g = diamond()
    devs = (dev("d0"), dev("d1", flops=2e12), dev("d2"))
    link = Link.from_bandwidth(1e-3, 1e9)
    swarm = Swarm(devs, {}, link)
    w = Workload(2, "train", "gpipe")
    cost = evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "b": 1, "c": 2})
    assert [s.device for s in cost.stages] == [0, 1, 2]
    # a's output goes once to d1 and once to d2; b's to d2: three messages on three links
    pairs = {(t.src, t.dst): t for t in cost.transfers}
    assert set(pairs) == {(0, 1), (0, 2), (1, 2)}
    assert pairs[(0, 1)].nbytes == MiB and pairs[(1, 2)].nbytes == 2 * MiB
    assert pairs[(0, 2)].fwd == pytest.approx(link.time(MiB))
    assert cost.stages[1].fp == pytest.approx(op_fp_seconds(g.ops[2], devs[1]))
    assert cost.stages[1].bp == pytest.approx(op_bp_seconds(g.ops[2], devs[1]))
    assert cost.stages[2].recv_fwd == pytest.approx(link.time(MiB) + link.time(2 * MiB))
    assert cost.stages[0].memory.inflight == 2
    # makespan: the largest stage compute or link busy time
    computes = [cost.compute_seconds(i) for i in range(3)]
    assert cost.makespan == pytest.approx(max([*computes, *cost.link_loads.values()]))
    assert cost.step_seconds >= cost.makespan - 1e-12


def test_evaluate_assignment_refuses_cycles_and_bad_maps():
    g = diamond()
    swarm = Swarm((dev("d0"), dev("d1")), {}, Link(alpha=0.0, beta=0.0))
    w = Workload(1, "train")
    with pytest.raises(PartitionError, match="cyclic"):
        evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "b": 1, "c": 0})
    with pytest.raises(PartitionError, match="not assigned"):
        evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "b": 1})
    with pytest.raises(PartitionError, match="device index"):
        evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "b": 1, "c": 7})
    with pytest.raises(PartitionError, match="unknown ops"):
        evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "b": 1, "c": 1, "zz": 0})
    assert stage_order(g, [1, 1, 0, 0]) == [1, 0]


def test_interleaved_inflight_is_what_its_order_holds():
    """interleaved-1f1b is charged, per stage, the micro-batches its own order holds at once (4, 3, 2, 1
    for p = 2 devices x v = 2 chunks x m = 8), not m on every chunk, which refused cuts that fit."""
    from fusionnet.schedules import INTERLEAVED, check, make_schedule

    work = Workload(8, "train", INTERLEAVED, 2)
    got = [inflight_microbatches(work, s, 4) for s in range(4)]
    assert got == [4, 3, 2, 1] == list(check(make_schedule(INTERLEAVED, 4, 8, "train", 2)).peak_inflight)
    assert [inflight_microbatches(Workload(8, "infer", INTERLEAVED, 2), s, 4) for s in range(4)] == [1] * 4
