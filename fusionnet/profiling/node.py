"""Profiling this machine for its hardware record (FusionAI 3.3 and 3.7): D_gpu, D_cpu, D_disk, the nominal
peak S*(p) and the scaling-down factor λp = measured / peak from a short timed matmul.

The result is cached in the state dir (``hardware_profile.json``) keyed by what it depends on (device,
thread count, CPU model, torch version), so a restart does not pay for profiling again; disk and memory
sizes are re-read every time since they change.

torch is imported lazily: the daemon must fork its DHT child before torch starts any thread.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from fusionnet import __version__
from fusionnet.dht.records import HardwareInfo

log = logging.getLogger("fusionnet.profiling.node")

CACHE_FILE = "hardware_profile.json"
_MATMUL_N = 256  # small enough that a call fits in a scheduler time slice under contention
_MIN_SECONDS = 0.25


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flops_per_cycle() -> int:
    """fp32 FLOPs per cycle per core from the vector extensions (FMA counts 2): a nominal figure, which is
    what S*(p) is; λp absorbs the gap to reality."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 8
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    if "avx512f" in flags:
        return 64
    if "avx2" in flags and "fma" in flags:
        return 32
    if "avx" in flags:
        return 16
    if platform.machine() in ("aarch64", "arm64"):
        return 16  # NEON: 2 x 4-lane FMA
    return 8


def _cpu_max_hz() -> float:
    try:
        khz = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text().strip()
        return float(khz) * 1e3
    except (OSError, ValueError):
        pass
    try:
        mhz = [
            float(line.split(":", 1)[1])
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("cpu MHz")
        ]
        if mhz:
            return max(mhz) * 1e6
    except (OSError, ValueError):
        pass
    return 2.0e9


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def announced_cpu_memory(device_kind: str, job_memory_bytes: int | None) -> int:
    """D_cpu as announced: the host's RAM, or less when a job may use less of it. ``job_memory_bytes``:
    the sandbox worker's budget (``--sandbox-memory-gb``), which ``worker_process.apply_limits`` grants a
    job as ``RLIMIT_DATA`` = the worker's data at start + the budget, so a job's parameters, optimizer
    state and activations get the budget and no more. The planner fits sub-DAGs into D_cpu: announcing
    the host's RAM there planned a 23 GiB node with an 80 MiB budget as if the job fitted, and it died of
    the cap. Only on CPU devices, the only ones that limit applies to (CUDA maps its own address space)."""
    host = host_memory_bytes()
    if job_memory_bytes is None or device_kind != "cpu":
        return host
    return min(host, job_memory_bytes) if host else job_memory_bytes


def _timed(fn: Any, sync: Any, min_seconds: float) -> tuple[int, float]:
    """(1, the fastest single call) over at least ``min_seconds`` of calls. The fastest, not the mean:
    compnodes often start side by side and profile at the same moment, and other processes only ever
    slow a call down, so the best call is what the device can do (a mean measured under such
    contention once gave one of three identical nodes a tenth of the others' speed)."""
    fn()
    sync()  # warm-up (allocations, kernel selection)
    iterations, start, best = 0, time.perf_counter(), float("inf")
    while True:
        t0 = time.perf_counter()
        fn()
        sync()
        now = time.perf_counter()
        best = min(best, now - t0)
        iterations += 1
        if now - start >= min_seconds and iterations >= 3:
            return 1, best


