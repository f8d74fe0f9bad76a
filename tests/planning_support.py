"""Devices and candidates the planning tests share (no tests here)."""

from __future__ import annotations

from fusionnet.broker.placement import Candidate
from fusionnet.perfmodel.types import ClassCost, DeviceSpec, Overheads

GiB = 1 << 30


def device(name: str = "dev", *, flops: float = 1e11, memory: int = 8 * GiB, **kw) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        kind="cpu",
        peak_flops=flops,
        speed_factor=1.0,
        mem_bandwidth=1e10,
        d_gpu=0,
        d_cpu=memory,
        d_disk=64 * GiB,
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
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        peak_flops=1e11,
        mem_bandwidth=4e10,
        d_gpu=0,
        d_cpu=1 << 33,
        d_disk=1 << 33,
        overheads=overheads,
    )


def cand(peer: str, flops: float | None = 1e11, backup: bool = False) -> Candidate:
    return Candidate(peer, backup, None if flops is None else device(peer, flops=flops))
