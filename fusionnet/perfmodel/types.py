"""The performance model's inputs, as plain frozen data (the lead converts the IR and the swarm to these).

Units everywhere: FLOPs, bytes, seconds, bytes/second. Per-op figures are for ONE micro-batch (the
traced example batch); the workload says how many micro-batches make one step.

Validation happens in ``__post_init__`` so a bad value is refused where it is built, with a message
naming the op, device or field: graph structure problems raise ``IRError`` (the cost graph is the IR
seen through costs), swarm and workload problems raise ``PlanError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import TypeVar

from fusionnet.errors import PlanError
from fusionnet.perfmodel.graph_types import (
    OP_CLASSES,
    OP_KINDS,
    CostGraph,
    OpCost,
    is_int,
    positive_finite,
)
from fusionnet.perfmodel.optimizers import optimizer_profile

__all__ = [
    "DEVICE_KINDS",
    "NO_OVERHEADS",
    "OP_CLASSES",
    "OP_KINDS",
    "SCHEDULES",
    "TASKS",
    "ClassCost",
    "CostGraph",
    "DeviceSpec",
    "Link",
    "OpCost",
    "Overheads",
    "Swarm",
    "Workload",
]

DEVICE_KINDS = ("gpu", "cpu")
TASKS = ("train", "grad", "infer")
SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b")  # fusionnet.schedules


def _non_negative_seconds(value: object, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0:
        raise PlanError(f"{what} must be a non-negative number of seconds, got {value!r}")


@dataclass(frozen=True)
class ClassCost:
    """How one op class runs on a device, beyond eq. (1)'s FLOPs / S(p) + bytes / bandwidth."""

    fp: float = 0.0  # fixed seconds per forward execution (dispatch, autograd recording, kernel launch)
    bp: float = 0.0  # fixed seconds per backward execution
    efficiency: float = 1.0  # fraction of the roofline (FLOPs at S(p), bytes at mem_bandwidth) it reaches
    bp_input: float = 0.0  # part of ``bp`` spent on the data input's gradient (saved when none is needed)

    def __post_init__(self) -> None:
        _non_negative_seconds(self.fp, "op class fp overhead")
        _non_negative_seconds(self.bp, "op class bp overhead")
        _non_negative_seconds(self.bp_input, "op class bp_input overhead")
        if not positive_finite(self.efficiency):
            raise PlanError(f"op class efficiency must be a positive finite number, got {self.efficiency!r}")


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """The fixed costs of a device's software stack that FLOP and byte counts miss.

    They dominate small ops (a 16x32 matmul is 10 us of framework for 0.1 us of arithmetic), so a
    prediction for small models is only as good as these. All zero (the default) is PALEO's pure
    eq. (1). ``profile_overheads`` (``overheads.py``) measures them on the local machine.
    """

    view: ClassCost = ClassCost()
    elementwise: ClassCost = ClassCost()
    norm: ClassCost = ClassCost()  # normalisations, softmax, reductions
    pool: ClassCost = ClassCost()
    loss: ClassCost = ClassCost()
    gather: ClassCost = ClassCost()  # embedding, indexing
    copy: ClassCost = ClassCost()  # cat, stack, materialising reshapes
    matmul: ClassCost = ClassCost()
    conv: ClassCost = ClassCost()
    other: ClassCost = ClassCost()
    stage_fp: float = 0.0  # per sub-DAG forward call, per micro-batch
    stage_bp: float = 0.0  # per sub-DAG backward call, per micro-batch (stages a gradient reaches)
    stage_update: float = 0.0  # per optimizer step call of a stage that owns parameters
    # optimizer name -> seconds per parameter tensor per step, beyond its FLOPs and bytes
    update_tensor: tuple[tuple[str, float], ...] = ()
    update_kernel: float = 0.0  # per-tensor kernel launch for optimizers missing from update_tensor

    def __post_init__(self) -> None:
        for f in OP_CLASSES:
            if not isinstance(getattr(self, f), ClassCost):
                raise PlanError(f"overheads.{f} must be a ClassCost")
        for f in ("stage_fp", "stage_bp", "stage_update", "update_kernel"):
            _non_negative_seconds(getattr(self, f), f"overheads.{f}")
        object.__setattr__(self, "update_tensor", tuple(sorted((str(k), v) for k, v in self.update_tensor)))
        for name, seconds in self.update_tensor:
            _non_negative_seconds(seconds, f"overheads.update_tensor[{name!r}]")

    def of(self, op_class: str) -> ClassCost:
        if op_class not in OP_CLASSES:
            raise PlanError(f"op class {op_class!r} is not one of {', '.join(OP_CLASSES)}")
        return getattr(self, op_class)

    def tensor_update(self, optimizer: str | None) -> float:
        """Fixed seconds one optimizer step spends per parameter tensor."""
        profile = optimizer_profile(optimizer)
        for name, seconds in self.update_tensor:
            if name == profile.name:
                return seconds
        return self.update_kernel * profile.kernels

    def scaled(self, factor: float) -> Overheads:
        """The same overheads on a machine ``factor`` times as fast (every duration divided by it)."""
        if not positive_finite(factor):
            raise PlanError(f"scale factor must be a positive finite number, got {factor!r}")
        classes = {
            f: replace(c, fp=c.fp / factor, bp=c.bp / factor, bp_input=c.bp_input / factor)
            for f in OP_CLASSES
            for c in (self.of(f),)
        }
        return replace(
            self,
            **classes,
            stage_fp=self.stage_fp / factor,
            stage_bp=self.stage_bp / factor,
            stage_update=self.stage_update / factor,
            update_tensor=tuple((k, v / factor) for k, v in self.update_tensor),
            update_kernel=self.update_kernel / factor,
        )

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f: asdict(self.of(f)) for f in OP_CLASSES}
        for f in ("stage_fp", "stage_bp", "stage_update", "update_kernel"):
            out[f] = getattr(self, f)
        out["update_tensor"] = dict(self.update_tensor)
        return out

    @classmethod
    def from_dict(cls, doc: Mapping[str, object]) -> Overheads:
        """Inverse of ``to_dict``; ``PlanError`` on anything malformed."""
        if not isinstance(doc, Mapping):
            raise PlanError(f"overheads must be a mapping, got {type(doc).__name__}")
        try:
            kwargs: dict[str, object] = {f: ClassCost(**doc[f]) for f in OP_CLASSES if f in doc}  # type: ignore[arg-type]
            for f in ("stage_fp", "stage_bp", "stage_update", "update_kernel"):
                if f in doc:
                    kwargs[f] = doc[f]
            kwargs["update_tensor"] = tuple(dict(doc.get("update_tensor") or {}).items())  # type: ignore[call-overload]
            return cls(**kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise PlanError(f"malformed overheads: {e}") from e


NO_OVERHEADS = Overheads()


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One compnode's hardware: S(p) = S*(p) * lambda_p (``peak_flops * speed_factor``) and memories.

    Keyword-only because the spec in the design lists ``speed_factor`` (defaulted) among the others.
    A ``cpu`` device computes on its CPU: ``d_gpu`` is ignored for it.
    """

    name: str
    kind: str  # "gpu" | "cpu"
    peak_flops: float  # S*(p), FLOP/s
    speed_factor: float = 1.0  # lambda_p, fitted by profiling
    mem_bandwidth: float  # bytes/s of the memory the device computes from
    d_gpu: int  # bytes
    d_cpu: int  # bytes
    d_disk: int  # bytes
    overheads: Overheads = NO_OVERHEADS  # fixed per-op / per-call costs (zero: pure eq. (1))

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        if not isinstance(self.overheads, Overheads):
            raise PlanError(f"{where}: overheads must be an Overheads, got {type(self.overheads).__name__}")
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"device name must be a non-empty string, got {self.name!r}")
        if self.kind not in DEVICE_KINDS:
            raise PlanError(f"{where}: kind {self.kind!r} must be 'gpu' or 'cpu'")
        for f in ("peak_flops", "speed_factor", "mem_bandwidth"):
            if not positive_finite(getattr(self, f)):
                raise PlanError(f"{where}: {f} must be a positive finite number, got {getattr(self, f)!r}")
        for f in ("d_gpu", "d_cpu", "d_disk"):
            value = getattr(self, f)
            if not is_int(value) or value < 0:
                raise PlanError(f"{where}: {f} must be a non-negative integer of bytes, got {value!r}")
        if self.kind == "gpu" and self.d_gpu == 0:
            raise PlanError(f"{where}: a gpu device needs d_gpu > 0")

    @property
    def speed(self) -> float:
        """S(p): the FLOP/s the performance model divides by."""
        return self.peak_flops * self.speed_factor

    @property
    def compute_memory(self) -> int:
        """Bytes of the memory this device keeps parameters and activations in."""
        return self.d_gpu if self.kind == "gpu" else self.d_cpu

    def scaled(self, factor: float) -> DeviceSpec:
        """This device running ``factor`` times as fast as profiled: lambda_p, bandwidth and every fixed
        overhead scale together (what one calibration measurement can tell about a busy machine)."""
        if not positive_finite(factor):
            raise PlanError(f"device {self.name!r}: scale factor must be positive, got {factor!r}")
        return replace(
            self,
            speed_factor=self.speed_factor * factor,
            mem_bandwidth=self.mem_bandwidth * factor,
            overheads=self.overheads.scaled(factor),
        )


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one direction of a connection: ``alpha + beta * bytes`` seconds."""

    alpha: float  # seconds of latency per message
    beta: float  # seconds per byte (1 / bandwidth)

    def __post_init__(self) -> None:
        for f in ("alpha", "beta"):
            value = getattr(self, f)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0:
                raise PlanError(f"link {f} must be a non-negative finite number, got {value!r}")

    @classmethod
    def from_bandwidth(cls, latency_s: float, bandwidth_bytes_per_s: float) -> Link:
        if not positive_finite(bandwidth_bytes_per_s):
            raise PlanError(f"link bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
        return cls(alpha=float(latency_s), beta=1.0 / float(bandwidth_bytes_per_s))

    def time(self, nbytes: int | float) -> float:
        """Seconds to move ``nbytes`` in one message; nothing to move costs nothing."""
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta == 0 else 1.0 / self.beta


K = TypeVar("K")  # what names a device: its index, or its peer id on the broker


def link_between(links: Mapping[tuple[K, K], Link], src: K, dst: K, default: Link) -> Link:
    """The link from ``src`` to ``dst``: given for that direction, else for the other one (a nodes file
    lists a pair once, ``between: [a, b]``, and both directions use it), else ``default``."""
    found = links.get((src, dst))
    return found if found is not None else links.get((dst, src), default)


@dataclass(frozen=True)
class Swarm:
    """Devices plus the links between them. ``links[(i, j)]`` is the i -> j direction; a pair given in
    one direction only serves both; pairs not given use ``default_link``."""

    devices: tuple[DeviceSpec, ...]
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    default_link: Link = field(default_factory=lambda: Link(alpha=0.0, beta=0.0))

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise PlanError("a swarm needs at least one device")
        for i, d in enumerate(self.devices):
            if not isinstance(d, DeviceSpec):
                raise PlanError(f"devices[{i}] is a {type(d).__name__}, not a DeviceSpec")
        n = len(self.devices)
        for key, link in self.links.items():
            ok = isinstance(key, tuple) and len(key) == 2 and all(is_int(k) and 0 <= k < n for k in key)
            if not ok or key[0] == key[1]:
                raise PlanError(f"links key {key!r} must be a pair of distinct device indices in [0, {n})")
            if not isinstance(link, Link):
                raise PlanError(f"links[{key!r}] is a {type(link).__name__}, not a Link")
        if not isinstance(self.default_link, Link):
            raise PlanError("default_link must be a Link")
        object.__setattr__(self, "links", MappingProxyType(dict(sorted(self.links.items()))))

    def link(self, src: int, dst: int) -> Link:
        """The link carrying data from device ``src`` to device ``dst``."""
        return link_between(self.links, src, dst, self.default_link)

    @cached_property
    def uniform_links(self) -> bool:
        """True when every pair of devices talks over the same link (only then are same-spec devices
        interchangeable for the scheduler)."""
        return all(link == self.default_link for link in self.links.values())


@dataclass(frozen=True)
class Workload:
    """What one step runs: ``microbatches`` micro-batches through FP (+BP (+Update)) under a schedule."""

    microbatches: int
    task: str  # train | grad | infer
    schedule: str = "gpipe"  # gpipe | 1f1b | zero-bubble | interleaved-1f1b (fusionnet.schedules)
    chunks: int = 1  # stages per device (interleaved-1f1b: stage s runs on device s mod stages / chunks)

    def __post_init__(self) -> None:
        if not is_int(self.chunks) or self.chunks < 1:
            raise PlanError(f"workload chunks must be a positive integer, got {self.chunks!r}")
        if not is_int(self.microbatches) or self.microbatches < 1:
            raise PlanError(f"workload microbatches must be a positive integer, got {self.microbatches!r}")
        if self.task not in TASKS:
            raise PlanError(f"workload task {self.task!r} must be one of {', '.join(TASKS)}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"workload schedule {self.schedule!r} must be one of {', '.join(SCHEDULES)}")

    @property
    def backward(self) -> bool:
        return self.task != "infer"

    @property
    def update(self) -> bool:
        return self.task == "train"
