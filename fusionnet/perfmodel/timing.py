"""FusionAI eq. (1), (3) and (4): time of one op on one device, of a sub-DAG, of a pipeline.

Eq. (1) (after PALEO): ``T(f, p) = R(Pa(f)) + C(f, p) + W(f, p)`` with

- ``C = FLOPs(f) / S(p)``, ``S(p) = S*(p) * lambda_p``;
- ``W = bytes written / memory bandwidth`` and, for parents on the same device, ``R = bytes read /
  memory bandwidth``;
- for parents on another device ``R = alpha + beta * M`` over their link (``Link.time``). That part
  depends on the placement, so it is computed where the placement is known (``assignment.py``);
  the functions here give the local part.

Backward: ``flops_bwd / S(p)`` plus the traffic of reading the output gradient and the saved inputs
and writing the input gradients (``2 * bytes_read + bytes_written``). Ops that no gradient reaches
(see ``CostGraph.needs_grad``) have no backward. Update: the optimizer's per-element FLOPs and
traffic over the op's parameters (``optimizers.py``).

Small ops are dominated by what eq. (1) leaves out: the framework's fixed cost per op (dispatch,
autograd bookkeeping, kernel launch) and each op class's distance from the roofline (a tiny conv
runs at a few percent of peak). A device's ``Overheads`` add both: ``T = fixed(class) + (C + R + W) /
efficiency(class)``, plus a fixed cost per parameter tensor in Update. With the default (zero)
overheads the formulas are exactly PALEO's. The per-stage fixed costs (one forward call, one
backward call and one optimizer step per sub-DAG) are added where stages are known
(``stage_fixed_seconds``, used by ``assignment.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from fusionnet.errors import PlanError
from fusionnet.perfmodel.optimizers import PARAM_ELEMENT_BYTES, optimizer_profile
from fusionnet.perfmodel.types import DeviceSpec, Link, OpCost

PHASES = ("fp", "bp", "update")


def fp_bytes(op: OpCost) -> int:
    """Local memory traffic of one forward execution."""
    return op.bytes_read + op.bytes_written


def bp_bytes(op: OpCost) -> int:
    """Local memory traffic of one backward execution: read grad-out and saved inputs, write grad-in."""
    return 2 * op.bytes_read + op.bytes_written


def roofline_seconds(ops: Iterable[OpCost], speed: float, bandwidth: float) -> tuple[float, float]:
    """Eq. (1) forward and backward seconds of ``ops`` at ``speed`` FLOP/s and ``bandwidth`` B/s,
    without any fixed cost (what the micro-benchmarks compare measured times with)."""
    ops = list(ops)
    fp = sum(op.flops_fwd / speed + fp_bytes(op) / bandwidth for op in ops)
    bp = sum(op.flops_bwd / speed + bp_bytes(op) / bandwidth for op in ops)
    return fp, bp


def update_flops(op: OpCost) -> float:
    if op.param_bytes == 0:
        return 0.0
    return optimizer_profile(op.optimizer).flops_per_element * op.param_bytes / PARAM_ELEMENT_BYTES


def update_bytes(op: OpCost) -> int:
    if op.param_bytes == 0:
        return 0
    return optimizer_profile(op.optimizer).traffic_factor * op.param_bytes


def op_fp_seconds(op: OpCost, device: DeviceSpec) -> float:
    """Eq. (1) with all parents local: local R + C + W for one micro-batch (plus the op class's
    fixed cost and efficiency on this device)."""
    cls = device.overheads.of(op.op_class)
    roofline = op.flops_fwd / device.speed + fp_bytes(op) / device.mem_bandwidth
    return cls.fp + roofline / cls.efficiency


def op_bp_seconds(op: OpCost, device: DeviceSpec, needs_grad: bool = True) -> float:
    """Backward counterpart of eq. (1) for one micro-batch (0 when no gradient reaches the op)."""
    if not needs_grad:
        return 0.0
    cls = device.overheads.of(op.op_class)
    roofline = op.flops_bwd / device.speed + bp_bytes(op) / device.mem_bandwidth
    fixed = cls.bp if op.input_grad else max(0.0, cls.bp - cls.bp_input)
    return fixed + roofline / cls.efficiency


def op_update_seconds(op: OpCost, device: DeviceSpec) -> float:
    """One optimizer step over the op's parameters."""
    if op.param_bytes == 0:
        return 0.0
    fixed = op.tensors * device.overheads.tensor_update(op.optimizer)
    return fixed + update_flops(op) / device.speed + update_bytes(op) / device.mem_bandwidth


def stage_fixed_seconds(device: DeviceSpec, *, backward: bool, update: bool) -> tuple[float, float, float]:
    """(FP per micro-batch, BP per micro-batch, Update per step) fixed costs of running one sub-DAG on
    ``device``: one forward call, one backward call if a gradient reaches the stage, one optimizer
    step if it owns parameters."""
    oh = device.overheads
    return oh.stage_fp, oh.stage_bp if backward else 0.0, oh.stage_update if update else 0.0


def op_seconds(op: OpCost, device: DeviceSpec, phase: str = "fp", needs_grad: bool = True) -> float:
    if phase == "fp":
        return op_fp_seconds(op, device)
    if phase == "bp":
        return op_bp_seconds(op, device, needs_grad)
    if phase == "update":
        return op_update_seconds(op, device)
    raise PlanError(f"phase {phase!r} must be one of {', '.join(PHASES)}")


def remote_read_seconds(link: Link, nbytes: int) -> float:
    """R(Pa(f)) for a parent on another device: ``alpha + beta * M``."""
    return link.time(nbytes)


def subdag_time_bounds(ops: Iterable[OpCost], device: DeviceSpec, phase: str = "fp") -> tuple[float, float]:
    """Section 3.7: a sub-DAG's time lies in ``[max_i T(f_i, p), sum_i T(f_i, p)]`` — the max when all
    its ops could run in parallel, the sum when they run one after another."""
    times = [op_seconds(op, device, phase) for op in ops]
    if not times:
        return (0.0, 0.0)
    return (max(times), sum(times))


def _check_pairs(compute: Sequence[float], comm: Sequence[float]) -> None:
    if len(compute) != len(comm):
        raise PlanError(f"need one C_p per R_p: got {len(compute)} compute and {len(comm)} comm times")
    if not all(0 <= t < math.inf for t in (*compute, *comm)):  # also NaN, which compares false
        raise PlanError("compute and communication times must be finite and non-negative")


def latency_eq3(compute: Sequence[float], comm: Sequence[float]) -> float:
    """Eq. (3): FP latency of one batch through sequential sub-DAGs, ``sum_p (C_p + R_p)``."""
    _check_pairs(compute, comm)
    return float(sum(compute) + sum(comm))


def pipelined_eq4(compute: Sequence[float], comm: Sequence[float], n_batches: int) -> float:
    """Eq. (4): ``n_b`` batches pipelined, ``sum_p (C_p + R_p) + (n_b - 1) * max_p max(C_p, R_p)``.

    Computation and communication overlap, so the steady-state period is the slowest single
    resource (a device's compute or the link feeding it). For a chain whose stages and links keep a
    constant time per batch this is exact (a tandem of deterministic servers); the schedule
    simulator reproduces it.
    """
    _check_pairs(compute, comm)
    if not isinstance(n_batches, int) or n_batches < 1:
        raise PlanError(f"n_batches must be a positive integer, got {n_batches!r}")
    if not compute:
        return 0.0
    period = max(max(compute), max(comm))
    return latency_eq3(compute, comm) + (n_batches - 1) * period
