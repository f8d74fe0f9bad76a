"""The broker's metric set: swarm membership, jobs, steps, heartbeats, failover and recovery.

``BROKER_METRICS`` (on ``BROKER_REGISTRY``) is the process's broker metric set, and the module-level
names below (``SWARM_COMPNODES``, ``STEP_DURATION``, ...) are its objects. A test that runs several
brokers in one process gives each its own ``BrokerMetrics()`` so their numbers stay apart.

The methods keep the label discipline in one place: state vocabularies are checked, every state is
written (0 included), and per-job series are removed when the job ends.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fusionnet.metrics.common import (
    ERROR_RATIO_BUCKETS,
    JOB_STATES,
    NODE_STATES,
    RECOVERY_BUCKETS,
    RECOVERY_PHASES,
    ROLES,
    RTT_BUCKETS,
    STEP_BUCKETS,
    BaseMetrics,
    label_value,
    set_counts,
)
from fusionnet.metrics.serving import ServingMetrics

_MAX_JOB_ID = 128  # job ids are label values; refuse anything that is obviously not one


class BrokerMetrics(BaseMetrics):
    """Every metric the broker exports. One instance per broker (``BROKER_METRICS`` by default)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True):
        super().__init__("broker", registry, process=process)
        r = self.registry
        self._define_swarm_and_steps(r)
        self._define_per_job(r)
        self._define_health(r)
        self.serving = ServingMetrics(r)  # deployments and their HTTP API (issue 14)
        for state in JOB_STATES:
            self.jobs.labels(state=state)
        for role in ROLES:
            for state in NODE_STATES:
                self.swarm_compnodes.labels(role=role, state=state)
        for phase in RECOVERY_PHASES:
            self.recovery_phase.labels(phase=phase)
        self.backup_pool.set(0)

    def _define_swarm_and_steps(self, r: CollectorRegistry) -> None:
        """Membership, job counts and step totals."""
        self.swarm_compnodes = Gauge(
            "fusionnet_swarm_compnodes",
            "Compnodes the broker knows, by role and state (unreachable = heartbeats stopped)",
            ["role", "state"],
            registry=r,
        )
        self.backup_pool = Gauge(
            "fusionnet_backup_pool_compnodes",
            "Online backup compnodes not assigned to any job: the failover reserve",
            registry=r,
        )
        self.compnode_mtbf = Gauge(
            "fusionnet_compnode_mtbf_seconds",
            "Seconds between unplanned losses of one compnode, as the broker estimates them (the "
            "--compnode-mtbf prior and the losses it saw): what spaces a train job's failover rounds "
            "(NaN: no estimate)",
            registry=r,
        )
        self.compnode_mtbf.set(math.nan)  # until the broker has an estimate
        self.jobs = Gauge("fusionnet_jobs", "Jobs by state", ["state"], registry=r)
        self.jobs_submitted = Counter("fusionnet_jobs_submitted", "Jobs accepted by the broker", registry=r)
        self.steps = Counter(
            "fusionnet_steps", "Training/inference steps completed over all jobs", registry=r
        )
        self.samples = Counter("fusionnet_samples", "Samples processed over all jobs", registry=r)
        self.step_duration = Histogram(
            "fusionnet_step_duration_seconds",
            "Wall time of one step (one batch through FP, BP and Update over all sub-DAGs)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.subtask_prediction_error = Histogram(
            "fusionnet_subtask_prediction_error_ratio",
            "Performance-model error per sub-DAG and step: |its compnode's measured compute time / the "
            "plan's prediction - 1| (the per-compnode view of the step's error)",
            buckets=ERROR_RATIO_BUCKETS,
            registry=r,
        )
        self.step_prediction_error = Histogram(
            "fusionnet_step_prediction_error_ratio",
            "Performance-model error per step: |measured / predicted step time - 1|",
            buckets=ERROR_RATIO_BUCKETS,
            registry=r,
        )

    def _define_per_job(self, r: CollectorRegistry) -> None:
        """Per running job: removed by ``forget_job()``, so the job_id label is bounded by running jobs."""
        self.job_loss = Gauge("fusionnet_job_loss", "Loss of the job's latest step", ["job_id"], registry=r)
        self.job_step = Gauge(
            "fusionnet_job_step", "Index of the job's latest completed step", ["job_id"], registry=r
        )
        self.job_last_step_time = Gauge(
            "fusionnet_job_last_step_timestamp_seconds",
            "Unix time at which the job's latest step completed (job stalled = this stops moving)",
            ["job_id"],
            registry=r,
        )
        self.job_samples_rate = Gauge(
            "fusionnet_job_samples_per_second", "Samples/s of the job's latest step", ["job_id"], registry=r
        )
        self.job_prediction_error = Gauge(
            "fusionnet_job_prediction_error_ratio",
            "Latest step's measured / predicted time - 1 (signed: > 0 = slower than predicted)",
            ["job_id"],
            registry=r,
        )
        self.job_beyond_compute = Gauge(
            "fusionnet_job_step_beyond_compute_ratio",
            "Share of the job's latest step beyond its schedule run on its measured compute with free "
            "messages: what the network, the messaging and the broker's call cost (0 = compute-bound)",
            ["job_id"],
            registry=r,
        )
        self.job_compnodes = Gauge(
            "fusionnet_job_compnodes", "Compnodes running the job's sub-DAGs", ["job_id"], registry=r
        )

    def _define_health(self, r: CollectorRegistry) -> None:
        """Heartbeats, failover and recovery, and the probed links."""
        self.heartbeat_rtt = Histogram(
            "fusionnet_heartbeat_rtt_seconds",
            "Round trip of one broker -> compnode ping",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self.heartbeat_failures = Counter(
            "fusionnet_heartbeat_failures", "Pings that got no (valid) answer in time", registry=r
        )
        self.failovers = Counter(
            "fusionnet_failovers",
            "Compnodes replaced in a running job (by a backup or a re-plan)",
            registry=r,
        )
        self.recovery_phase = Histogram(
            "fusionnet_recovery_phase_duration_seconds",
            "Duration of one failover phase: detection (failure -> noticed), redistribution "
            "(noticed -> sub-DAG reassigned), replay (reassigned -> lost steps recomputed)",
            ["phase"],
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.link_latency = Gauge(
            "fusionnet_link_latency_seconds",
            "One direction's latency (alpha) of a link between two compnodes, as last probed",
            ["src", "dst"],
            registry=r,
        )
        self.link_bandwidth = Gauge(
            "fusionnet_link_bandwidth_bytes_per_second",
            "Bandwidth (1 / beta) of a link between two compnodes, as last probed",
            ["src", "dst"],
            registry=r,
        )

    # ---- swarm ------------------------------------------------------------------------------------
    def set_swarm(self, members: Iterable[tuple[object, object]], backup_pool: int) -> None:
        """Replace the membership gauges from (role, state) pairs, one pair per known compnode."""
        counts: dict[tuple[str, str], int] = {}
        for role, state in members:
            key = (label_value(role, ROLES, "role"), label_value(state, NODE_STATES, "state"))
            counts[key] = counts.get(key, 0) + 1
        if backup_pool < 0:
            raise ValueError(f"metrics: backup pool size must be >= 0, got {backup_pool}")
        for role in ROLES:
            for state in NODE_STATES:
                self.swarm_compnodes.labels(role=role, state=state).set(counts.get((role, state), 0))
        self.backup_pool.set(backup_pool)

    def observe_heartbeat(self, rtt_seconds: float | None) -> None:
        """One ping: its round trip, or None when it failed or timed out."""
        if rtt_seconds is None:
            self.heartbeat_failures.inc()
        else:
            self.heartbeat_rtt.observe(_non_negative(rtt_seconds, "heartbeat rtt"))

    # ---- jobs -------------------------------------------------------------------------------------
    def set_jobs(self, counts: Mapping[str, int]) -> None:
        """Replace the jobs-by-state gauge (state -> number of jobs; absent states read 0)."""
        set_counts(self.jobs, "state", JOB_STATES, counts)

    def observe_step(
        self,
        job_id: str,
        *,
        step: int,
        seconds: float,
        samples: int,
        loss: float | None = None,
        predicted_seconds: float | None = None,
        compnodes: int | None = None,
        compute_path_seconds: float | None = None,
        now: float | None = None,
    ) -> None:
        """Record one completed step of a running job (``compute_path_seconds``: metrics.jsonl's)."""
        _check_job_id(job_id)
        if step < 0 or samples < 0:
            raise ValueError(f"metrics: job {job_id}: step and samples must be >= 0, got {step}, {samples}")
        seconds = _non_negative(seconds, f"job {job_id} step duration")
        self.steps.inc()
        self.samples.inc(samples)
        self.step_duration.observe(seconds)
        self.job_step.labels(job_id=job_id).set(step)
        self.job_last_step_time.labels(job_id=job_id).set(time.time() if now is None else now)
        if seconds > 0:
            self.job_samples_rate.labels(job_id=job_id).set(samples / seconds)
        if loss is not None and math.isfinite(loss):
            self.job_loss.labels(job_id=job_id).set(loss)
        elif loss is not None:
            self.job_loss.labels(job_id=job_id).set(math.nan)  # diverged: visible as NaN, not as stale
        if compnodes is not None:
            self.job_compnodes.labels(job_id=job_id).set(compnodes)
        if compute_path_seconds is not None and seconds > 0:
            beyond = max(
                0.0, 1.0 - _non_negative(compute_path_seconds, f"job {job_id} compute path") / seconds
            )
            self.job_beyond_compute.labels(job_id=job_id).set(beyond)
        if predicted_seconds is not None and predicted_seconds > 0:
            error = seconds / predicted_seconds - 1.0
            self.job_prediction_error.labels(job_id=job_id).set(error)
            self.step_prediction_error.observe(abs(error))

    def forget_job(self, job_id: str) -> None:
        """Drop a finished job's per-job series (bounded label set: only running jobs carry a job_id)."""
        for gauge in (
            self.job_loss,
            self.job_step,
            self.job_last_step_time,
            self.job_samples_rate,
            self.job_prediction_error,
            self.job_beyond_compute,
            self.job_compnodes,
        ):
            # A job may never have set a series (no loss for infer, no prediction, ...).
            with contextlib.suppress(KeyError):
                gauge.remove(job_id)

    # ---- failover ---------------------------------------------------------------------------------
    def observe_subtask_prediction(self, measured_seconds: float, predicted_seconds: float) -> None:
        """One sub-DAG's step: its compnode's measured compute time against the plan's prediction."""
        if not (predicted_seconds > 0 and measured_seconds >= 0):
            raise ValueError(
                "metrics: need predicted > 0 and measured >= 0 seconds, "
                f"got {predicted_seconds}, {measured_seconds}"
            )
        self.subtask_prediction_error.observe(abs(measured_seconds / predicted_seconds - 1.0))

    def observe_recovery(self, phase: str, seconds: float) -> None:
        """One phase of one failover; count the failover itself with ``failovers.inc()`` once."""
        value = label_value(phase, RECOVERY_PHASES, "phase")
        self.recovery_phase.labels(phase=value).observe(_non_negative(seconds, f"recovery {value}"))

    # ---- links -------------------------------------------------------------------------------------
    def set_links(self, links: Mapping[tuple[str, str], tuple[float, float]]) -> None:
        """Replace the link gauges: (from peer, to peer) -> (latency seconds, bandwidth bytes/s)."""
        for (src, dst), (latency, bandwidth) in links.items():
            for peer in (src, dst):
                if not peer or len(peer) > _MAX_JOB_ID or not peer.isprintable():
                    raise ValueError(f"metrics: {peer[:40]!r} is not a peer id")
            _non_negative(latency, f"link {src} -> {dst} latency")
            if not bandwidth > 0:
                raise ValueError(f"metrics: link {src} -> {dst} bandwidth must be > 0, got {bandwidth}")
        self.link_latency.clear()
        self.link_bandwidth.clear()
        for (src, dst), (latency, bandwidth) in links.items():
            self.link_latency.labels(src=src, dst=dst).set(latency)
            self.link_bandwidth.labels(src=src, dst=dst).set(bandwidth)


def _check_job_id(job_id: str) -> None:
    if not job_id or len(job_id) > _MAX_JOB_ID or not job_id.isprintable():
        raise ValueError(f"metrics: {job_id[:40]!r} is not a job id (1..{_MAX_JOB_ID} printable characters)")


def _non_negative(value: float, what: str) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"metrics: {what} must be a finite number >= 0 seconds, got {value}")
    return float(value)


BROKER_METRICS = BrokerMetrics()
BROKER_REGISTRY = BROKER_METRICS.registry

# Module-level names for the objects of the process's broker metric set.
SWARM_COMPNODES = BROKER_METRICS.swarm_compnodes
BACKUP_POOL = BROKER_METRICS.backup_pool
JOBS = BROKER_METRICS.jobs
JOBS_SUBMITTED = BROKER_METRICS.jobs_submitted
STEPS = BROKER_METRICS.steps
SAMPLES = BROKER_METRICS.samples
STEP_DURATION = BROKER_METRICS.step_duration
STEP_PREDICTION_ERROR = BROKER_METRICS.step_prediction_error
JOB_LOSS = BROKER_METRICS.job_loss
JOB_STEP = BROKER_METRICS.job_step
JOB_LAST_STEP_TIME = BROKER_METRICS.job_last_step_time
JOB_SAMPLES_RATE = BROKER_METRICS.job_samples_rate
JOB_PREDICTION_ERROR = BROKER_METRICS.job_prediction_error
JOB_COMPNODES = BROKER_METRICS.job_compnodes
HEARTBEAT_RTT = BROKER_METRICS.heartbeat_rtt
HEARTBEAT_FAILURES = BROKER_METRICS.heartbeat_failures
FAILOVERS = BROKER_METRICS.failovers
RECOVERY_PHASE = BROKER_METRICS.recovery_phase
