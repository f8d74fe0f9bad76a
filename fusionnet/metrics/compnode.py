"""The compnode's metric set: its state, compute phases, data paths, refusals and performance fit.

``COMPNODE_METRICS`` (on ``COMPNODE_REGISTRY``) is the process's compnode metric set, and the
module-level names below are its objects. Tests that run several compnodes in one process give each
its own ``CompnodeMetrics()``.

Series here are per node by nature (each compnode exports its own), so the compnode's own fitted
speed factor needs no peer label: Prometheus attaches the ``peer`` target label from service
discovery.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fusionnet.metrics.common import (
    COMPUTE_BUCKETS,
    COMPUTE_PHASES,
    DATA_PATHS,
    DIRECTIONS,
    NODE_STATES,
    SUBTASK_OUTCOMES,
    BaseMetrics,
    label_value,
    set_one_hot,
)
from fusionnet.metrics.workers import WorkerProcesses
from fusionnet.wire.refusal import REASONS

REFUSAL_REASONS = tuple(sorted(REASONS))
# The paper's names for the phases (FusionAI: FP, BP, Update), accepted as well as the label values.
PHASE_ALIASES = {"fp": "forward", "bp": "backward"}


class CompnodeMetrics(BaseMetrics):
    """Every metric a compnode exports. One instance per compnode (``COMPNODE_METRICS`` by default)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True):
        super().__init__("compnode", registry, process=process)
        r = self.registry
        self.state = Gauge(
            "fusionnet_compnode_state", "1 for the compnode's current state", ["state"], registry=r
        )
        self.load = Gauge(
            "fusionnet_compnode_load", "Announced load: fraction of capacity in use (0..1)", registry=r
        )
        self.running_subtasks = Gauge(
            "fusionnet_compnode_running_subtasks",
            "Sub-tasks (sub-DAGs of running jobs) held or being built now",
            registry=r,
        )
        self.subtasks = Counter(
            "fusionnet_compnode_subtasks", "Sub-tasks finished, by outcome", ["outcome"], registry=r
        )
        # The sandbox workers' CPU and memory: the daemon's process_* series do not include them.
        self.workers = WorkerProcesses()
        r.register(self.workers)
        self.speed_factor = Gauge(
            "fusionnet_compnode_speed_factor",
            "Fitted speed factor lambda_p = measured / peak FLOPS (FusionAI 3.7)",
            registry=r,
        )
        self.peak_flops = Gauge(
            "fusionnet_compnode_peak_flops", "Nominal peak speed S*(p) of the device, FLOP/s", registry=r
        )
        self.activation_peak = Gauge(
            "fusionnet_compnode_activation_peak_bytes",
            "Most activation bytes held at once in the last training step (micro-batches between F and B)",
            registry=r,
        )
        self.compute_duration = Histogram(
            "fusionnet_compute_duration_seconds",
            "Time of one step's phase of this compnode's sub-DAG, all its micro-batches: forward (FP), "
            "backward (BP), update",
            ["phase"],
            buckets=COMPUTE_BUCKETS,
            registry=r,
        )
        self.data_bytes = Counter(
            "fusionnet_data_bytes",
            "Tensor bytes exchanged with other compnodes (activations forward, gradients backward)",
            ["path", "direction"],
            registry=r,
        )
        self.data_frames = Counter(
            "fusionnet_data_frames",
            "Tensor frames exchanged with other compnodes",
            ["path", "direction"],
            registry=r,
        )
        self.frames_refused = Counter(
            "fusionnet_frames_refused", "Frames from peers refused, by reason", ["reason"], registry=r
        )
        for phase in COMPUTE_PHASES:
            self.compute_duration.labels(phase=phase)
        for path in DATA_PATHS:
            for direction in DIRECTIONS:
                self.data_bytes.labels(path=path, direction=direction)
                self.data_frames.labels(path=path, direction=direction)
        for reason in REFUSAL_REASONS:
            self.frames_refused.labels(reason=reason)
        for outcome in SUBTASK_OUTCOMES:
            self.subtasks.labels(outcome=outcome)
        set_one_hot(self.state, "state", NODE_STATES, "joining")

    def set_state(self, state: object) -> None:
        set_one_hot(self.state, "state", NODE_STATES, state)

    def set_load(self, load: float, running_subtasks: int) -> None:
        if not 0.0 <= load <= 1.0 or running_subtasks < 0:
            raise ValueError(
                f"metrics: load must be in [0, 1] and running sub-tasks >= 0, got {load}, {running_subtasks}"
            )
        self.load.set(load)
        self.running_subtasks.set(running_subtasks)

    def set_hardware(self, *, speed_factor: float, peak_flops: float) -> None:
        """The profiling result (and every later re-fit of lambda_p)."""
        if not (speed_factor > 0 and peak_flops > 0 and math.isfinite(speed_factor * peak_flops)):
            raise ValueError(
                f"metrics: speed factor and peak FLOPS must be > 0, got {speed_factor}, {peak_flops}"
            )
        self.speed_factor.set(speed_factor)
        self.peak_flops.set(peak_flops)

    def observe_compute(self, phase: str, seconds: float) -> None:
        """One micro-batch's forward / backward, or one update, on this compnode (``fp``/``bp`` work too)."""
        text = str(getattr(phase, "value", phase)).lower()
        value = label_value(PHASE_ALIASES.get(text, text), COMPUTE_PHASES, "phase")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"metrics: {value} duration must be a finite number >= 0, got {seconds}")
        self.compute_duration.labels(phase=value).observe(seconds)

    def set_activation_peak(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"metrics: activation bytes must be >= 0, got {nbytes}")
        self.activation_peak.set(nbytes)

    def count_data(self, path: str, direction: str, nbytes: int, frames: int = 1) -> None:
        """Bytes (and frames) moved over a data path: ``tcp`` (direct) or ``p2p`` (libp2p stream)."""
        p = label_value(path, DATA_PATHS, "path")
        d = label_value(direction, DIRECTIONS, "direction")
        if nbytes < 0 or frames < 0:
            raise ValueError(f"metrics: byte and frame counts must be >= 0, got {nbytes}, {frames}")
        self.data_bytes.labels(path=p, direction=d).inc(nbytes)
        self.data_frames.labels(path=p, direction=d).inc(frames)

    def count_refusal(self, reason: str, frames: int = 1) -> None:
        """One refused frame; ``reason`` is a ``fusionnet.wire.refusal`` reason code."""
        self.frames_refused.labels(reason=label_value(reason, REFUSAL_REASONS, "reason")).inc(frames)

    def count_subtask(self, outcome: str) -> None:
        self.subtasks.labels(outcome=label_value(outcome, SUBTASK_OUTCOMES, "outcome")).inc()


COMPNODE_METRICS = CompnodeMetrics()
COMPNODE_REGISTRY = COMPNODE_METRICS.registry

# Module-level names for the objects of the process's compnode metric set.
COMPNODE_STATE = COMPNODE_METRICS.state
COMPNODE_LOAD = COMPNODE_METRICS.load
RUNNING_SUBTASKS = COMPNODE_METRICS.running_subtasks
SUBTASKS = COMPNODE_METRICS.subtasks
SPEED_FACTOR = COMPNODE_METRICS.speed_factor
PEAK_FLOPS = COMPNODE_METRICS.peak_flops
COMPUTE_DURATION = COMPNODE_METRICS.compute_duration
DATA_BYTES = COMPNODE_METRICS.data_bytes
DATA_FRAMES = COMPNODE_METRICS.data_frames
FRAMES_REFUSED = COMPNODE_METRICS.frames_refused
