"""Eq. (1), (3), (4) and the sub-DAG bounds, checked against hand computations."""

from __future__ import annotations

import math

import pytest

from fusionnet.errors import IRError, PlanError
from fusionnet.perfmodel.optimizers import optimizer_profile
from fusionnet.perfmodel.timing import (
    latency_eq3,
    op_bp_seconds,
    op_fp_seconds,
    op_seconds,
    op_update_seconds,
    pipelined_eq4,
    subdag_time_bounds,
)
from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, OpCost, Swarm, Workload

DEV = DeviceSpec(
    name="dev",
    kind="gpu",
    peak_flops=2e12,
    speed_factor=0.5,
    mem_bandwidth=1e11,
    d_gpu=1 << 30,
    d_cpu=1 << 30,
    d_disk=1 << 30,
)


def op(
    name="f",
    fwd=10**12,
    bwd=2 * 10**12,
    read=4 * 10**8,
    written=10**8,
    params=4 * 10**6,
    act=10**8,
    opt="adam",
):
    return OpCost(name, "parametric", fwd, bwd, read, written, params, act, opt if params else None)


def test_eq1_forward_is_compute_plus_local_read_and_write():
    f = op()
    # S(p) = 2e12 * 0.5 = 1e12 -> C = 1 s; R + W = (4e8 + 1e8) / 1e11 = 5 ms
    assert op_fp_seconds(f, DEV) == pytest.approx(1.0 + 0.005)


def test_backward_reads_saved_inputs_and_grad_out_and_writes_grad_in():
    f = op()
    # 2e12 / 1e12 = 2 s; traffic 2*4e8 + 1e8 = 9e8 bytes -> 9 ms
    assert op_bp_seconds(f, DEV) == pytest.approx(2.009)
    assert op_bp_seconds(f, DEV, needs_grad=False) == 0.0


def test_update_time_follows_the_optimizer_profile():
    f = op(params=4 * 10**6, opt="adam")
    prof = optimizer_profile("adam")
    elems = 10**6  # fp32
    expected = prof.flops_per_element * elems / 1e12 + (3 + 2 * 2) * 4 * 10**6 / 1e11
    assert op_update_seconds(f, DEV) == pytest.approx(expected)
    assert op_update_seconds(op(params=0), DEV) == 0.0
    sgd = op_update_seconds(op(opt="sgd"), DEV)
    assert sgd < op_update_seconds(op(opt="sgd_momentum"), DEV) < op_update_seconds(f, DEV)


def test_optimizer_state_factors():
    assert optimizer_profile("sgd").state_factor == 0
    assert optimizer_profile("SGD+momentum").state_factor == 1
    assert optimizer_profile("adam").state_factor == 2
    assert optimizer_profile("adamw").state_factor == 2
    assert optimizer_profile(None).name == "sgd"
    with pytest.raises(PlanError, match="no cost profile"):
        optimizer_profile("magic")


def test_subdag_bounds_are_max_and_sum():
    ops = [op("a", fwd=10**12), op("b", fwd=3 * 10**12), op("c", fwd=2 * 10**12)]
    lo, hi = subdag_time_bounds(ops, DEV, "fp")
    times = [op_fp_seconds(o, DEV) for o in ops]
    assert lo == pytest.approx(max(times)) and hi == pytest.approx(sum(times))
    assert subdag_time_bounds([], DEV) == (0.0, 0.0)
    assert subdag_time_bounds(ops, DEV, "bp")[1] == pytest.approx(sum(op_seconds(o, DEV, "bp") for o in ops))
    with pytest.raises(PlanError, match="phase"):
        op_seconds(ops[0], DEV, "sideways")


