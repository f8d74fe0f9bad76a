"""Device catalog (FusionAI Table 1 and common others) and parsing of sizes, bandwidths and latencies.

GPU rows: FP32 and "FP32 tensor core" TFLOPS and memory. The five Table 1 rows are copied from the
paper as printed (its tensor-core column mixes dense and sparsity figures: RTX 3080 59.5 and H100
756 are TF32-with-sparsity numbers, A100 155.92 is dense TF32; we keep the paper's numbers because
section 4's analysis is defined by them). Other rows use the vendors' datasheet peaks in the same
spirit (TF32 tensor throughput where the GPU has it, else FP32). Memory bandwidths are datasheet
figures. CPU rows give an FP32 peak from cores x clock x SIMD FLOPs/cycle and typical RAM: they are
starting points; ``speed_factor`` (lambda_p) is fitted by profiling anyway.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import DeviceSpec

GB = 10**9
GiB = 1 << 30
T = 10**12


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    kind: str  # gpu | cpu
    fp32_flops: float
    tensor_flops: float  # FP32 tensor core (Table 1 column); = fp32_flops where there is none
    memory: int  # bytes of GPU memory (gpu) or typical RAM (cpu)
    mem_bandwidth: float  # bytes/s
    level: str  # Consumer | Data Center | Workstation | Edge

    def spec(
        self,
        *,
        name: str | None = None,
        tensor_cores: bool = True,
        speed_factor: float = 1.0,
        d_cpu: int | None = None,
        d_disk: int | None = None,
        d_gpu: int | None = None,
    ) -> DeviceSpec:
        """A DeviceSpec for this hardware; host RAM defaults to 32 GiB and disk to 256 GiB."""
        gpu = self.kind == "gpu"
        return DeviceSpec(
            name=name or self.name,
            kind=self.kind,
            peak_flops=self.tensor_flops if tensor_cores else self.fp32_flops,
            speed_factor=speed_factor,
            mem_bandwidth=self.mem_bandwidth,
            d_gpu=(self.memory if d_gpu is None else d_gpu) if gpu else 0,
            d_cpu=(32 * GiB if gpu else self.memory) if d_cpu is None else d_cpu,
            d_disk=256 * GiB if d_disk is None else d_disk,
        )


_ROWS = (
    # FusionAI Table 1
    CatalogEntry("RTX 4090", "gpu", 82.58 * T, 82.58 * T, 24 * GB, 1008 * GB, "Consumer"),
    CatalogEntry("RTX 4080", "gpu", 48.74 * T, 97.5 * T, 16 * GB, 716.8 * GB, "Consumer"),
    CatalogEntry("RTX 3080", "gpu", 29.77 * T, 59.5 * T, 10 * GB, 760 * GB, "Consumer"),
    CatalogEntry("H100", "gpu", 51.22 * T, 756 * T, 80 * GB, 2000 * GB, "Data Center"),
    CatalogEntry("A100", "gpu", 19.49 * T, 155.92 * T, 80 * GB, 2039 * GB, "Data Center"),
    # other GPUs
    CatalogEntry("RTX 4070", "gpu", 29.15 * T, 58.3 * T, 12 * GB, 504 * GB, "Consumer"),
    CatalogEntry("RTX 3090", "gpu", 35.58 * T, 71.0 * T, 24 * GB, 936 * GB, "Consumer"),
    CatalogEntry("RTX 3070", "gpu", 20.31 * T, 40.6 * T, 8 * GB, 448 * GB, "Consumer"),
    CatalogEntry("RTX 3060", "gpu", 12.74 * T, 25.4 * T, 12 * GB, 360 * GB, "Consumer"),
    CatalogEntry("RTX 2080 Ti", "gpu", 13.45 * T, 13.45 * T, 11 * GB, 616 * GB, "Consumer"),
    CatalogEntry("RTX A6000", "gpu", 38.7 * T, 77.4 * T, 48 * GB, 768 * GB, "Workstation"),
    CatalogEntry("V100", "gpu", 15.7 * T, 15.7 * T, 32 * GB, 900 * GB, "Data Center"),
    CatalogEntry("T4", "gpu", 8.1 * T, 8.1 * T, 16 * GB, 320 * GB, "Data Center"),
    CatalogEntry("A10", "gpu", 31.2 * T, 62.5 * T, 24 * GB, 600 * GB, "Data Center"),
    CatalogEntry("L4", "gpu", 30.3 * T, 60.0 * T, 24 * GB, 300 * GB, "Data Center"),
    CatalogEntry("Jetson AGX Orin", "gpu", 5.3 * T, 5.3 * T, 32 * GB, 204.8 * GB, "Edge"),
    # CPUs: cores x all-core GHz x FP32 FLOPs/cycle
    CatalogEntry("Core i9-13900K", "cpu", 2.5 * T, 2.5 * T, 64 * GiB, 89.6 * GB, "Consumer"),
    CatalogEntry("Core i7-12700", "cpu", 1.2 * T, 1.2 * T, 32 * GiB, 76.8 * GB, "Consumer"),
    CatalogEntry("Ryzen 9 7950X", "cpu", 2.6 * T, 2.6 * T, 64 * GiB, 83.2 * GB, "Consumer"),
    CatalogEntry("Ryzen 7 5800X", "cpu", 1.2 * T, 1.2 * T, 32 * GiB, 51.2 * GB, "Consumer"),
    CatalogEntry("Apple M2", "cpu", 0.4 * T, 0.4 * T, 16 * GiB, 100 * GB, "Consumer"),
    CatalogEntry("Xeon Platinum 8380", "cpu", 5.1 * T, 5.1 * T, 256 * GiB, 204.8 * GB, "Data Center"),
    CatalogEntry("EPYC 7763", "cpu", 5.0 * T, 5.0 * T, 256 * GiB, 204.8 * GB, "Data Center"),
    CatalogEntry("Raspberry Pi 4", "cpu", 0.048 * T, 0.048 * T, 4 * GiB, 4 * GB, "Edge"),
)


def _key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "geforce", "intel", "amd", "tesla"):
        key = key.removeprefix(prefix)
    return key


CATALOG: dict[str, CatalogEntry] = {row.name: row for row in _ROWS}
_BY_KEY = {_key(row.name): row for row in _ROWS}


def lookup(name: str) -> CatalogEntry:
    """Finds a catalog row by name, ignoring case, spaces, dashes and NVIDIA/GeForce prefixes."""
    if not isinstance(name, str) or not name.strip():
        raise PlanError(f"device name must be a non-empty string, got {name!r}")
    row = _BY_KEY.get(_key(name))
    if row is None:
        close = difflib.get_close_matches(name, list(CATALOG), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise PlanError(f"device {name!r} is not in the catalog{hint} (known: {', '.join(CATALOG)})")
    return row


_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_RATE_UNITS = {
    "": 1.0, "b/s": 1.0, "bps": 1 / 8,
    "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
    "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "kib/s": 1024.0, "mib/s": 1024.0**2, "gib/s": 1024.0**3,
}  # fmt: skip
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Zµ/]*)\s*$")


def _parse(value: object, units: dict, what: str, where: str) -> float:
    if isinstance(value, bool):
        raise PlanError(f"{where}: {what} must be a number or a string with a unit, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _NUMBER.match(value)):
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise PlanError(f"{where}: cannot read {what} from {value!r}")
    # "Gbps" is bits, "GB/s" bytes: only the b/B distinction of rates is case-sensitive
    factor = units.get(unit) if unit in units else units.get(unit.lower())
    if units is _RATE_UNITS and unit.lower().endswith("bps") and unit[-3] == "B":
        factor = units[unit.lower()] * 8
    if factor is None:
        raise PlanError(
            f"{where}: unknown unit {unit!r} for {what} (use one of {', '.join(k for k in units if k)})"
        )
    if number < 0:
        raise PlanError(f"{where}: {what} must not be negative, got {value!r}")
    return number * factor


def parse_bytes(value: object, where: str = "value") -> int:
    """``10GiB``, ``512 MB``, ``1e9`` -> bytes."""
    return round(_parse(value, _SIZE_UNITS, "a size", where))


def parse_rate(value: object, where: str = "value") -> float:
    """``1Gbps`` (bits), ``125MB/s`` (bytes), a bare number (bytes/s) -> bytes/s."""
    rate = _parse(value, _RATE_UNITS, "a bandwidth", where)
    if rate <= 0:
        raise PlanError(f"{where}: bandwidth must be positive, got {value!r}")
    return rate


def parse_seconds(value: object, where: str = "value") -> float:
    """``10ms``, ``0.5 s``, ``200us``, a bare number (seconds) -> seconds."""
    return _parse(value, _TIME_UNITS, "a latency", where)


def parse_flops(value: object, where: str = "value") -> float:
    """``59.5T``/``59.5 TFLOPS``, ``2e12`` -> FLOP/s."""
    units = {"": 1.0, "g": 1e9, "gflops": 1e9, "t": 1e12, "tflops": 1e12, "p": 1e15, "pflops": 1e15}
    flops = _parse(value, units, "a FLOP/s figure", where)
    if flops <= 0:
        raise PlanError(f"{where}: FLOP/s must be positive, got {value!r}")
    return flops
