"""What both daemons' metric sets share: bucket layouts, label vocabularies, build info, state gauges.

Label values are closed vocabularies (lower-case), declared here once so that the alert rules, the
dashboard and the daemons agree on them, and so that a typo in a daemon fails loudly instead of
growing a new series. Job ids are the one open label; they appear only on per-job gauges that the
broker removes when the job ends (``BrokerMetrics.forget_job``), so the label set stays bounded by the
number of running jobs.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable, Mapping
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, Info
from prometheus_client.process_collector import ProcessCollector

from fusionnet import __version__

PREFIX = "fusionnet_"

# Vocabularies of the label values. Daemons pass whatever casing their enums use; ``label_value``
# lower-cases and checks membership.
NODE_STATES = ("joining", "online", "draining", "offline", "unreachable")
ROLES = ("supernode", "antnode")
JOB_STATES = ("queued", "planning", "running", "succeeded", "failed", "cancelled")
COMPUTE_PHASES = ("forward", "backward", "update")  # FusionAI's FP / BP / Update
DATA_PATHS = ("tcp", "p2p")  # direct TCP data path, or the libp2p stream fallback
DIRECTIONS = ("sent", "received")
RECOVERY_PHASES = ("detection", "redistribution", "replay", "handover")  # handover: proactive stall
SUBTASK_OUTCOMES = ("succeeded", "failed", "cancelled")

# Bucket layouts (seconds unless named otherwise). Chosen to span what a loopback CPU swarm and a
# WAN GPU swarm produce, so that quantiles stay meaningful on both.
COMPUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RTT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RECOVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# |measured / predicted - 1|: 0.1 means the performance model was 10 % off.
ERROR_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)


def label_value(value: object, allowed: tuple[str, ...], label: str) -> str:
    """The lower-cased label value, refused with a clear message unless it is in ``allowed``."""
    text = str(getattr(value, "value", value)).lower()
    if text not in allowed:
        raise ValueError(f"metric label {label}={text!r} is not one of {', '.join(allowed)}")
    return text


def set_counts(gauge: Gauge, label: str, allowed: tuple[str, ...], counts: Mapping[str, int]) -> None:
    """Set one series per allowed value, zero for the absent ones.

    Writing every value (not only those present) keeps a series from freezing at its last non-zero
    count when its last member goes away: a vanished series reads as "no data", not as 0.
    """
    normalized: dict[str, int] = {}
    for key, n in counts.items():
        if n < 0:
            raise ValueError(f"metric {gauge._name}: negative count {n} for {label}={key!r}")
        k = label_value(key, allowed, label)
        normalized[k] = normalized.get(k, 0) + n
    for value in allowed:
        gauge.labels(**{label: value}).set(normalized.get(value, 0))


def set_one_hot(gauge: Gauge, label: str, allowed: tuple[str, ...], current: object) -> None:
    """1 for the current value, 0 for the others (the Prometheus "enum as gauges" idiom)."""
    now = label_value(current, allowed, label)
    for value in allowed:
        gauge.labels(**{label: value}).set(1 if value == now else 0)


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def build_labels(daemon: str) -> dict[str, str]:
    """The versions that explain a behaviour difference between two nodes of one swarm.

    The daemon kind is labelled ``daemon``, not ``role``: ``role`` is the compnode class (supernode|antnode)
    that service discovery attaches to every compnode target, and a scraped label of the same name would
    be renamed ``exported_role`` by Prometheus."""
    return {
        "version": __version__,
        "daemon": daemon,
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "hivemind": _dist_version("hivemind"),
    }


class BaseMetrics:
    """The part of a daemon's metric set that does not depend on its role."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None, *, process: bool = True):
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        if process:
            # process_cpu_seconds_total, process_resident_memory_bytes, ... for this daemon's process.
            ProcessCollector(registry=self.registry)
        self.build_info = Info(
            "fusionnet_build",
            "FusionNet build: package, Python, torch and hivemind versions",
            registry=self.registry,
        )
        self.build_info.info(build_labels(role))
        self.node_info = Gauge(
            "fusionnet_node_info",
            "Constant 1, labelled with this daemon's libp2p peer id (one series per daemon)",
            ["peer_id"],
            registry=self.registry,
        )
        self.up_since = Gauge(
            "fusionnet_start_time_seconds",
            "Unix time at which this daemon became ready",
            registry=self.registry,
        )

    def set_peer(self, peer_id: str, *, started_at: float) -> None:
        """Record who this daemon is, once it has joined (peer ids exist only after the DHT starts)."""
        if not peer_id:
            raise ValueError("metrics: peer_id must not be empty")
        self.node_info.clear()
        self.node_info.labels(peer_id=peer_id).set(1)
        self.up_since.set(started_at)


def metric_families(registry: CollectorRegistry) -> dict[str, str]:
    """Family name -> type of every metric a registry exposes (for tests and catalog checks)."""
    return {family.name: family.type for family in registry.collect()}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name worth querying in a scrape of ``registry`` (with _bucket/_sum/_count/_total/_info).

    Derived from the family types, not from current samples, so that a labelled family without
    children yet (no job has run) still counts as defined.
    """
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for name, kind in metric_families(registry).items():
        names.update(name + s for s in suffixes.get(kind, ("",)))
    return names


def referenced_metrics(texts: Iterable[str]) -> set[str]:
    """The ``fusionnet_*`` identifiers that appear in PromQL expressions or dashboard queries."""
    pattern = re.compile(r"\b(" + PREFIX + r"[a-zA-Z0-9_]+)")
    found: set[str] = set()
    for text in texts:
        found.update(pattern.findall(text))
    return found
