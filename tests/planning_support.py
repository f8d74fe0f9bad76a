"""Devices and candidates the planning tests share (no tests here)."""

from __future__ import annotations

from typing import Any

from fusionnet.perfmodel.types import ClassCost, DeviceSpec, Overheads
from fusionnet.planning.placement import Candidate

GiB = 1 << 30


def device(
    name: str = "dev",
    *,
    flops: float = 1e11,
    memory: int = 8 * GiB,
    mem_bandwidth: float = 1e10,
    disk: int = 64 * GiB,
    **kw: Any,
) -> DeviceSpec:
    """A CPU compnode for the planning and performance-model tests (``kw``: overheads, ...)."""
    return DeviceSpec(
        name=name,
        kind="cpu",
        peak_flops=flops,
        speed_factor=1.0,
        mem_bandwidth=mem_bandwidth,
        d_gpu=0,
        d_cpu=memory,
        d_disk=disk,
        **kw,
    )


OVERHEADS = Overheads(
    view=ClassCost(fp=2e-6, bp=4e-6),
    elementwise=ClassCost(fp=8e-6, bp=10e-6, efficiency=0.7),
    matmul=ClassCost(fp=15e-6, bp=35e-6, efficiency=0.9, bp_input=5e-6),
    stage_fp=10e-6,
    stage_bp=40e-6,
    stage_update=70e-6,
    update_tensor=(("adam", 30e-6),),
    update_kernel=3e-6,
)


def fitting_device(overheads: Overheads) -> DeviceSpec:
    """The CPU the overhead fit and the calibration tests price on."""
    return device("cpu", memory=1 << 33, mem_bandwidth=4e10, disk=1 << 33, overheads=overheads)


def cand(peer: str, flops: float | None = 1e11, backup: bool = False) -> Candidate:
    return Candidate(peer, backup, None if flops is None else device(peer, flops=flops))
