"""A compnode's announced memory (D_cpu) follows its sandbox budget (``--sandbox-memory-gb``): the broker
plans into D_cpu, and a node started with ``--sandbox-memory-gb 0.08`` announced the host's 23.54 GiB, so
``placement.schedule`` / ``data.microbatches`` ``auto`` said "fits in memory" and the job died of the
cap."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.compnode import daemon as compnode_daemon
from fusionnet.compnode.daemon import CompnodeConfig, CompnodeDaemon
from fusionnet.dht.records import HardwareInfo
from fusionnet.profiling import node

GiB = 2**30
HOST = 32 * GiB  # a stand-in host RAM, so the tests do not depend on this machine's


def _hardware(kind: str = "cpu") -> HardwareInfo:
    return HardwareInfo(
        device_kind=kind, device_name=kind, peak_flops=1e11, speed_factor=0.5, d_cpu=HOST, threads=1
    )


@pytest.fixture
def host_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "host_memory_bytes", lambda: HOST)


def test_the_announced_memory_is_the_budget_below_the_hosts_ram(host_ram: None) -> None:
    budget = int(0.08 * GiB)
    assert node.announced_cpu_memory("cpu", budget) == budget
    assert node.announced_cpu_memory("cpu", None) == HOST  # no sandbox: the whole RAM
    assert node.announced_cpu_memory("cpu", 64 * GiB) == HOST  # a budget over the RAM buys nothing
    # CUDA: the data limit is not applied there (it maps its own address space), so D_cpu stays the RAM
    assert node.announced_cpu_memory("cuda", budget) == HOST


def test_a_budget_is_what_a_cpu_compnode_lets_a_job_use() -> None:
    assert CompnodeConfig(sandbox_memory_gb=0.08).job_memory_bytes() == int(0.08 * GiB)
    assert CompnodeConfig(sandbox=False, sandbox_memory_gb=0.08).job_memory_bytes() is None  # no worker
    default = CompnodeConfig()  # the sandbox's default budget: 90 % of the RAM
    assert default.job_memory_bytes() == int(0.9 * compnode_daemon._physical_memory_gb() * GiB)


def test_the_profile_caps_d_cpu_to_the_budget_measured_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_ram: None
) -> None:
    measured: list[str] = []

    def measure(device: str, threads: int | None, state_dir: Path) -> HardwareInfo:
        measured.append(device)
        return _hardware()

    monkeypatch.setattr(node, "measure", measure)
    budget = int(0.08 * GiB)
    assert node.profile_hardware(tmp_path, job_memory_bytes=budget).d_cpu == budget
    # from the cache: the cap is this start's flag, not the machine's (a start without it sees the RAM)
    assert node.profile_hardware(tmp_path, job_memory_bytes=budget).d_cpu == budget
    assert node.profile_hardware(tmp_path).d_cpu == HOST
    assert measured == ["cpu"]


@pytest.mark.timeout(60)
def test_a_compnode_with_a_sandbox_budget_announces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_ram: None
) -> None:
    """``CompnodeDaemon.on_startup`` up to its services, on a stand-in daemon: the hardware it announces
    says the budget, not the host's RAM."""
    monkeypatch.setattr(node, "measure", lambda device, threads, state_dir: _hardware())

    class Started(Exception):
        pass

    class StandIn:
        settings = CompnodeConfig(sandbox_memory_gb=0.08)
        state_dir = SimpleNamespace(path=tmp_path)
        config = SimpleNamespace(refresh_period=1.0)
        hardware: HardwareInfo | None = None
        calibrated = asyncio.Event()
        _calibrating = False

        async def _metrics_address(self) -> None:
            return None

        async def announce_now(self) -> None:
            pass

        def every(self, *args: Any) -> None:
            pass

        def _start_calibration(self, hardware: HardwareInfo) -> asyncio.Future[HardwareInfo]:
            done: asyncio.Future[HardwareInfo] = asyncio.get_running_loop().create_future()
            done.set_result(hardware)
            return done

        def _set_hardware(self, hardware: HardwareInfo) -> None:
            self.hardware = hardware

        async def start_services(self) -> None:
            raise Started

    stand_in = StandIn()
    with pytest.raises(Started):
        asyncio.run(CompnodeDaemon.on_startup(stand_in))  # type: ignore[arg-type]
    assert stand_in.hardware is not None and stand_in.hardware.d_cpu == int(0.08 * GiB)
