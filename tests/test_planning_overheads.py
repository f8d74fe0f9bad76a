"""A device's fixed costs (``Overheads``): validation, the timing formulas that use them, per-stage
costs in ``evaluate_assignment``, and the micro-benchmarks that measure them (short, cached)."""

from __future__ import annotations

import pytest

from fusionnet.errors import IRError, PlanError
from fusionnet.perfmodel.placement_cost import evaluate_assignment
from fusionnet.perfmodel.timing import op_bp_seconds, op_fp_seconds, op_update_seconds
from fusionnet.perfmodel.types import (
    OP_CLASSES,
    ClassCost,
    CostGraph,
    DeviceSpec,
    OpCost,
    Overheads,
    Swarm,
    Workload,
)
from fusionnet.profiling import microbench as overheads_mod
from tests.planning_support import device

OH = Overheads(
    matmul=ClassCost(fp=10e-6, bp=30e-6, efficiency=0.5, bp_input=12e-6),
    pool=ClassCost(fp=5e-6, bp=2e-6, efficiency=0.05),
    stage_fp=7e-6,
    stage_bp=40e-6,
    stage_update=60e-6,
    update_tensor=(("adam", 25e-6),),
    update_kernel=2e-6,
)


def dev(overheads: Overheads = OH) -> DeviceSpec:
    return device("cpu", flops=1e10, memory=1 << 30, mem_bandwidth=1e9, disk=1 << 30, overheads=overheads)


def linear(name: str = "lin", *, input_grad: bool = True, opt: str = "adam") -> OpCost:
    return OpCost(name, "parametric", 10**6, 2 * 10**6, 1000, 1000, 4000, 1000, opt, "matmul", 2, input_grad)


def test_overheads_validate_round_trip_and_scale() -> None:
    assert Overheads.from_dict(OH.to_dict()) == OH
    assert set(OH.to_dict()) >= set(OP_CLASSES)
    half = OH.scaled(2.0)
    assert half.matmul.fp == pytest.approx(5e-6) and half.matmul.efficiency == 0.5
    assert half.stage_bp == pytest.approx(20e-6) and half.tensor_update("adam") == pytest.approx(12.5e-6)
    # optimizers without a timing fall back to kernels x the per-kernel cost
    assert OH.tensor_update("sgd_momentum") == pytest.approx(3 * 2e-6)
    with pytest.raises(PlanError, match="efficiency"):
        ClassCost(efficiency=0.0)
    with pytest.raises(PlanError, match="stage_fp"):
        Overheads(stage_fp=-1.0)
    with pytest.raises(PlanError, match="malformed"):
        Overheads.from_dict({"matmul": {"fp": "x"}})
    with pytest.raises(PlanError, match="op class"):
        OH.of("nonsense")
    with pytest.raises(IRError, match="op_class"):
        OpCost("x", "parametric", 1, 1, 1, 1, 0, 1, None, "nonsense")


def test_timing_adds_fixed_costs_and_divides_by_efficiency() -> None:
    d = dev()
    op = linear()
    roof_fp = 10**6 / 1e10 + 2000 / 1e9
    assert op_fp_seconds(op, d) == pytest.approx(10e-6 + roof_fp / 0.5)
    roof_bp = 2 * 10**6 / 1e10 + 3000 / 1e9
    assert op_bp_seconds(op, d) == pytest.approx(30e-6 + roof_bp / 0.5)
    # a first layer skips its input gradient's fixed cost
    assert op_bp_seconds(linear(input_grad=False), d) == pytest.approx(18e-6 + roof_bp / 0.5)
    assert op_bp_seconds(op, d, needs_grad=False) == 0.0
    plain = op_update_seconds(op, dev(Overheads()))
    assert op_update_seconds(op, d) == pytest.approx(plain + 2 * 25e-6)
    # the device running twice as fast halves every term
    assert op_fp_seconds(op, d.scaled(2.0)) == pytest.approx(op_fp_seconds(op, d) / 2)


def test_stages_pay_one_call_per_micro_batch_and_one_optimizer_step() -> None:
    ops = (
        OpCost("x", "placeholder", 0, 0, 0, 1000, 0, 1000),
        linear("a"),
        OpCost("p", "non_parametric", 1000, 1000, 1000, 1000, 0, 1000, None, "pool"),
    )
    g = CostGraph(ops, (("x", "a", 1000), ("a", "p", 1000)))
    swarm = Swarm((dev(), dev()))
    w = Workload(microbatches=3, task="train")
    cost = evaluate_assignment(g, swarm, w, {"x": 0, "a": 0, "p": 1})
    s0, s1 = cost.stages
    assert s0.fp == pytest.approx(7e-6 + op_fp_seconds(ops[0], dev()) + op_fp_seconds(ops[1], dev()))
    assert s1.update == 0.0  # no parameters, no optimizer step
    assert s0.update == pytest.approx(60e-6 + op_update_seconds(ops[1], dev()))
    assert s1.bp == pytest.approx(40e-6 + op_bp_seconds(ops[2], dev()))
    assert cost.compute_seconds(1) == pytest.approx(3 * (s1.fp + s1.bp))
    infer = evaluate_assignment(g, swarm, Workload(3, "infer"), {"x": 0, "a": 0, "p": 1})
    assert infer.stages[1].bp == 0.0 and infer.stages[0].update == 0.0


@pytest.mark.timeout(180)
def test_measure_overheads_is_quick_sane_and_cached(tmp_path, monkeypatch) -> None:
    first = overheads_mod.profile_overheads(5e10, 1e10, 0.2, tmp_path)
    for name in OP_CLASSES:
        c = first.of(name)
        assert c.fp >= 0 and c.bp >= 0 and 0.02 <= c.efficiency <= 20.0
    assert first.stage_fp > 0 and first.stage_bp > 0 and first.stage_update > 0
    assert {name for name, _ in first.update_tensor} == set(overheads_mod.TIMED_OPTIMIZERS)
    # something a small op pays for: well above a nanosecond, well below a millisecond
    assert 1e-7 < first.matmul.fp + first.stage_fp < 1e-3

    def no_measuring(*_args):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(overheads_mod, "measure_overheads", no_measuring)
    assert overheads_mod.profile_overheads(5e10, 1e10, 0.2, tmp_path) == first
    with pytest.raises(AssertionError, match="cache"):  # another speed: another cache entry
        overheads_mod.profile_overheads(6e10, 1e10, 0.2, tmp_path)
