"""The broker's settings (``fusionnet broker`` flags), validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.broker.admission import AdmissionConfig
from fusionnet.broker.churn import PRIOR_MTBF
from fusionnet.daemon.config import DaemonConfig
from fusionnet.planning.auto_interleaved import MIN_GAIN
from fusionnet.planning.placement import BALANCED, SCHEDULER


@dataclass
class BrokerConfig:
    common: DaemonConfig = field(default_factory=DaemonConfig)
    heartbeat_period: float = 1.0  # seconds between ping rounds
    heartbeat_timeout: float = 3.0  # a compnode silent this long is unreachable
    # Train jobs: collect parameters and optimizer state on the broker every this many steps (0: never;
    # failover checkpoints are replicated between the job's compnodes, ``broker.replicas``; a job on a
    # single compnode has no peer to replicate to and is collected every step).
    sync_every: int = 0
    placement_policy: str = SCHEDULER  # or BALANCED (the plain equal split), for comparison
    replan_gain: float = 0.1  # a joining compnode triggers a re-plan when the step gets this much faster
    # ``placement.schedule: auto`` interleaves when predicted this much faster (``auto_interleaved``)
    interleave_gain: float = MIN_GAIN
    ping_timeout: float | None = None  # one ping's limit; default min(heartbeat period, timeout)
    sd_file: Path | None = None  # Prometheus file_sd target list of compnodes, rewritten at every refresh
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # who may submit, quotas
    # A sub-DAG's state or optimizer slice over this size goes to its compnode in parts of this size
    # ahead of the assignment (``results.slice_stream``): what the broker holds at a time.
    stage_part_mb: float = 32.0
    # Send step k + 1 while step k runs (issue 13), so that compnodes never wait for the broker's round
    # trip. Off by default: measured slower on a loaded 2-core machine (README, Pipeline benchmark).
    steps_ahead: bool = False
    # Train jobs: a round of failover snapshots (``broker.replicas``) starts at most every this many
    # seconds, so fast steps are not slowed by replication; a failover replays at most this much more.
    replica_interval: float = 2.0
    # And by Young's interval for a round's measured cost and the compnodes' failure rate, estimated
    # from this prior (seconds between unplanned losses of one compnode) and what the registry saw;
    # 0: off (``broker.churn``).
    compnode_mtbf: float = PRIOR_MTBF
    # A deployment's batches: "direct" to the compnodes' sandbox workers over the data path
    # (``broker.serve_links``), falling back to RPC; "rpc": ``serve_step`` calls through the daemons.
    serve_path: str = "direct"

    def __post_init__(self) -> None:
        if not self.heartbeat_period > 0:
            raise ValueError(f"--heartbeat-period must be > 0 seconds, got {self.heartbeat_period}")
        if not self.heartbeat_timeout > self.heartbeat_period:
            raise ValueError(
                f"--heartbeat-timeout ({self.heartbeat_timeout} s) must exceed --heartbeat-period "
                f"({self.heartbeat_period} s), or every compnode looks unreachable between pings"
            )
        if not 0.001 <= self.stage_part_mb <= 1024:
            raise ValueError(f"--stage-part-mb must be in [0.001, 1024] MB, got {self.stage_part_mb}")
        if not 0.0 <= self.replica_interval <= 86400:
            raise ValueError(f"--replica-interval must be in [0, 86400] seconds, got {self.replica_interval}")
        if not 0.0 <= self.compnode_mtbf <= 1e8:
            raise ValueError(f"--compnode-mtbf must be in [0, 1e8] seconds, got {self.compnode_mtbf}")
        if self.sync_every < 0:
            raise ValueError(f"--sync-every must be >= 0 steps, got {self.sync_every}")
        if not 0.0 <= self.replan_gain < 1.0:
            raise ValueError(f"--replan-gain must be in [0, 1), got {self.replan_gain}")
        if not -1.0 <= self.interleave_gain <= 1.0:
            raise ValueError(f"--interleave-gain must be in [-1, 1], got {self.interleave_gain}")
        if self.serve_path not in ("direct", "rpc"):
            raise ValueError(f"--serve-path must be direct or rpc, got {self.serve_path!r}")
        if self.placement_policy not in (SCHEDULER, BALANCED):
            raise ValueError(f"unknown placement policy {self.placement_policy!r}")
        if self.ping_timeout is None:
            self.ping_timeout = min(self.heartbeat_period, self.heartbeat_timeout)
        if self.sd_file is not None:
            self.sd_file = Path(self.sd_file)
            if not self.sd_file.parent.is_dir():
                raise ValueError(f"--sd-file {self.sd_file}: directory {self.sd_file.parent} does not exist")
            if self.sd_file.is_dir():
                raise ValueError(f"--sd-file {self.sd_file}: is a directory; give the file's path")
