"""``load_nodes_file``: the swarm description of ``fusionnet plan --nodes NODES.yaml``.

Format (a mapping; a bare list is read as ``nodes`` with the default network)::

    nodes:
      - device: RTX 3080          # a catalog row (fusionnet.perfmodel.catalog), or explicit fields:
        count: 50                 # optional, default 1; names get " #0", " #1", ... suffixes
        name: home                # optional, default the device name
        speed_factor: 0.8         # optional lambda_p, default 1.0
        tensor_cores: true        # optional, default true: use the FP32 tensor-core peak
        d_cpu: 32GiB              # optional overrides of the catalog's memories
      - name: laptop
        kind: cpu                 # explicit device: kind, peak_flops, mem_bandwidth, d_cpu required
        peak_flops: 1.5T          # FLOP/s, "T"/"TFLOPS"/"G" suffixes allowed
        mem_bandwidth: 50GB/s
        d_cpu: 16GiB
        d_disk: 200GiB            # optional, default 256 GiB (d_gpu: required for kind gpu)
    network:
      latency: 10ms               # alpha, default 1 ms
      bandwidth: 1Gbps            # 1/beta (bits with "bps", bytes with "B/s"), default 1 Gbps
      links:                      # optional per-pair overrides, by node name
        - between: [laptop, "home #0"]
          latency: 1ms
          bandwidth: 10Gbps

Every problem is a ``NodesFileError`` naming the file, the entry (``nodes[2]``, ``network.links[0]``) and
the key: a ``PlanError`` (what the planner's callers catch) that is also a ``JobError``, because the file is
the user's input, refused before anything is traced (``fusionnet plan`` exits 2 on it, as on a bad job).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fusionnet.errors import JobError, PlanError
from fusionnet.perfmodel.catalog import lookup, parse_bytes, parse_flops, parse_rate, parse_seconds
from fusionnet.perfmodel.types import DeviceSpec, Link, Swarm

GiB = 1 << 30
_CATALOG_KEYS = {"device", "count", "name", "speed_factor", "tensor_cores", "d_gpu", "d_cpu", "d_disk"}
_EXPLICIT_KEYS = {
    "name",
    "count",
    "kind",
    "peak_flops",
    "speed_factor",
    "mem_bandwidth",
    "d_gpu",
    "d_cpu",
    "d_disk",
}
_NETWORK_KEYS = {"latency", "bandwidth", "links"}
_LINK_KEYS = {"between", "latency", "bandwidth"}
DEFAULT_LATENCY = 1e-3
DEFAULT_BANDWIDTH = 1e9 / 8
# Devices per entry, and in all: far above any swarm one plans for by hand, and small enough that the
# planner answers in seconds. Every count becomes that many devices, and the planner's work grows with
# them (count: 10**8 ran for minutes).
MAX_COUNT = 10_000


class NodesFileError(PlanError, JobError):
    """A nodes file (``plan --nodes``) that cannot be read or describes no valid swarm: bad input."""


def _unknown(entry: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(entry) - allowed)
    if extra:
        raise PlanError(
            f"{where}: unknown key(s) {', '.join(map(repr, extra))} (allowed: {', '.join(sorted(allowed))})"
        )


def _count(entry: dict, where: str) -> int:
    count = entry.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise PlanError(f"{where}.count must be a positive integer, got {count!r}")
    if count > MAX_COUNT:
        raise PlanError(f"{where}.count must be at most {MAX_COUNT}, got {count}")
    return count


def _finite(parse: Callable[[object, str], float], value: object, where: str) -> Any:
    """``parse(value, where)`` (a catalog parser), refusing what is not a finite number: the parsers pass
    YAML's ``.nan``/``.inf`` and ``1e999`` through (NaN compares false with every bound), and a size
    rounds an infinite value into an ``OverflowError``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise PlanError(f"{where} must be a finite number, got {value!r}")
    try:
        number = parse(value, where)
    except PlanError:
        raise
    except (OverflowError, ValueError):
        raise PlanError(f"{where} must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise PlanError(f"{where} must be a finite number, got {value!r}")
    return number


def _speed_factor(entry: dict, where: str) -> float:
    value = entry.get("speed_factor", 1.0)
    # not (value > 0) rather than value <= 0: NaN compares false with everything
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise PlanError(f"{where}.speed_factor must be a positive finite number, got {value!r}")
    return float(value)


def _node_specs(entry: Any, where: str) -> list[DeviceSpec]:
    if not isinstance(entry, dict):
        raise PlanError(f"{where} must be a mapping, got {type(entry).__name__}")
    count = _count(entry, where)
    speed = _speed_factor(entry, where)  # here, not in make(): its message names the entry already
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise PlanError(f"{where}.name must be a non-empty string, got {name!r}")
    mem = {
        k: _finite(parse_bytes, entry[k], f"{where}.{k}") for k in ("d_gpu", "d_cpu", "d_disk") if k in entry
    }
    if "device" in entry:
        _unknown(entry, _CATALOG_KEYS, where)
        if not isinstance(entry["device"], str):
            raise PlanError(f"{where}.device must be a catalog device name, got {entry['device']!r}")
        try:
            row = lookup(entry["device"])
        except PlanError as e:
            raise PlanError(f"{where}.device: {e}") from e
        tensor = entry.get("tensor_cores", True)
        if not isinstance(tensor, bool):
            raise PlanError(f"{where}.tensor_cores must be true or false, got {tensor!r}")
        base = name or row.name

        def make(n: str) -> DeviceSpec:
            try:
                return row.spec(name=n, tensor_cores=tensor, speed_factor=speed, **mem)
            except PlanError as e:
                raise PlanError(f"{where}: {e}") from e

    else:
        _unknown(entry, _EXPLICIT_KEYS, where)
        missing = [k for k in ("name", "kind", "peak_flops", "mem_bandwidth", "d_cpu") if k not in entry]
        if entry.get("kind") == "gpu" and "d_gpu" not in entry:
            missing.append("d_gpu")
        if missing:
            raise PlanError(
                f"{where}: give either 'device' (a catalog name) or explicit fields; "
                f"missing {', '.join(missing)}"
            )
        base = name
        peak = _finite(parse_flops, entry["peak_flops"], f"{where}.peak_flops")
        bandwidth = _finite(parse_rate, entry["mem_bandwidth"], f"{where}.mem_bandwidth")

        def make(n: str) -> DeviceSpec:
            try:
                return DeviceSpec(
                    name=n,
                    kind=entry["kind"],
                    peak_flops=peak,
                    speed_factor=speed,
                    mem_bandwidth=bandwidth,
                    d_gpu=mem.get("d_gpu", 0),
                    d_cpu=mem["d_cpu"],
                    d_disk=mem.get("d_disk", 256 * GiB),
                )
            except PlanError as e:
                raise PlanError(f"{where}: {e}") from e

    if count == 1:
        return [make(base)]
    return [make(f"{base} #{i}") for i in range(count)]


def _link(entry: dict, where: str, default: Link | None) -> Link:
    latency = _finite(parse_seconds, entry["latency"], f"{where}.latency") if "latency" in entry else None
    bandwidth = (
        _finite(parse_rate, entry["bandwidth"], f"{where}.bandwidth") if "bandwidth" in entry else None
    )
    if latency is None:
        latency = default.alpha if default else DEFAULT_LATENCY
    if bandwidth is None:
        bandwidth = default.bandwidth if default else DEFAULT_BANDWIDTH
    return Link.from_bandwidth(latency, bandwidth)


def swarm_from_dict(doc: Any, source: str = "nodes file") -> Swarm:
    """Builds a Swarm from the parsed YAML document (see the module docstring)."""
    if isinstance(doc, list):
        doc = {"nodes": doc}
    if not isinstance(doc, dict):
        raise PlanError(
            f"{source}: expected a mapping with 'nodes' (and optionally 'network'), got {type(doc).__name__}"
        )
    _unknown(doc, {"nodes", "network"}, source)
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise PlanError(f"{source}: 'nodes' must be a non-empty list")
    devices: list[DeviceSpec] = []
    for i, entry in enumerate(nodes):
        devices.extend(_node_specs(entry, f"{source}: nodes[{i}]"))
        if len(devices) > MAX_COUNT:  # each count is bounded; so is their sum, for the same reason
            raise PlanError(f"{source}: nodes[{i}]: the nodes add up to more than {MAX_COUNT} devices")
    by_name: dict[str, int] = {}
    for i, d in enumerate(devices):
        if d.name in by_name:
            raise PlanError(f"{source}: two nodes are named {d.name!r}; give them distinct 'name's")
        by_name[d.name] = i
    network = doc.get("network") or {}
    if not isinstance(network, dict):
        raise PlanError(f"{source}: 'network' must be a mapping")
    _unknown(network, _NETWORK_KEYS, f"{source}: network")
    default = _link(network, f"{source}: network", None)
    links: dict[tuple[int, int], Link] = {}
    raw_links = network.get("links") or []
    if not isinstance(raw_links, list):
        raise PlanError(f"{source}: network.links must be a list")
    for k, entry in enumerate(raw_links):
        where = f"{source}: network.links[{k}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{where} must be a mapping")
        _unknown(entry, _LINK_KEYS, where)
        pair = entry.get("between")
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise PlanError(f"{where}.between must name two different nodes, got {pair!r}")
        for end in pair:
            if end not in by_name:
                raise PlanError(f"{where}.between names unknown node {end!r}")
        links[(by_name[pair[0]], by_name[pair[1]])] = _link(entry, where, default)
    return Swarm(tuple(devices), links, default)


def load_nodes_file(path: str | Path) -> Swarm:
    """Reads NODES.yaml into a Swarm; every error (a ``NodesFileError``) names the file and the entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, a NUL byte in the path
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:100]
        raise NodesFileError(f"{path}: cannot read nodes file ({reason})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise NodesFileError(f"{path}: nodes file is not valid YAML: {_yaml_problem(e)}") from None
    try:
        return swarm_from_dict(doc, source=str(path))
    except PlanError as e:
        raise NodesFileError(str(e)) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's problem and line, on one line (its own message spans several)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        return f"line {e.problem_mark.line + 1}: {e.problem}"
    return " ".join(str(e).split())[:200]
