"""The broker daemon (FusionAI 3.2): announces itself in the DHT, keeps the compnode registry from DHT
records and ping-pong heartbeats, persists what it sees in SQLite, and answers ``status``.

Job intake and orchestration is a ``Service`` (see ``fusionnet.daemon.base``): ``JobService`` in
``fusionnet/broker/jobs.py`` with ``rpc_submit_job`` etc., which ``cmd_broker`` builds explicitly
(``JobService(broker.job_context())``) and adds with ``broker.add_service(...)`` before ``serve()``. What
job runs may use of the broker is exactly ``broker.context.JobContext``: registry, store, settings,
metrics, speeds, links, the typed ``CompnodeClient`` and the job-gauge refresh.

Metrics (``broker.metrics``, a ``fusionnet.metrics.BrokerMetrics``): the daemon itself keeps the swarm
gauges (compnodes by role and state, backup pool), the heartbeat RTT histogram and failure counter, and the
jobs-by-state gauge (recounted from the store at every refresh). The job service reports the rest:
``metrics.observe_step(job_id, step=, seconds=, samples=, loss=, predicted_seconds=, compnodes=)`` per
step, ``metrics.forget_job(job_id)`` when a job ends, ``metrics.jobs_submitted.inc()``,
``metrics.failovers.inc()`` and ``metrics.observe_recovery(phase, seconds)``; after changing a job's state
in the store it may call ``refresh_job_metrics()`` rather than wait for the next refresh.

Service discovery: compnodes announce ``metrics_address`` in their records; the broker serves them as
Prometheus http_sd at ``/sd/compnodes`` on its metrics port, and rewrites ``--sd-file`` (file_sd) at
every refresh, so compnodes that join later are scraped without touching Prometheus's configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from fusionnet import __version__
from fusionnet.broker.churn import ChurnBook
from fusionnet.broker.config import BrokerConfig
from fusionnet.broker.context import JobContext
from fusionnet.broker.registry import CompnodeEntry, CompnodeRegistry, RegistryEvent
from fusionnet.broker.store import BrokerStore, CompnodeRow
from fusionnet.daemon.addresses import useful_maddrs
from fusionnet.daemon.base import Daemon
from fusionnet.daemon.files import read_address_file, write_address_file
from fusionnet.dht.records import BrokerRecord, CompnodeRecord, NodeState, is_bind_all, split_host_port
from fusionnet.errors import FusionNetError, JobError
from fusionnet.messages.auth import verify_auth
from fusionnet.messages.base import handles
from fusionnet.messages.broker_rpc import MAX_PING_JOBS, PingReply, PingRequest, StatusReply, StatusRequest
from fusionnet.messages.compnode_rpc import CompnodeClient
from fusionnet.metrics import BrokerMetrics, ScrapeTarget, write_file_sd
from fusionnet.metrics.sd import TargetSource
from fusionnet.perfmodel.types import Link
from fusionnet.planning.links import LinkBook
from fusionnet.planning.speeds import SpeedBook
from fusionnet.rpc.server import RPCContext

log = logging.getLogger("fusionnet.broker")

DB_FILE = "broker.sqlite3"
# the compnodes' multiaddrs, newest first, that a restarted broker rejoins the swarm through
KNOWN_PEERS_FILE = "known_peers"
KNOWN_PEERS_MAX = 16
JOB_COLUMNS = ("job_id", "name", "state", "step", "steps", "loss", "error", "updated_at")
SHOWN_TO_ALL = ("job_id", "state", "step", "steps", "updated_at")  # the rest: to the job's submitter only


class BrokerDaemon(Daemon):
    role = "broker"
    metrics: BrokerMetrics

    def __init__(self, config: BrokerConfig, metrics: BrokerMetrics | None = None):
        super().__init__(config.common, metrics if metrics is not None else BrokerMetrics(process=False))
        self.settings = config
        self.registry = CompnodeRegistry(config.heartbeat_timeout)
        self.speeds = SpeedBook()  # compnode speeds as measured on real sub-tasks, across jobs
        # links between compnodes as probed after placements, across jobs (exported as gauges)
        self.links = LinkBook(on_change=self._export_links)
        self.store: BrokerStore | None = None
        self.state = NodeState.JOINING
        self._maddrs: list[str] = []
        self._known_peers: list[str] = []  # what ``KNOWN_PEERS_FILE`` holds
        # Rebuilt by the event loop, read by the metrics server's thread: swapped whole, never mutated.
        self._scrape_targets: tuple[ScrapeTarget, ...] = ()
        self._bad_metrics_addresses: set[tuple[str, str]] = set()
        self.live_jobs: set[str] = set()  # the services' running jobs and deployments (``JobContext``)
        self.churn = ChurnBook(config.compnode_mtbf)  # how often compnodes fail (``broker.churn``)
        self.registry.add_listener(lambda event: self.churn.observe(event, time.time()))
        self.registry.add_listener(self._persist_event)  # after the churn book: a loss is saved at once
        self.compnodes = CompnodeClient(self.call)
        # ``status`` lists what this returns (the deployment service sets it: issue 14)
        self.describe_deployments: Callable[[], list[dict[str, Any]]] = list

    def job_context(self) -> JobContext:
        """What the job service and its runs may use of this broker (``broker.context``)."""
        return JobContext(
            open_store=self._store,
            registry=self.registry,
            settings=self.settings,
            metrics=self.metrics,
            speeds=self.speeds,
            links=self.links,
            compnodes=self.compnodes,
            refresh_job_metrics=self.refresh_job_metrics,
            jobs_folder=lambda: self.state_dir.path / "jobs",
            broker_id=lambda: self.peer_id,
            live_jobs=self.live_jobs,
            churn=self.churn,
        )

    def _store(self) -> BrokerStore:
        assert self.store is not None, "the broker's store opens at startup, before services start"
        return self.store

    def _export_links(self, links: dict[tuple[str, str], Link]) -> None:
        self.metrics.set_links({pair: (k.alpha, k.bandwidth) for pair, k in links.items()})

    # ---- startup / shutdown ----------------------------------------------------------------------
    async def on_startup(self) -> None:
        self.store = self._open_store()
        self.state = NodeState.ONLINE
        assert self.peer is not None
        # Bytes of weights/checkpoints still moving to or from a compnode count as signs of life: its
        # pings may queue behind them on a slow link (``CompnodeRegistry.record_traffic``).
        self.peer.client.on_progress = lambda peer_id: self.registry.record_traffic(peer_id, time.time())
        await self._rejoin()
        await self._refresh()  # announce + first registry fill before we call ourselves ready
        await self.start_services()
        self.every(self.config.refresh_period, self._refresh, "dht refresh")
        self.every(self.settings.heartbeat_period, self._heartbeat, "heartbeat")

    def _open_store(self) -> BrokerStore:
        """The broker's database, and what its earlier runs saw of compnode failures (``broker.churn``)."""
        store = BrokerStore(self.state_dir.file(DB_FILE))
        self.churn.resume(*store.churn())
        return store

    async def on_stopped(self) -> None:
        self.state = NodeState.OFFLINE
        try:
            await self._announce()
        finally:
            if self.store is not None:
                self._persist_all()
                self.store.close()
                self.store = None

    async def _rejoin(self) -> None:
        """Dials the compnodes of our last run (``KNOWN_PEERS_FILE``). Why: restarted without
        ``--initial-peers`` (the swarm's first peer), our DHT would know nobody, and the compnodes never
        dial a restarted broker back on their own: its jobs could not resume, nor new ones be placed."""
        path = self.state_dir.file(KNOWN_PEERS_FILE)
        try:
            known = read_address_file(path)[:KNOWN_PEERS_MAX] if path.exists() else []
        except (OSError, UnicodeDecodeError) as e:
            log.warning("cannot read %s (%s): joining through --initial-peers only", path, e)
            return
        if known:
            assert self.peer is not None
            answered = await self.peer.join_through(known)
            log.info("rejoined the swarm through %d compnode(s) known from the last run", answered)

    def _remember_peers(self) -> None:
        """The multiaddrs of the compnodes seen last (newest first), for a restart to rejoin through
        (``rejoin_maddrs``); the file changes only when they do."""
        entries = sorted(
            (e for e in self.registry.entries() if not e.gone), key=lambda e: e.last_seen, reverse=True
        )
        maddrs = [m for e in entries for m in e.record.maddrs if "/p2p/" in m][:KNOWN_PEERS_MAX]
        if not maddrs or maddrs == self._known_peers:
            return
        try:
            write_address_file(self.state_dir.file(KNOWN_PEERS_FILE), maddrs)
        except OSError as e:
            log.warning("cannot keep the compnodes' addresses for a restart: %s", e)
            return
        self._known_peers = maddrs

    # ---- periodic work ---------------------------------------------------------------------------
    def record(self) -> BrokerRecord:
        return BrokerRecord(peer_id=self.peer_id, state=self.state, maddrs=self._maddrs, version=__version__)

    async def _announce(self) -> None:
        assert self.peer is not None
        self._maddrs = useful_maddrs(await self.peer.visible_maddrs())
        assert self.config.record_ttl is not None
        if not await self.peer.announcer.announce(self.record(), ttl=self.config.record_ttl):
            log.warning("no DHT node accepted our broker record (will retry next refresh)")

    async def _refresh(self) -> None:
        """Re-announce ourselves, then merge a fresh lookup of compnode records into the registry."""
        assert self.peer is not None
        await self._announce()
        found = await self.peer.announcer.lookup(CompnodeRecord)
        now = time.time()
        self.registry.update_records(found, now)
        self.links.keep_only({e.peer_id for e in self.registry.entries()})  # forgotten ones' links go too
        self._persist_all()
        self._remember_peers()
        self._update_swarm_metrics()
        self.refresh_job_metrics()
        await self._update_scrape_targets()

    async def _heartbeat(self) -> None:
        """One ping round over every compnode that has not left; RTTs and silences go to the registry."""
        peers = self.registry.to_ping()
        # Not while shutting down: the services stop (their runs end) before the heartbeat does, and
        # the jobs a restarted broker resumes must not look over to their compnodes meanwhile.
        listed = len(self.live_jobs) <= MAX_PING_JOBS and not self.should_exit.is_set()
        live = sorted(self.live_jobs) if listed else None  # one list for the whole round
        results = await asyncio.gather(*(self._ping(p, live) for p in peers))
        now = time.time()
        for peer_id, rtt in zip(peers, results):
            self.metrics.observe_heartbeat(rtt)
            if rtt is None:
                self.registry.record_failure(peer_id, now)
            else:
                self.registry.record_pong(peer_id, rtt, now)
        self.registry.check_timeouts(now)
        self._update_swarm_metrics()  # reachability may have changed

    async def _ping(self, peer_id: str, live: list[str] | None) -> float | None:
        nonce = secrets.token_hex(8)
        start = time.perf_counter()
        try:
            reply = await self.compnodes.call_ping(
                peer_id, PingRequest(nonce=nonce, jobs=live), timeout=self.settings.ping_timeout
            )
        except FusionNetError as e:
            log.debug("ping %s failed: %s", peer_id, e)
            return None
        if reply.nonce != nonce:
            log.warning("ping %s answered with the wrong nonce; counting it as lost", peer_id)
            return None
        return time.perf_counter() - start

    # ---- metrics and service discovery ----------------------------------------------------------
    def _update_swarm_metrics(self) -> None:
        entries = self.registry.entries()
        # The failover reserve: backups that take work (ONLINE, answering) and hold none now.
        pool = sum(1 for e in entries if e.schedulable and e.record.backup and e.record.running_tasks == 0)
        # A compnode whose record expired without an OFFLINE goodbye (a crash) counts as unreachable until
        # the registry forgets it (``effective_state``): as "offline" it would look like a graceful leave,
        # and the FusionNetCompnodesUnreachable alert would lose it 30 s after the crash, before its ``for:``.
        states = ((e.record.role, e.effective_state) for e in entries)
        self.metrics.set_swarm(states, backup_pool=pool)
        mtbf = self.churn.compnode_mtbf(time.time())
        # no estimate (``--compnode-mtbf 0`` and no loss seen): NaN, not 0 ("a loss every 0 s")
        self.metrics.compnode_mtbf.set(math.nan if mtbf is None else mtbf)

    def refresh_job_metrics(self) -> None:
        """Recount ``fusionnet_jobs{state}`` from the store (the source of truth, whoever changed it)."""
        if self.store is not None:
            self.metrics.set_jobs(self.store.count_jobs_by_state())

    def metrics_sd_source(self) -> TargetSource:
        return lambda: self._scrape_targets

    def scrape_targets(self) -> list[ScrapeTarget]:
        """Compnodes Prometheus should scrape: every one that names a metrics endpoint, but for those that
        left gracefully (OFFLINE). Unreachable ones stay listed, and so do crashed ones (their record
        expired without a goodbye) until the registry forgets them (10 minutes): ``up == 0`` is how a
        dead compnode shows, and dropped with its record 30 s after the crash it could never last the
        FusionNetCompnodeDown alert's ``for:``."""
        targets = []
        for entry in self.registry.entries():
            record = entry.record
            if record.state == NodeState.OFFLINE or record.metrics_address is None:
                continue
            host, port = split_host_port(record.metrics_address)
            if is_bind_all(host):
                key = (record.peer_id, record.metrics_address)
                if key not in self._bad_metrics_addresses:  # one line per address, not one per refresh
                    self._bad_metrics_addresses.add(key)
                    log.warning(
                        "compnode %s announces metrics at %s, a bind-all address; not a scrape target",
                        record.peer_id,
                        record.metrics_address,
                    )
                continue
            targets.append(ScrapeTarget(host, port, record.role.value, record.backup, record.peer_id))
        return targets

    async def _update_scrape_targets(self) -> None:
        targets = tuple(self.scrape_targets())
        self._scrape_targets = targets
        sd_file = self.settings.sd_file
        if sd_file is None:
            return
        try:
            if await asyncio.to_thread(write_file_sd, sd_file, targets):
                log.info("wrote %d compnode scrape target(s) to %s", len(targets), sd_file)
        except OSError as e:  # Prometheus misses new targets until it works again; the broker goes on
            log.warning("cannot write --sd-file %s: %s", sd_file, e)

    # ---- persistence -----------------------------------------------------------------------------
    def _persist_event(self, event: RegistryEvent) -> None:
        entry = self.registry.get(event.peer_id)
        if self.store is not None and entry is not None:
            self.store.upsert_compnodes([self._row(entry)])
        if self.store is not None and event.kind == "unreachable":
            self.store.save_churn(*self.churn.history(time.time()))

    def _persist_all(self) -> None:
        if self.store is not None:
            self.store.upsert_compnodes(self._row(e) for e in self.registry.entries())
            self.store.save_churn(*self.churn.history(time.time()))

    @staticmethod
    def _row(entry: CompnodeEntry) -> CompnodeRow:
        r = entry.record
        return CompnodeRow(
            peer_id=r.peer_id,
            role=r.role.value,
            backup=r.backup,
            state=entry.effective_state,
            reachable=entry.reachable,
            hardware=None if r.hardware is None else r.hardware.model_dump(mode="json"),
            first_seen=entry.first_seen,
            last_seen=entry.last_seen,
            last_heartbeat=entry.last_heartbeat,
            rtt=entry.rtt,
        )

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(PingRequest)
    async def rpc_ping(self, request: PingRequest, context: RPCContext) -> PingReply:
        return PingReply(nonce=request.nonce, peer_id=self.peer_id, state=self.state.value)

    @handles(StatusRequest)
    async def rpc_status(self, request: StatusRequest, context: RPCContext) -> StatusReply:
        """Compnodes (role, backup, state, hardware, load, last heartbeat) and jobs (id, state, step; name,
        loss and error only of the caller's own jobs, when it signed the request), for ``fusionnet
        status`` and dashboards."""
        now = time.time()
        jobs = [] if self.store is None else self.store.list_jobs(request.job_limit)
        me = None
        if request.auth is not None:  # a bad signature is no error here: the caller just sees less
            with contextlib.suppress(JobError):
                me = verify_auth(
                    request.auth, broker=self.peer_id, caller=context.remote_peer, scope="status"
                )
        return StatusReply(
            broker={
                "peer_id": self.peer_id,
                "version": __version__,
                "uptime": now - self.started_at,
                "state": self.state.value,
                "services": [s.name for s in self.services],
            },
            compnodes=[e.to_status(now) for e in self.registry.entries()],
            jobs=[
                {k: job[k] if k in SHOWN_TO_ALL or job.get("submitter") == me else None for k in JOB_COLUMNS}
                for job in jobs
            ],
            deployments=self.describe_deployments(),
        )
