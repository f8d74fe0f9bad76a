"""What a job run may use of the broker, and nothing more: ``JobContext``.

``JobService``, ``JobRun``, ``FailureWatch`` and ``RecoveryLog`` get this small object
(``BrokerDaemon.job_context()``), never the daemon itself; a test builds one from in-memory parts (a
store on a temporary file, a registry, fake compnodes behind a ``CompnodeClient``) without any process
or network (``tests/test_jobrun_decisions.py``).

The store and the jobs folder exist only once the daemon has started (its state dir is acquired and
its SQLite file opened at startup), so they are reached through callables, asked when used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.broker.churn import ChurnBook
from fusionnet.broker.config import BrokerConfig
from fusionnet.broker.registry import CompnodeRegistry
from fusionnet.broker.store import BrokerStore
from fusionnet.messages.compnode_rpc import CompnodeClient
from fusionnet.metrics import BrokerMetrics
from fusionnet.planning.links import LinkBook
from fusionnet.planning.speeds import SpeedBook


@dataclass(frozen=True)
class JobContext:
    open_store: Callable[[], BrokerStore]  # the broker's SQLite store (open once the daemon started)
    registry: CompnodeRegistry  # compnodes, their state and reachability; listeners for failover
    settings: BrokerConfig  # sync_every, replan_gain, placement_policy
    metrics: BrokerMetrics  # steps, recoveries, failovers; per-job series forgotten at the end
    speeds: SpeedBook  # compnode speeds measured on real sub-tasks, across jobs
    links: LinkBook  # probed links between compnodes, across jobs
    compnodes: CompnodeClient  # typed calls to compnodes
    refresh_job_metrics: Callable[[], None]  # recount the jobs-by-state gauge after a state change
    jobs_folder: Callable[[], Path]  # where each job keeps its submission, checkpoint and results
    broker_id: Callable[[], str] = lambda: ""  # our peer id, once started (what submitters sign for)
    # The jobs and deployments running now (their run task alive), shared by the services and the
    # heartbeat, which tells every compnode (``PingRequest.jobs``).
    live_jobs: set[str] = field(default_factory=set)
    # How often compnodes fail, from the registry's events (spaces failover rounds: ``broker.churn``).
    churn: ChurnBook = field(default_factory=ChurnBook)

    @property
    def store(self) -> BrokerStore:
        return self.open_store()

    @property
    def jobs_dir(self) -> Path:
        return self.jobs_folder()