def test_eq3_and_eq4_by_hand():
    c, r = [1.0, 2.0, 0.5], [0.0, 0.3, 4.0]
    assert latency_eq3(c, r) == pytest.approx(7.8)
    # n_b = 10: 7.8 + 9 * max(2.0, 4.0)
    assert pipelined_eq4(c, r, 10) == pytest.approx(7.8 + 9 * 4.0)
    assert pipelined_eq4(c, r, 1) == pytest.approx(latency_eq3(c, r))
    with pytest.raises(PlanError):
        pipelined_eq4(c, r[:2], 3)
    with pytest.raises(PlanError):
        pipelined_eq4(c, r, 0)
    with pytest.raises(PlanError):
        latency_eq3([-1.0], [0.0])


def test_link_alpha_beta_and_lookup():
    link = Link.from_bandwidth(0.01, 1e9)
    assert link.time(0) == 0.0
    assert link.time(10**9) == pytest.approx(1.01)
    assert link.bandwidth == pytest.approx(1e9)
    fast = Link(alpha=0.0, beta=1e-12)
    swarm = Swarm((DEV, DEV.__class__(**{**DEV.__dict__, "name": "dev2"})), {(0, 1): fast}, link)
    assert swarm.link(0, 1) is fast and swarm.link(1, 0) is fast  # one direction given serves both
    assert not swarm.uniform_links
    with pytest.raises(PlanError, match="links key"):
        Swarm((DEV,), {(0, 0): fast}, link)
    with pytest.raises(PlanError, match="non-negative"):
        Link(alpha=-1.0, beta=0.0)
    with pytest.raises(PlanError, match="finite"):
        Link(alpha=math.nan, beta=0.0)


def test_types_refuse_bad_values_naming_the_field():
    with pytest.raises(IRError, match="flops_fwd"):
        OpCost("x", "parametric", -1, 0, 0, 0, 0, 0)
    with pytest.raises(IRError, match="kind"):
        OpCost("x", "weird", 0, 0, 0, 0, 0, 0)
    with pytest.raises(PlanError, match=r"op 'x'.*optimizer"):
        OpCost("x", "parametric", 0, 0, 0, 0, 4, 0, "nope")
    a, b = op("a"), op("b")
    with pytest.raises(IRError, match="twice"):
        CostGraph((a, a), ())
    with pytest.raises(IRError, match="unknown op 'z'"):
        CostGraph((a, b), (("a", "z", 1),))
    with pytest.raises(IRError, match="topological"):
        CostGraph((a, b), (("b", "a", 1),))
    with pytest.raises(PlanError, match="speed_factor"):
        DeviceSpec(
            name="d",
            kind="gpu",
            peak_flops=1.0,
            speed_factor=0.0,
            mem_bandwidth=1.0,
            d_gpu=1,
            d_cpu=1,
            d_disk=1,
        )
    with pytest.raises(PlanError, match="d_gpu > 0"):
        DeviceSpec(name="d", kind="gpu", peak_flops=1.0, mem_bandwidth=1.0, d_gpu=0, d_cpu=1, d_disk=1)
    with pytest.raises(PlanError, match="task"):
        Workload(2, "fly")
    with pytest.raises(PlanError, match="microbatches"):
        Workload(0, "train")
    with pytest.raises(PlanError, match="schedule"):
        Workload(1, "train", "zigzag")


def test_graph_helpers():
    x = OpCost("x", "placeholder", 0, 0, 0, 8, 0, 8)
    m = OpCost("mask", "non_parametric", 1, 1, 8, 8, 0, 8)
    a, b = op("a"), op("b")
    g = CostGraph((x, m, a, b), (("x", "mask", 8), ("x", "a", 8), ("mask", "b", 8), ("a", "b", 16)))
    assert g.preds[3] == (1, 2) and g.succs[0] == (1, 2)
    assert g.needs_grad == (False, False, True, True)  # nothing upstream of a parameter gets a gradient
    assert g.out_bytes == (8, 8, 16, 0)
    assert not g.is_chain
    chain = CostGraph((x, a, b), (("x", "a", 8), ("a", "b", 8)))
    assert chain.is_chain
