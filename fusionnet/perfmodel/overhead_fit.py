"""Fitting a device's fixed costs to measured sub-DAG times (pure: samples in, ``Overheads`` out).

The micro-benchmarks of ``profiling.microbench`` time each op class alone, in a loop of its own kind. In the
executor an op runs between other ops, other sub-DAGs, the channel and the event loop, with the
framework's code and data out of the caches, and it costs a different amount: on a 2-core x86 CPU a
3x3 max-pool of an 8x8 image costs 2x its looped time, while a small linear costs half. The
executor calibration (``fusionnet.profiling.calibration``) therefore runs synthetic models through
the real executor and this module fits the fixed costs to what it measured, by phase:

- FP per micro-batch ``= stage_fp + sum over ops (fixed_fp[class] + roofline / efficiency)``;
- BP per micro-batch ``= stage_bp + sum over ops a gradient reaches (fixed_bp[class] or, for a
  matmul/conv whose data input needs no gradient, fixed_bp_first[class]) + roofline / efficiency``;
- Update per step ``= stage_update + sum over parameter tensors per_tensor[optimizer] + FLOPs/bytes``.

The efficiencies (how close a large op gets to the roofline) stay those of the micro-benchmarks,
whose medium-sized inputs measure them well. The unknowns are solved by non-negative least squares
on relative residuals (a 20 us sub-DAG counts as much as a 2 ms one), made robust with Huber
weights. A class or optimizer the samples never exercise keeps the micro-benchmark's value.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

from fusionnet.perfmodel.fitting import HUBER_K, ROBUST_ROUNDS
from fusionnet.perfmodel.optimizers import optimizer_profile
from fusionnet.perfmodel.timing import bp_bytes, fp_bytes, update_bytes, update_flops
from fusionnet.perfmodel.types import OP_CLASSES, DeviceSpec, OpCost, Overheads

FIRST_LAYER_CLASSES = ("matmul", "conv")  # classes whose backward skips a kernel without an input gradient
_FITTED_CLASSES = tuple(c for c in OP_CLASSES if c != "other")  # "other" is priced like "elementwise"
PRIOR_WEIGHT = 0.01  # a prior row weighs like a 1% relative error per 100% departure from the prior
PRIOR_FLOOR = 1e-6  # seconds: departures from a prior below this are measured against 1 us


@dataclass(frozen=True)
class StageSample:
    """One sub-DAG run in the executor: its ops and the fastest measured seconds of each phase."""

    ops: tuple[OpCost, ...]
    needs_grad: tuple[bool, ...]  # per op: a gradient reaches it
    microbatches: int
    fp: float  # seconds per step (all micro-batches)
    bp: float
    update: float

    def __post_init__(self) -> None:
        if len(self.ops) != len(self.needs_grad) or not self.ops:
            raise ValueError("a stage sample needs at least one op and one needs_grad flag per op")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        for name in ("fp", "bp", "update"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"measured {name} seconds must be a finite number >= 0, got {value!r}")

    @property
    def has_backward(self) -> bool:
        return any(self.needs_grad)

    @property
    def has_update(self) -> bool:
        return any(op.param_bytes for op in self.ops)


def _class_of(op: OpCost) -> str:
    return "elementwise" if op.op_class == "other" else op.op_class


def _robust_nnls(a: np.ndarray, y: np.ndarray, prior_rows: int) -> np.ndarray:
    """Non-negative x minimising sum w_i (a_i x - y_i)^2, rows already scaled to relative residuals,
    with Huber weights re-estimated a few rounds so a preempted measurement does not pull the fit.
    The last ``prior_rows`` rows are the prior's and keep weight 1."""
    n = len(y) - prior_rows
    w = np.ones(len(y))
    x = np.zeros(a.shape[1])
    for _ in range(max(1, ROBUST_ROUNDS // 4)):
        sw = np.sqrt(w)
        x, _ = nnls(a * sw[:, None], y * sw, maxiter=50 * a.shape[1])
        r = (a @ x - y)[:n]
        mad = float(np.median(np.abs(r))) / 0.6745
        if mad <= 1e-12:
            break
        c = HUBER_K * mad
        w[:n] = np.where(np.abs(r) <= c, 1.0, c / np.maximum(np.abs(r), 1e-300))
    return x


def _solve(
    rows: list[tuple[dict[str, float], float, float]],
    columns: Sequence[str],
    prior: Mapping[str, float],
) -> dict[str, float] | None:
    """rows: (column -> coefficient, known seconds, measured seconds). Returns column -> fitted seconds
    for the columns some row uses (None when no row has a positive measurement to fit).

    ``prior`` (column -> the micro-benchmarks' value) adds one row per column pulling it towards that
    value with the weight of ``PRIOR_WEIGHT`` relative-error units: a class that only a few
    measurements exercise, or that always comes with the same other class, cannot then wander off to
    an absurd value that only happens to fit those."""
    used = [c for c in columns if any(r[0].get(c, 0.0) > 0 for r in rows)]
    rows = [r for r in rows if r[2] > 0]
    if not used or not rows:
        return None
    a = [[coef.get(c, 0.0) / measured for c in used] for coef, _k, measured in rows]
    y = [(measured - known) / measured for _coef, known, measured in rows]
    for j, c in enumerate(used):
        scale = max(prior.get(c, 0.0), PRIOR_FLOOR)
        a.append([PRIOR_WEIGHT / scale if k == j else 0.0 for k in range(len(used))])
        y.append(PRIOR_WEIGHT * prior.get(c, 0.0) / scale)
    return dict(zip(used, _robust_nnls(np.array(a), np.array(y), len(used)).tolist()))


def _roofline(op: OpCost, device: DeviceSpec, phase: str) -> float:
    eff = device.overheads.of(op.op_class).efficiency
    if phase == "fp":
        return (op.flops_fwd / device.speed + fp_bytes(op) / device.mem_bandwidth) / eff
    return (op.flops_bwd / device.speed + bp_bytes(op) / device.mem_bandwidth) / eff


def _phase_rows(
    samples: Sequence[StageSample],
    device: DeviceSpec,
    phase: str,
    column_of: Callable[[OpCost, bool], str | None],
) -> list[tuple[dict[str, float], float, float]]:
    rows = []
    for s in samples:
        if phase == "bp" and not s.has_backward:
            continue
        coef: dict[str, float] = {"stage": float(s.microbatches)}
        known = 0.0
        for op, grad in zip(s.ops, s.needs_grad):
            column = column_of(op, grad)
            if column is None:
                continue
            coef[column] = coef.get(column, 0.0) + s.microbatches
            known += s.microbatches * _roofline(op, device, phase)
        rows.append((coef, known, s.fp if phase == "fp" else s.bp))
    return rows


def _update_rows(
    samples: Sequence[StageSample], device: DeviceSpec
) -> list[tuple[dict[str, float], float, float]]:
    rows = []
    for s in samples:
        if not s.has_update:
            continue
        coef: dict[str, float] = {"stage": 1.0}
        known = 0.0
        for op in s.ops:
            if op.param_bytes:
                name = optimizer_profile(op.optimizer).name
                coef[name] = coef.get(name, 0.0) + op.tensors
                known += update_flops(op) / device.speed + update_bytes(op) / device.mem_bandwidth
        rows.append((coef, known, s.update))
    return rows


def fit_overheads(samples: Sequence[StageSample], device: DeviceSpec) -> Overheads:
    """``device.overheads`` with every fixed cost the samples exercise refitted to them (module
    docstring); efficiencies, speed and bandwidth are taken from ``device`` as they are."""
    if not samples:
        raise ValueError("fit_overheads: need at least one stage sample")
    base = device.overheads

    def fp_column(op: OpCost, _grad: bool) -> str:
        return _class_of(op)

    def bp_column(op: OpCost, grad: bool) -> str | None:
        if not grad:
            return None
        cls = _class_of(op)
        return f"{cls}/first" if cls in FIRST_LAYER_CLASSES and not op.input_grad else cls

    fp_prior = {"stage": base.stage_fp, **{c: base.of(c).fp for c in _FITTED_CLASSES}}
    fp = _solve(_phase_rows(samples, device, "fp", fp_column), tuple(fp_prior), fp_prior) or {}
    bp_prior = {
        "stage": base.stage_bp,
        **{c: base.of(c).bp for c in _FITTED_CLASSES},
        **{f"{c}/first": max(0.0, base.of(c).bp - base.of(c).bp_input) for c in FIRST_LAYER_CLASSES},
    }
    bp = _solve(_phase_rows(samples, device, "bp", bp_column), tuple(bp_prior), bp_prior) or {}
    names = sorted({optimizer_profile(op.optimizer).name for s in samples for op in s.ops if op.param_bytes})
    up_prior = {"stage": base.stage_update, **{n: base.tensor_update(n) for n in names}}
    up = _solve(_update_rows(samples, device), tuple(up_prior), up_prior) or {}

    classes = {}
    for cls in OP_CLASSES:
        old = base.of(cls)
        new_fp = fp.get(cls, old.fp)
        new_bp = bp.get(cls, old.bp)
        if cls in FIRST_LAYER_CLASSES and f"{cls}/first" in bp:
            first = bp[f"{cls}/first"]
            if cls not in bp:  # only first layers seen: keep the micro-benchmark's split
                new_bp = first + old.bp_input
            bp_input = max(0.0, new_bp - first)
        else:
            bp_input = min(old.bp_input, new_bp)
        classes[cls] = replace(old, fp=new_fp, bp=new_bp, bp_input=min(bp_input, new_bp))
    classes["other"] = classes["elementwise"]
    per_tensor = dict(base.update_tensor)
    per_tensor.update({name: up[name] for name in names if name in up})
    kernels = [v / optimizer_profile(k).kernels for k, v in per_tensor.items()]
    return replace(
        base,
        **classes,
        stage_fp=fp.get("stage", base.stage_fp),
        stage_bp=bp.get("stage", base.stage_bp),
        stage_update=up.get("stage", base.stage_update),
        update_tensor=tuple(per_tensor.items()),
        update_kernel=statistics.median(kernels) if kernels else base.update_kernel,
    )
