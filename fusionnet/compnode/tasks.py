"""Sub-task execution on a compnode (FusionAI 3.6): the service behind the broker's ``assign``,
``step``, ``collect`` and ``release`` calls, and the data path its executors talk over.

The data path is a direct TCP server (``fusionnet.wire.DataPathServer``) announced in the compnode's
record, with hivemind P2P streams as the fallback when a peer's TCP address cannot be reached. Frames
are authenticated with the keys the broker hands out in ``assign``, one per link between two of the
job's compnodes (so no member can pass its frames off as another's), and only the job's other
compnodes may send: anything else is refused and counted, and the job goes on.

Only a broker this compnode trusts may assign a job (``trust.py``: the peers of ``--initial-peers`` and
``--trusted-broker``), and only the peer that assigned a job may drive it (``step``), read it
(``collect``) or end it (``release``); a call about a job from anyone else is refused with a
``JobError``. An assignment its broker stops driving expires (``--assignment-ttl``), freeing its slot.
The ``assign`` call itself is ``assign_rpc``'s, ``step`` and ``serve_step`` ``step_rpc``'s.

Compute never runs on the event loop: while a sub-task computes for minutes the loop keeps answering
pings and RPCs and moving data. By default (``--sandbox process``) each assignment runs in its own
worker process (``sandbox_client``/``sandbox_worker``): the IR is decoded, rebuilt and executed there,
under a memory limit, so a graph that crashes the interpreter or runs away ends that job's worker and
fails that job with a message saying so, never the daemon or other jobs. With ``--sandbox off`` it
runs on the daemon's compute thread (``fusionnet.compnode.compute``). Either way the daemon keeps the
data path, the replicas and who may drive what (``job_host.HeldJob``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from fusionnet.compnode.assign_rpc import MAX_JOBS, AssignRPC, Build
from fusionnet.compnode.daemon import CompnodeDaemon
from fusionnet.compnode.faults import FaultPoint
from fusionnet.compnode.job_host import HeldJob
from fusionnet.compnode.linkprobe import PROBE_BUDGET, LinkProber, check_probe_request
from fusionnet.compnode.replica_frames import Landings
from fusionnet.compnode.replica_rpc import ReplicaRPC
from fusionnet.compnode.replicas import ReplicaStore
from fusionnet.compnode.sandbox_client import SandboxedJob
from fusionnet.compnode.sandbox_pool import SandboxPool
from fusionnet.compnode.staging import StateStaging
from fusionnet.compnode.step_rpc import StepRPC
from fusionnet.compnode.tcp_down import Down, DownPeers
from fusionnet.compnode.trust import TrustedBrokers, forgotten_jobs, stale_jobs
from fusionnet.daemon.addresses import announced_host
from fusionnet.dht.records import join_host_port
from fusionnet.errors import JobError
from fusionnet.messages.base import handles
from fusionnet.messages.broker_rpc import BrokerClient
from fusionnet.messages.broker_rpc import JobRequest as BrokerJobRequest
from fusionnet.messages.compnode_rpc import (
    CollectReply,
    JobRequest,
    ProbedLink,
    ProbeLinksReply,
    ProbeLinksRequest,
    ReleaseReply,
    ReleaseRequest,
)
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.datapath import DataPathClient, DataPathServer
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.refusal import PeerUnreachable

log = logging.getLogger("fusionnet.compnode.tasks")

HANDOVER_TIMEOUT = 45.0  # a graceful leave waits this long for the broker to move our sub-DAGs


class SubtaskService(AssignRPC, ReplicaRPC, StepRPC):
    name = "subtasks"

    def __init__(self, compnode: CompnodeDaemon) -> None:
        self.node = compnode
        self.brokers = BrokerClient(compnode.call)
        self.jobs: dict[str, HeldJob] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.server: DataPathServer | None = None
        self.client: DataPathClient | None = None
        self.bulk: DataPathClient | None = None  # snapshot chunks: their own connections (``replica_frames``)
        self.landings = Landings()
        self.replica_refused: dict[str, int] = {}
        self.p2p: Any = None  # P2PDataPath, imported lazily (hivemind import cost)
        # Peers whose TCP address failed: P2P for them until ``tcp_down.RETRY_AFTER``; shared with the
        # sandbox workers, which would otherwise each pay the connect timeout again.
        self._tcp_down = DownPeers(on_mark=self._tell_workers)
        self._released: dict[str, asyncio.Event] = {}
        self._probers: dict[str, LinkProber] = {}
        # Jobs whose assignment is being built (a sandbox worker forking and decoding it can take
        # seconds to minutes): work already, for the announced load and for a calibration waiting
        # for an idle node, though not held yet.
        # Each build says whether its broker released the job meanwhile (a job cancelled while this
        # compnode was still building its sub-DAG): such a build is dropped when it ends instead of
        # being held for a job that is over, which nobody would ever release.
        self._building: dict[str, list[Build]] = {}
        self.fault = FaultPoint.from_env()
        settings = compnode.settings
        self.trust = TrustedBrokers.from_settings(settings.common.dht.initial_peers, settings.trusted_brokers)
        self._heard: dict[str, float] = {}  # job id or trusted broker -> when it last drove us (monotonic)
        self._replicas: ReplicaStore | None = None  # under the state dir, which exists once started
        self.staging = StateStaging(ttl=max(settings.assignment_ttl, 120.0))  # slices ahead of ``assign``
        self.sandboxes = SandboxPool.of(settings, self.fault) if settings.sandbox else None
        if self.sandboxes is not None:
            self.sandboxes.look = compnode.metrics.workers.look
            self.sandboxes.tcp_down = self._tcp_down

    @property
    def replicas(self) -> ReplicaStore:
        """Snapshots on this compnode's disk. Made on first use: without ``--state-dir`` the daemon's
        temporary state dir exists only once it starts, after this service is built."""
        if self._replicas is None:
            self._replicas = ReplicaStore(self.node.state_dir.path / "replicas")
        return self._replicas

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        from fusionnet.wire.p2p_path import P2PDataPath

        settings = self.node.settings
        left = await asyncio.to_thread(self.replicas.drop_leftovers)  # before any job: none of them is ours
        if left:
            log.info("dropped the snapshots of %d job(s) an earlier run of this compnode left", len(left))
        self.server = DataPathServer(peer_id=self.node.peer_id)
        self.server.handoff = self._hand_off
        self.server.receiver.on_refusal = self.node.metrics.count_refusal
        _, port = await self.server.start(settings.data_address.listen, settings.data_port)
        assert self.node.peer is not None
        host = announced_host(settings.data_address, await self.node.peer.visible_maddrs())
        self.client = DataPathClient(peer_id=self.node.peer_id)
        self.bulk = DataPathClient(peer_id=self.node.peer_id)
        assert self.node.peer is not None
        self.p2p = P2PDataPath(self.node.peer.p2p, self.node.peer_id)
        self.p2p.receiver.on_refusal = self.node.metrics.count_refusal
        await self.p2p.start()
        if self.sandboxes is not None:
            # The workers' fork server imports torch once, in the background, when the node is settled:
            # not while daemons on this machine measure their hardware (a job's first assign starts it
            # sooner if need be).
            self.node.spawn(self._warm_sandboxes(), "sandbox warm-up")
        self.node.set_data_path_address(join_host_port(host, port))
        log.info("data path announced as %s", self.node.data_path_address)
        self.node.ping_listeners.append(self._pinged)
        ttl = settings.assignment_ttl
        self.node.every(min(ttl / 4, 5.0), self._expire, "assignment expiry")
        log.info("taking assignments from: %s", ", ".join(sorted(self.trust.peers)) or "nobody")

    async def _warm_sandboxes(self) -> None:
        await self.node.calibrated.wait()
        assert self.sandboxes is not None
        self.sandboxes.start()

    def _pinged(self, peer: str, live: list[str] | None = None) -> None:
        """A heartbeat from ``peer``; ``live``: the jobs that broker runs now (None: not said)."""
        if peer not in self.trust.peers:  # only trusted brokers: a flood of strangers must not grow the map
            return
        self._heard[peer] = time.monotonic()
        if live is None:
            return
        held = {job_id: (job.broker, job.created_at) for job_id, job in self.jobs.items()}
        busy = {job_id for job_id, lock in self._locks.items() if lock.locked()}
        for job_id in forgotten_jobs(held, peer, set(live), busy, time.time()):
            # Its release never came (best effort: lost on the way, or sent while we were still
            # building the sub-DAG): without this the job would hold its worker and its slot for as
            # long as the broker lives, since the broker's pings keep its assignments from expiring.
            self._release(job_id, "its broker runs it no more")

    async def _expire(self) -> None:
        """Releases assignments whose broker went silent (crashed, partitioned, lost the job)."""
        brokers = {job_id: job.broker for job_id, job in self.jobs.items()}
        busy = [job_id for job_id, lock in self._locks.items() if lock.locked()]
        ttl = self.node.settings.assignment_ttl
        self.staging.expire()
        for job_id in stale_jobs(brokers, self._heard, busy, ttl):
            self._release(job_id, f"its broker sent nothing for {ttl:g} s (assignment expired)")

    async def stop(self) -> None:
        await self._hand_over()
        for job_id in list(self.jobs):
            self._release(job_id, "the compnode is shutting down")
        for client in (self.client, self.bulk):
            if client is not None:
                await client.close()
        if self.p2p is not None:
            await self.p2p.stop()
        if self.server is not None:
            await self.server.stop()
        # The sandbox fork server leaves when this process does, and its workers with it.

    async def _hand_over(self) -> None:
        """Proactive leave (Confidant's proactive mode): tell each job's broker we are going, keep serving
        until it has moved our sub-DAG elsewhere (it releases us at the next step boundary), then go."""
        waits = []
        for job in list(self.jobs.values()):
            event = self._released.setdefault(job.job_id, asyncio.Event())
            try:
                await self.brokers.call_leaving(job.broker, BrokerJobRequest(job_id=job.job_id), timeout=10.0)
            except Exception as e:  # the broker may be gone too: nothing to hand over to
                log.warning("job %s: could not announce our leave to %s: %s", job.job_id, job.broker, e)
                continue
            log.info(
                "job %s: leave announced; waiting for the broker to move sub-DAG %d", job.job_id, job.index
            )
            waits.append(event.wait())
        if waits:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), HANDOVER_TIMEOUT)
            except TimeoutError:
                log.warning("hand-over not finished within %.0f s; leaving anyway", HANDOVER_TIMEOUT)

    # ---- transport -------------------------------------------------------------------------------
    async def _send(self, job: HeldJob, dst: int, frame: TensorFrame) -> None:
        assert self.client is not None
        if dst in job.indices:  # another of our sub-DAGs (interleaved): no network
            job.host.deliver(frame)
            return
        if await self.send_direct(self.client, job, dst, frame, "using P2P streams"):
            return
        await self.p2p.send(job.peers[dst].peer_id, frame, job.link_keys[dst])
        self.node.metrics.count_data("p2p", "sent", frame.tensor.numel() * frame.tensor.element_size())

    async def send_direct(
        self, client: DataPathClient, job: HeldJob, dst: int, frame: TensorFrame, otherwise: str
    ) -> bool:
        """``frame`` to sub-DAG ``dst``'s compnode over the direct data path; False when that compnode has
        no data path address or its TCP path is down (a failure marks it down for every later frame until
        ``tcp_down.RETRY_AFTER``, for this daemon and its workers, and the caller falls back: ``otherwise``
        says how, in the log)."""
        peer = job.peers[dst]
        if not peer.data_address or self._tcp_down.is_down(peer.peer_id, peer.data_address):
            return False
        try:
            await client.send(peer.data_address, frame, job.link_keys[dst], job.spec.wire_encryption)
        except PeerUnreachable as e:
            if self._tcp_down.mark(peer.peer_id, peer.data_address, str(e)):  # frames queued with it: once
                log.warning("job %s: TCP to %s failed (%s); %s", job.job_id, peer.peer_id, e, otherwise)
            return False
        self.node.metrics.count_data("tcp", "sent", frame.tensor.numel() * frame.tensor.element_size())
        return True

    def _tell_workers(self, down: Down) -> None:
        """A peer newly found TCP down: the running sandbox workers stop dialling it too."""
        for job in self.jobs.values():
            if isinstance(job.host, SandboxedJob):
                job.host.tell_down(down)

    # ---- helpers ---------------------------------------------------------------------------------
    def _job(self, request: JobRequest, context: RPCContext) -> HeldJob:
        job_id = request.job_id
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no job {job_id!r} is assigned to this compnode")
        if context.remote_peer != job.broker:
            raise JobError(
                f"job {job_id} was assigned by {job.broker}; {context.remote_peer} may not drive it"
            )
        self._heard[job_id] = time.monotonic()
        return job

    def _release(self, job_id: str, why: str) -> None:
        job = self.jobs.pop(job_id, None)
        self._locks.pop(job_id, None)
        self._probers.pop(job_id, None)
        self._heard.pop(job_id, None)
        # Slices staged for a newer attempt stay: a new round's ``assign`` releases the old one first.
        self.staging.drop_job(job_id, None if job is None else job.attempt)
        if job is None:
            return
        for path in (self.server, self.p2p):
            if path is not None:
                path.unregister_job(job_id)
        job.release()  # a step sent ahead stops waiting
        closing = asyncio.ensure_future(job.host.close(why))  # a sandbox worker is stopped
        closing.add_done_callback(lambda f: f.cancelled() or f.exception())
        closing.add_done_callback(lambda _: self.collect_released(job))
        self.forget_replicas(job)
        if job_id in self._released:
            self._released.pop(job_id).set()
        self._set_load()
        log.info("job %s: released (%s)", job_id, why)

    def collect_released(self, job: HeldJob) -> None:
        """In this process (--sandbox off) a released job's executor, autograd graphs and tensors hold
        each other in reference cycles, and an idle daemon may not run a full collection for a long
        time: GBs would stay resident. Collected once the release is done, and again when a step that
        was still computing then ends (until it does, it holds them)."""
        if not isinstance(job.host, SandboxedJob):
            self.node.spawn(asyncio.to_thread(gc.collect), f"collect {job.job_id}")

    def _hand_off(self, job_id: str, connection: Any) -> bool | None:
        """A peer worker's connection for ``job_id`` (``wire.handoff``): to the job's worker when it reads
        its values itself (True: taken), read here when no worker does (None), else closed (False)."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        host = job.host
        if isinstance(host, SandboxedJob) and host.reads_values:
            return host.take_connection(connection)
        return None

    def _set_load(self) -> None:
        working = len(self.jobs) + len(self._building)
        self.node.set_load(load=min(1.0, working / MAX_JOBS), running_tasks=working)

    def _refused(self, job_id: str) -> int:
        total = 0
        for path in (self.server, self.p2p):
            stats = None if path is None else path.stats.get(job_id)
            total += 0 if stats is None else stats.refused_total
        job = self.jobs.get(job_id)
        prober = self._probers.get(job_id)
        total += self.replica_refused.get(job_id, 0)
        return total + (job.host.refused() if job else 0) + (prober.refused if prober else 0)

    # ---- RPC (assign and stage_state: ``assign_rpc``) ----------------------------------------------
    @handles(ProbeLinksRequest)
    async def rpc_probe_links(self, request: ProbeLinksRequest, context: RPCContext) -> ProbeLinksReply:
        """Times the links from this compnode to the job's sub-DAGs ``to`` (``linkprobe``): per
        sub-DAG its ``alpha`` (s), ``beta`` (s/byte) and the fastest round trip per size."""
        job = self._job(request, context)
        targets = request.to
        mine = job.peers[job.index].peer_id
        if any(t >= len(job.peers) or job.peers[t].peer_id == mine for t in targets):
            why = f"job {job.job_id}: 'to' must list sub-DAGs of other compnodes of the job, got {targets!r}"
            raise JobError(why[:300])
        sizes, repeats = check_probe_request(request.sizes, request.repeats)
        prober = self._probers[job.job_id]
        links = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROBE_BUDGET  # the broker waits for all of them at once
        todo = sorted(set(targets))
        for i, dst in enumerate(todo):
            budget = max(deadline - loop.time(), 0.0) / (len(todo) - i)  # a fair share of what is left
            m = await prober.measure(dst, sizes, repeats, budget)
            link = m.link
            links[str(dst)] = ProbedLink(
                alpha=link.alpha, beta=link.beta, round_trips=m.samples, bound=m.bound
            )
            log.info(
                "job %s: link to sub-DAG %d (%s): alpha %.0f us, %.3g GB/s%s",
                job.job_id, dst, job.peers[dst].peer_id, link.alpha * 1e6, link.bandwidth / 1e9,
                " at most (too slow to fit: a bound)" if m.bound else "",
            )  # fmt: skip
        return ProbeLinksReply(links=links)

    @handles(JobRequest)
    async def rpc_collect(self, request: JobRequest, context: RPCContext) -> CollectReply:
        """The sub-DAG's current parameters and buffers, and (task grad) the last step's gradients."""
        job = self._job(request, context)
        if self.fault is not None and job.steps_done:
            self.fault.hit("sync")

        subdag = job.subdag_of(request.subdag)
        return await job.host.collect(request.part, request.chunk, subdag)

    @handles(ReleaseRequest)
    async def rpc_release(self, request: ReleaseRequest, context: RPCContext) -> ReleaseReply:
        if request.job_id not in self.jobs:
            # Its assignment still being built (by the broker that asks): dropped once built.
            building = [b for b in self._building.get(request.job_id, ()) if b.broker == context.remote_peer]
            for b in building:
                b.released = request.reason[:200]
            if building:
                return ReleaseReply(released=True)
            return ReleaseReply(released=False)  # released already (a repeated request) or never here
        job = self._job(request, context)
        refused = self._refused(job.job_id)
        self._release(job.job_id, request.reason[:200])
        return ReleaseReply(released=True, refused=refused)
