"""Memory a sub-DAG needs, split into the D_gpu / D_cpu / D_disk demands of problem (2).

What is counted for a stage (sum over its ops):

- parameters (``param_bytes``);
- gradients, same size as the parameters, for ``train`` and ``grad``;
- optimizer state for ``train``: parameters x the optimizer's state factor (SGD 0, SGD with momentum
  1, Adam/AdamW 2, ...; ``optimizers.py``);
- activations kept for backward: the stage's activation bytes per micro-batch times the micro-batches
  in flight on it. GPipe runs every forward before any backward, so all ``m`` micro-batches are in
  flight on every stage; 1F1B (PipeDream-flush) lets stage ``k`` of ``S`` (0-based) hold at most
  ``min(m, S - k)``. Inference keeps no activations between micro-batches: one is live at a time;
- communication staging: a received and a sent micro-batch, double-buffered (``2 * (in + out)``).

Where each lands:

- a ``gpu`` device computes from GPU memory: parameters, gradients, optimizer state and activations
  are on D_gpu; network buffers are in host memory (D_cpu) because messages arrive there first;
- a ``cpu`` device keeps everything in D_cpu;
- D_disk holds the stage's checkpoint (parameters, plus optimizer state when training), which is what
  a replacement or backup compnode restores from.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from fusionnet.errors import PlanError
from fusionnet.perfmodel.optimizers import optimizer_profile
from fusionnet.perfmodel.types import DeviceSpec, OpCost, Workload
from fusionnet.schedules import INTERLEAVED, ScheduleError, check, make_schedule

GiB = 1 << 30


def fmt_bytes(n: float) -> str:
    """Human-readable bytes for messages and tables (binary units)."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryDemand:
    """Bytes a stage needs of each of a device's memories."""

    gpu: int
    cpu: int
    disk: int

    def violation(self, device: DeviceSpec) -> str | None:
        """The first constraint of problem (2) this demand breaks on ``device``, as text; None if it fits."""
        for field, have in (("gpu", device.d_gpu), ("cpu", device.d_cpu), ("disk", device.d_disk)):
            need = getattr(self, field)
            if need > have:
                return (
                    f"needs {fmt_bytes(need)} of d_{field} but device {device.name!r} has {fmt_bytes(have)}"
                )
        return None

    def fits(self, device: DeviceSpec) -> bool:
        return self.violation(device) is None

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """The parts of a stage's memory, before placing them on a device's memories."""

    params: int
    grads: int
    optimizer_state: int
    activations: int  # kept for backward, all in-flight micro-batches
    staging: int  # communication buffers
    inflight: int  # micro-batches whose activations are held at the peak

    @property
    def resident(self) -> int:
        """What the computing memory must hold."""
        return self.params + self.grads + self.optimizer_state + self.activations

    def checkpoint(self) -> int:
        return self.params + self.optimizer_state

    def demand(self, device_kind: str) -> MemoryDemand:
        """Where each part lands on a device of this kind (module docstring)."""
        if device_kind == "gpu":
            return MemoryDemand(gpu=self.resident, cpu=self.staging, disk=self.checkpoint())
        if device_kind == "cpu":
            return MemoryDemand(gpu=0, cpu=self.resident + self.staging, disk=self.checkpoint())
        raise PlanError(f"device kind {device_kind!r} must be 'gpu' or 'cpu'")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def inflight_microbatches(workload: Workload, stage_index: int, num_stages: int) -> int:
    """Micro-batches whose activations stage ``stage_index`` (0-based, pipeline order) holds at peak."""
    if not 0 <= stage_index < num_stages:
        raise PlanError(f"stage index {stage_index} is outside a {num_stages}-stage pipeline")
    if not workload.backward:
        return 1
    if workload.schedule == "1f1b":
        return min(workload.microbatches, num_stages - stage_index)
    if workload.schedule == "zero-bubble":  # ZB-H1: every stage holds up to p (W is deferred)
        return min(workload.microbatches, num_stages)
    if workload.schedule == INTERLEAVED and workload.chunks > 1:
        peaks = _interleaved_peaks(num_stages, workload.microbatches, workload.task, workload.chunks)
        if peaks is not None:
            return peaks[stage_index]
    return workload.microbatches


@functools.lru_cache(maxsize=64)
def _interleaved_peaks(stages: int, microbatches: int, task: str, chunks: int) -> tuple[int, ...] | None:
    """Per stage, the most micro-batches interleaved-1f1b holds at once, from its order itself (a device's
    later chunks hold fewer: stage 0 about p + v, the last one 1, where charging m each would refuse cuts
    that fit); None where the order cannot be made (the refusal is the schedule check's to give)."""
    try:
        return check(make_schedule(INTERLEAVED, stages, microbatches, task, chunks)).peak_inflight
    except ScheduleError:
        return None


def optimizer_state_bytes(op: OpCost) -> int:
    return optimizer_profile(op.optimizer).state_factor * op.param_bytes if op.param_bytes else 0


def stage_memory(
    ops: Iterable[OpCost],
    workload: Workload,
    *,
    stage_index: int,
    num_stages: int,
    in_bytes: int = 0,
    out_bytes: int = 0,
) -> MemoryBreakdown:
    """Memory of one stage holding ``ops``; ``in_bytes``/``out_bytes`` are what it receives from and
    sends to other stages per micro-batch (forward direction)."""
    params = acts = opt = 0
    for op in ops:
        params += op.param_bytes
        acts += op.activation_bytes
        if workload.update:
            opt += optimizer_state_bytes(op)
    inflight = inflight_microbatches(workload, stage_index, num_stages)
    return MemoryBreakdown(
        params=params,
        grads=params if workload.backward else 0,
        optimizer_state=opt,
        activations=acts * inflight,
        staging=2 * (in_bytes + out_bytes),
        inflight=inflight,
    )
