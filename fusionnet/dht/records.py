"""Record schemas announced in the DHT: what a compnode or a broker tells the swarm about itself.

Records are pydantic v2 models that *ignore* unknown fields, so a newer peer can add fields without older
peers refusing its records. On the wire a record is msgpack bytes of its JSON-mode dump (never pickle);
``decode_record`` turns bytes from a peer back into a validated model or raises ``WireError``.

Units: FLOPS for speeds, bytes for memory sizes, bytes/s for bandwidths, seconds (DHT time) for times.
"""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fusionnet import __version__
from fusionnet.errors import WireError

MAX_RECORD_BYTES = 64 * 1024
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")  # base58
_HOSTPORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def is_host_port(value: str) -> bool:
    """``host:port`` (``[v6]:port`` for IPv6) with a port in 1..65535."""
    m = _HOSTPORT_RE.fullmatch(value)
    return m is not None and 0 < int(m.group(2)) < 65536


def split_host_port(value: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port), brackets of an IPv6 host removed; ValueError when malformed."""
    if not is_host_port(value):
        raise ValueError(f"expected 'host:port', got {value[:80]!r}")
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> ``"host:port"``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_bind_all(host: str) -> bool:
    """0.0.0.0 or ::, an address to listen on but not one a peer can connect to."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a DNS name


class NodeState(StrEnum):
    JOINING = "JOINING"  # in the swarm, still profiling / starting its services: do not schedule on it
    ONLINE = "ONLINE"  # takes sub-tasks
    DRAINING = "DRAINING"  # leaving gracefully: finishing / handing over its work, takes nothing new
    OFFLINE = "OFFLINE"  # left gracefully (announced on exit)


class Role(StrEnum):
    SUPERNODE = "supernode"  # long-term, stable (FusionAI 3.3)
    ANTNODE = "antnode"  # joins for a while, usually weaker


NonNegFloat = Annotated[float, Field(ge=0)]
NonNegInt = Annotated[int, Field(ge=0)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _check_peer_id(value: str) -> str:
    if not _PEER_ID_RE.fullmatch(value):
        raise ValueError(f"not a base58 libp2p peer id: {value[:80]!r}")
    return value


class HardwareInfo(_Record):
    """A compnode's resources (FusionAI 3.3 and 3.7): D_gpu, D_cpu, D_disk and the speed S(p) = S*(p)·λp."""

    device_kind: str = Field(min_length=1, max_length=32)  # "cpu", "cuda", ...
    device_name: str = Field(max_length=256)
    peak_flops: float = Field(gt=0)  # S*(p): the device's nominal peak
    speed_factor: float = Field(gt=0, le=10)  # λp = measured / peak (from a short profiling run)
    d_gpu: NonNegInt = 0  # accelerator memory, bytes
    d_cpu: NonNegInt = 0  # host memory, bytes
    d_disk: NonNegInt = 0  # free disk in the state dir, bytes
    mem_bandwidth: NonNegFloat = 0.0  # measured device memory bandwidth, bytes/s
    link_bandwidth_estimate: NonNegFloat | None = None  # bytes/s; None until measured
    threads: NonNegInt | None = None  # compute threads the node uses
    # Fixed per-op / per-call costs of the node's software stack (``perfmodel.types.Overheads.to_dict``),
    # which the planner adds to eq. (1); checked by the planner, which ignores the node's hardware when
    # they are malformed rather than hiding the whole record here.
    overheads: dict[str, Any] | None = None

    @property
    def flops(self) -> float:
        """S(p) = S*(p)·λp, the speed the performance model uses."""
        return self.peak_flops * self.speed_factor


class CompnodeRecord(_Record):
    peer_id: str
    role: Role = Role.SUPERNODE
    backup: bool = False
    state: NodeState
    hardware: HardwareInfo | None = None  # None while JOINING (not profiled yet)
    load: float = Field(default=0.0, ge=0, le=1)  # fraction of capacity in use
    running_tasks: NonNegInt = 0  # sub-tasks running now
    data_path_address: str | None = None  # "host:port" of the direct tensor data path, if any
    # "host:port" of the Prometheus endpoint, if any (the broker turns it into a scrape target). Optional
    # and lenient: a malformed value from a peer reads as None instead of hiding the whole record.
    metrics_address: str | None = None
    maddrs: list[str] = Field(default_factory=list, max_length=32)
    version: str = Field(default=__version__, max_length=64)
    updated_at: float = 0.0  # DHT time of the announcement

    _peer = field_validator("peer_id")(_check_peer_id)

    @field_validator("data_path_address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not is_host_port(value):
            raise ValueError(f"data_path_address must be 'host:port', got {value[:80]!r}")
        return value

    @field_validator("metrics_address", mode="before")
    @classmethod
    def _lenient_metrics_address(cls, value: object) -> str | None:
        return value if isinstance(value, str) and is_host_port(value) else None


class BrokerRecord(_Record):
    peer_id: str
    state: NodeState = NodeState.ONLINE
    maddrs: list[str] = Field(default_factory=list, max_length=32)
    version: str = Field(default=__version__, max_length=64)
    updated_at: float = 0.0

    _peer = field_validator("peer_id")(_check_peer_id)


R = TypeVar("R", bound=_Record)


def encode_record(record: _Record) -> bytes:
    data = msgpack.packb(record.model_dump(mode="json"), use_bin_type=True)
    assert len(data) <= MAX_RECORD_BYTES, f"{type(record).__name__} of {len(data)} bytes is too large"
    return data


def decode_record(cls: type[R], data: object, where: str) -> R:
    """Bytes from a peer -> validated record; ``WireError`` naming ``where`` for anything else."""
    if not isinstance(data, bytes):
        raise WireError(f"{where}: record is {type(data).__name__}, expected msgpack bytes")
    if len(data) > MAX_RECORD_BYTES:
        raise WireError(f"{where}: record of {len(data)} bytes exceeds {MAX_RECORD_BYTES} bytes")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack's many exception types
        raise WireError(f"{where}: record is not valid msgpack ({type(e).__name__})") from e
    if not isinstance(doc, dict):
        raise WireError(f"{where}: record is a {type(doc).__name__}, expected a map")
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "record"
        raise WireError(f"{where}: invalid {cls.__name__}: {loc}: {first['msg']}") from e