def measure(device: str, threads: int | None, disk_path: Path) -> HardwareInfo:
    """Runs the profiling: about half a second."""
    import torch

    if threads is not None:
        # The daemon profiles in a worker thread (asyncio.to_thread), and MKL's thread count is per
        # thread: without this, a ``--threads 1`` node timed its matmul on every core (1.7 cores busy on
        # a 2-core machine) while its sub-DAGs run on one, and announced a speed that was off by the
        # core count, or by 10x when the cores were contended (the threads then wait for each other).
        torch.set_num_threads(threads)
    from fusionnet.dag.devices import device_memory_bytes, resolve_device

    dev = resolve_device(device)
    syncs = {"cuda": lambda: torch.cuda.synchronize(dev), "mps": torch.mps.synchronize}
    sync = syncs.get(dev.type, lambda: None)
    n = _MATMUL_N if dev.type == "cpu" else 4096
    a = torch.randn(n, n, device=dev, generator=None)
    b = torch.randn(n, n, device=dev)
    out = torch.empty(n, n, device=dev)
    iters, seconds = _timed(lambda: torch.mm(a, b, out=out), sync, _MIN_SECONDS)
    measured_flops = 2.0 * n**3 * iters / seconds
    src = torch.empty(16 * 2**20 // 4 * (1 if dev.type == "cpu" else 16), device=dev)
    dst = torch.empty_like(src)
    iters, seconds = _timed(lambda: dst.copy_(src), sync, _MIN_SECONDS / 2)
    mem_bandwidth = 2.0 * src.numel() * src.element_size() * iters / seconds  # read + write
    n_threads = threads or torch.get_num_threads()
    if dev.type != "cpu":
        name = torch.cuda.get_device_properties(dev).name if dev.type == "cuda" else "Apple MPS"
        d_gpu = device_memory_bytes(dev)
        # No portable peak figure from torch: take the measurement as nominal (λ = 1), and say so.
        peak = measured_flops
        log.info("no nominal peak known for %s: using the measured %.3g FLOPS as S*(p)", name, peak)
    else:
        name, d_gpu = cpu_model(), 0
        peak = n_threads * _cpu_max_hz() * _cpu_flops_per_cycle()
    return HardwareInfo(
        device_kind=dev.type,
        device_name=name,
        peak_flops=peak,
        speed_factor=min(10.0, measured_flops / peak),
        d_gpu=d_gpu,
        d_cpu=host_memory_bytes(),
        d_disk=shutil.disk_usage(disk_path).free,
        mem_bandwidth=mem_bandwidth,
        threads=n_threads,
    )


def profile_hardware(
    state_dir: Path,
    *,
    device: str = "cpu",
    threads: int | None = None,
    refresh: bool = False,
    job_memory_bytes: int | None = None,
) -> HardwareInfo:
    """The hardware record for this node: from the cache when it matches, else measured (and cached).
    ``job_memory_bytes``: what a job may allocate here (the sandbox's budget), announced as D_cpu when it
    is below the host's RAM (``announced_cpu_memory``)."""
    hw = _profile_hardware(state_dir, device=device, threads=threads, refresh=refresh)
    # Applied to what is returned, never cached: the budget is a flag of this start, not of the machine.
    return hw.model_copy(update={"d_cpu": announced_cpu_memory(hw.device_kind, job_memory_bytes)})


def _profile_hardware(state_dir: Path, *, device: str, threads: int | None, refresh: bool) -> HardwareInfo:
    import torch

    key = {
        "device": device,
        "threads": threads or torch.get_num_threads(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "fusionnet": __version__,
        "method": "fastest-call-own-threads",  # a profile taken by an older method is measured again
    }
    cache = state_dir / CACHE_FILE
    if not refresh and cache.exists():
        try:
            doc = json.loads(cache.read_text())
            if not isinstance(doc, dict):
                raise TypeError(f"a JSON {type(doc).__name__}, not an object")
            if doc.get("key") == key:
                hw = HardwareInfo.model_validate(doc["hardware"])
                log.info("hardware profile from cache %s", cache)
                return hw.model_copy(
                    update={"d_cpu": host_memory_bytes(), "d_disk": shutil.disk_usage(state_dir).free}
                )
            log.info("hardware profile cache %s is for another set-up; profiling again", cache)
        except (OSError, ValueError, KeyError, TypeError) as e:  # OSError: a folder there, unreadable
            log.warning("ignoring unreadable hardware profile cache %s: %s", cache, e)
    start = time.perf_counter()
    hw = measure(device, threads, state_dir)
    log.info(
        "profiled %s (%s, %s threads) in %.2f s: S*=%.3g FLOPS, λ=%.3f, S=%.3g FLOPS, memory %.3g B/s",
        hw.device_name, hw.device_kind, hw.threads, time.perf_counter() - start,
        hw.peak_flops, hw.speed_factor, hw.flops, hw.mem_bandwidth,
    )  # fmt: skip
    tmp = cache.with_suffix(".tmp")
    try:
        tmp.write_text(
            json.dumps({"key": key, "hardware": hw.model_dump(mode="json")}, indent=1, sort_keys=True)
        )
        tmp.replace(cache)
    except OSError as e:  # the next start profiles again; this one goes on with what it measured
        log.warning("cannot cache the hardware profile in %s: %s", cache, e)
    return hw


def profile_software_overheads(hw: HardwareInfo, state_dir: Path) -> HardwareInfo:
    """``hw`` with the fixed per-op costs of this node's software stack, which dominate small ops and
    which the broker's planner adds to eq. (1): the micro-benchmarks of ``microbench``
    refined by the executor calibration (``calibration``: synthetic models through the real
    executor). About 1.5 s at the first start, then cached in the state dir next to the hardware
    profile; CPU nodes only (both run on the CPU). A failure costs only precision: the record goes
    out without them."""
    if hw.device_kind != "cpu":
        return hw
    import torch

    # Lazy, like torch above: importing the calibration starts torch, and the daemon imports this
    # module before it forks its DHT child.
    from fusionnet.perfmodel.types import DeviceSpec
    from fusionnet.profiling.calibration import CalibrationStopped, calibrated_overheads
    from fusionnet.profiling.microbench import profile_overheads

    if hw.threads:
        torch.set_num_threads(hw.threads)  # this runs in a worker thread too: see ``measure``
    start = time.perf_counter()
    try:
        base = profile_overheads(hw.flops, hw.mem_bandwidth, 0.5, cache_dir=state_dir)
        device = DeviceSpec(
            name=hw.device_name,
            kind="cpu",
            peak_flops=hw.peak_flops,
            speed_factor=hw.speed_factor,
            mem_bandwidth=hw.mem_bandwidth,
            d_gpu=0,
            d_cpu=hw.d_cpu,
            d_disk=hw.d_disk,
            overheads=base,
        )
        overheads = calibrated_overheads(device, 0.4, cache_dir=state_dir)
    except CalibrationStopped:
        raise  # the daemon decides: stopping, or a job came first (it calibrates again when idle)
    except Exception as e:  # never worth refusing to start over
        log.warning("could not measure the per-op overheads (planning without them): %s", e)
        return hw
    log.info("per-op overheads measured and calibrated in %.2f s", time.perf_counter() - start)
    return hw.model_copy(update={"overheads": overheads.to_dict()})
