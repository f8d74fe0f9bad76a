"""Short local profiling (FusionAI 3.7: "lambda_p is fitted by a short-time profiling").

``profile_local_device`` times float32 matmuls of a few sizes and a large memory copy with torch
(imported lazily, inside the measuring functions: importing this module starts nothing), then:

- peak FLOP/s = the best rate any matmul reached (a CPU's vendor peak is rarely known; the best
  measured rate is what S* can honestly claim here);
- lambda = ``fit_speed_factor`` over every timed matmul against that peak: the typical fraction of
  the peak real, smaller ops get;
- memory bandwidth = bytes read + written per second of the best copy.

Results are cached as JSON under ``cache_dir`` keyed by the machine (platform, CPU model, torch
threads and version), so compnodes on the same machine profile once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from fusionnet.errors import FusionNetError
from fusionnet.perfmodel.fitting import fit_speed_factor

MATMUL_SIZES = (64, 128, 256, 384, 512, 768, 1024)
COPY_BYTES = 64 << 20
CACHE_VERSION = 1


class LocalProfile(NamedTuple):
    peak_flops: float  # S*(p), FLOP/s
    speed_factor: float  # lambda_p
    mem_bandwidth: float  # bytes/s


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(torch_threads: int, torch_version: str) -> dict[str, str | int]:
    """What the cached profile is valid for."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count() or 0,
        "torch_threads": torch_threads,
        "torch": torch_version,
        "version": CACHE_VERSION,
    }


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusionnet" / "profile"


T = TypeVar("T")


def cached_measurement(
    cache_dir: str | Path | None,
    prefix: str,
    key: Mapping[str, Any],
    measure: Callable[[], T],
    encode: Callable[[T], Any],
    decode: Callable[[Any], T],
    *,
    refresh: bool = False,
) -> T:
    """``measure()``, or its result from ``<cache_dir>/<prefix>-<digest of key>.json`` when that file
    holds the same key. An unreadable or foreign file is measured again and overwritten (atomically:
    two processes profiling at once never leave half a file)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = folder / f"{prefix}-{digest}.json"
    if not refresh and path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("key") == key:
                return decode(doc["result"])
        except (OSError, ValueError, KeyError, TypeError, FusionNetError):
            pass  # unreadable cache: measure again and overwrite it
    result = measure()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": dict(key), "result": encode(result)}, indent=2))
    tmp.replace(path)
    return result


def _measure(seconds_budget: float) -> tuple[list[tuple[float, float]], float]:
    """(matmul samples [(flops, seconds)], memory bandwidth bytes/s) within about the budget."""
    import torch

    gen = torch.Generator().manual_seed(0)
    samples: list[tuple[float, float]] = []
    mm_budget = 0.75 * seconds_budget / len(MATMUL_SIZES)
    with torch.inference_mode():
        for n in MATMUL_SIZES:
            a = torch.randn(n, n, generator=gen)
            b = torch.randn(n, n, generator=gen)
            torch.mm(a, b)  # warm-up: allocation, thread pool
            deadline = time.perf_counter() + mm_budget
            runs = 0
            while runs < 2 or (time.perf_counter() < deadline and runs < 50):
                t0 = time.perf_counter()
                torch.mm(a, b)
                samples.append((2.0 * n**3, time.perf_counter() - t0))
                runs += 1
        elems = COPY_BYTES // 4
        src = torch.randn(elems, generator=gen)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        deadline = time.perf_counter() + 0.25 * seconds_budget
        runs = 0
        while runs < 2 or (time.perf_counter() < deadline and runs < 20):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
            runs += 1
    return samples, 2.0 * COPY_BYTES / best


def profile_local_device(
    seconds_budget: float = 2.0, cache_dir: str | Path | None = None, *, refresh: bool = False
) -> LocalProfile:
    """Profiles this machine's CPU with torch (see module docstring), using the cache when valid."""
    if not isinstance(seconds_budget, (int, float)) or not 0 < seconds_budget <= 600:
        raise ValueError(f"seconds_budget must be in (0, 600], got {seconds_budget!r}")
    import torch

    def measure() -> LocalProfile:
        samples, bandwidth = _measure(float(seconds_budget))
        peak = max(f / t for f, t in samples)
        return LocalProfile(peak, fit_speed_factor(samples, peak), bandwidth)

    def decode(r: Any) -> LocalProfile:
        return LocalProfile(float(r["peak_flops"]), float(r["speed_factor"]), float(r["mem_bandwidth"]))

    key = machine_key(torch.get_num_threads(), torch.__version__)
    return cached_measurement(
        cache_dir, "profile", key, measure, lambda r: r._asdict(), decode, refresh=refresh
    )
