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
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from fusionnet.compnode.assignment_intake import build_assignment
from fusionnet.compnode.daemon import CompnodeDaemon
from fusionnet.compnode.faults import FaultPoint, fault_hooks
from fusionnet.compnode.job_host import HeldJob, JobHost
from fusionnet.compnode.linkprobe import LinkProber, check_probe_request
from fusionnet.compnode.replica_frames import Landings
from fusionnet.compnode.replica_rpc import ReplicaRPC
from fusionnet.compnode.replicas import ReplicaStore
from fusionnet.compnode.sandbox_client import SandboxedJob, SandboxPool
from fusionnet.compnode.staging import StateStaging
from fusionnet.compnode.step_rpc import StepRPC
from fusionnet.compnode.throttle import throttle_hooks
from fusionnet.compnode.trust import TrustedBrokers, stale_jobs
from fusionnet.daemon.addresses import announced_host
from fusionnet.dht.records import join_host_port
from fusionnet.errors import JobError
from fusionnet.messages.base import handles
from fusionnet.messages.broker_rpc import BrokerClient
from fusionnet.messages.broker_rpc import JobRequest as BrokerJobRequest
from fusionnet.messages.compnode_rpc import (
    AssignReply,
    AssignRequest,
    CollectReply,
    JobRequest,
    ProbedLink,
    ProbeLinksReply,
    ProbeLinksRequest,
    ReleaseReply,
    ReleaseRequest,
    StageStateReply,
    StageStateRequest,
)
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.datapath import DataPathClient, DataPathServer
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import OTHER_LANES
from fusionnet.wire.refusal import PeerUnreachable

log = logging.getLogger("fusionnet.compnode.tasks")

MAX_JOBS = 16  # assignments held at once; a broker gone wild cannot exhaust our memory
HANDOVER_TIMEOUT = 45.0  # a graceful leave waits this long for the broker to move our sub-DAGs


FORGOTTEN_GRACE = 30.0  # s a job is held before a heartbeat that leaves it out may drop it (a late ping)


def forgotten_jobs(
    jobs: Mapping[str, HeldJob], broker: str, running: set[str], busy: set[str], now: float
) -> list[str]:
    """The jobs held for ``broker`` that it no longer runs (not in ``running``, its heartbeat's list),
    held for over ``FORGOTTEN_GRACE`` (a heartbeat sent before an assignment may arrive after it) and
    with no call in progress (``busy``)."""
    return [
        job_id
        for job_id, job in jobs.items()
        if job.broker == broker
        and job_id not in running
        and job_id not in busy
        and now - job.created_at > FORGOTTEN_GRACE
    ]


@dataclass
class _Build:
    """An assignment being built here: by which broker, and whether that broker has released it since."""

    broker: str
    released: str | None = None  # the release's reason


class SubtaskService(ReplicaRPC, StepRPC):
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
        self._tcp_down: set[str] = set()  # peers whose TCP address failed: use P2P for them
        self._released: dict[str, asyncio.Event] = {}
        self._probers: dict[str, LinkProber] = {}
        # Jobs whose assignment is being built (a sandbox worker forking and decoding it can take
        # seconds to minutes): work already, for the announced load and for a calibration waiting
        # for an idle node, though not held yet.
        # Each build says whether its broker released the job meanwhile (a job cancelled while this
        # compnode was still building its sub-DAG): such a build is dropped when it ends instead of
        # being held for a job that is over, which nobody would ever release.
        self._building: dict[str, list[_Build]] = {}
        self.fault = FaultPoint.from_env()
        settings = compnode.settings
        self.trust = TrustedBrokers.from_settings(settings.common.dht.initial_peers, settings.trusted_brokers)
        self._heard: dict[str, float] = {}  # job id or trusted broker -> when it last drove us (monotonic)
        self.replicas = ReplicaStore(compnode.state_dir.path / "replicas")
        self.staging = StateStaging(ttl=max(settings.assignment_ttl, 120.0))  # slices ahead of ``assign``
        self.sandboxes = SandboxPool.of(settings, self.fault) if settings.sandbox else None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        from fusionnet.wire.p2p_path import P2PDataPath

        settings = self.node.settings
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
        running, busy = set(live), {job_id for job_id, lock in self._locks.items() if lock.locked()}
        for job_id in forgotten_jobs(self.jobs, peer, running, busy, time.time()):
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
        no data path address or its TCP path is down (a failure marks it down for every later frame, and
        the caller falls back: ``otherwise`` says how, in the log)."""
        peer = job.peers[dst]
        if not peer.data_address or peer.peer_id in self._tcp_down:
            return False
        try:
            await client.send(peer.data_address, frame, job.link_keys[dst], job.spec.wire_encryption)
        except PeerUnreachable as e:
            log.warning("job %s: TCP to %s failed (%s); %s", job.job_id, peer.peer_id, e, otherwise)
            self._tcp_down.add(peer.peer_id)
            return False
        self.node.metrics.count_data("tcp", "sent", frame.tensor.numel() * frame.tensor.element_size())
        return True

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
        self.forget_replicas(job)
        if job_id in self._released:
            self._released.pop(job_id).set()
        self._set_load()
        log.info("job %s: released (%s)", job_id, why)

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

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(StageStateRequest)
    async def rpc_stage_state(self, request: StageStateRequest, context: RPCContext) -> StageStateReply:
        """One part of a slice that its ``assign`` will name (``compnode.staging``)."""
        self.trust.check(context.remote_peer, "stage_state")
        return StageStateReply(received=self.staging.add(context.remote_peer, request))

    @handles(AssignRequest)
    async def rpc_assign(self, request: AssignRequest, context: RPCContext) -> AssignReply:
        self.trust.check(context.remote_peer, "assign")
        job_id = request.job_id
        if job_id in self.jobs:
            held = self.jobs[job_id]
            if held.broker != context.remote_peer:
                raise JobError(f"job {job_id} is already assigned here by {held.broker}")
            if request.attempt == held.attempt and request.subdag == held.index:
                return AssignReply(subdag=held.index, nodes=held.nodes)  # a repeated request
            if request.attempt == held.attempt and request.subdag in held.indices:
                return await self._assign_chunk(held, request, context)  # interleaved: one more
            # A new round of the same job (failover, re-plan, restarted broker): the old one is void.
            self._release(job_id, f"superseded by attempt {request.attempt}")
        if len(self.jobs) >= MAX_JOBS:
            raise JobError(f"this compnode already runs {MAX_JOBS} jobs")
        staged = [n for n in (request.staged_state, request.staged_optim) if n is not None]
        request = self.staging.resolve(context.remote_peer, request)
        if staged:
            log.info("job %s: sub-DAG %d slice staged ahead (%d bytes)", job_id, request.subdag, sum(staged))
        holder: dict[str, HeldJob] = {}

        async def send(dst: int, frame: TensorFrame) -> None:
            await self._send(holder["job"], dst, frame)

        building = _Build(context.remote_peer)
        self._building.setdefault(job_id, []).append(building)
        self._set_load()
        try:
            job = await self._build(request, context.remote_peer, send)
        finally:
            builds = self._building[job_id]
            builds.remove(building)
            if not builds:
                del self._building[job_id]
            self._set_load()
        if building.released is not None:
            closing = asyncio.ensure_future(job.host.close(building.released))  # its sandbox worker stops
            closing.add_done_callback(lambda f: f.cancelled() or f.exception())
            why = f"released by its broker ({building.released}) while sub-DAG {job.index} was being built"
            log.info("job %s: %s: dropped", job_id, why)
            raise JobError(f"job {job_id}: {why} here; dropped")
        holder["job"] = job
        allowed = job.allowed_senders()
        prober = LinkProber(job.job_id, self.node.peer_id, job.subdag_of_peer(), send)
        self._probers[job.job_id] = prober

        def router(path_name: str) -> Any:
            def route(frame: TensorFrame) -> Any:  # probes: prober; snapshots: disk; values: executor
                nbytes = frame.tensor.numel() * frame.tensor.element_size()
                self.node.metrics.count_data(path_name, "received", nbytes)  # as ``_send`` counts: probes too
                if frame.kind == "ctrl":
                    return prober.on_frame(frame)
                if frame.kind == "param":
                    return self.on_replica_frame(job, frame)
                return job.host.deliver(frame)

            return route

        for path_name, path in (("tcp", self.server), ("p2p", self.p2p)):
            assert path is not None
            keys = job.keys_by_sender()
            # A worker that reads its peers' values owns the lane their workers number in (``handoff``).
            lanes = OTHER_LANES if isinstance(job.host, SandboxedJob) and job.host.reads_values else None
            path.register_job(job.job_id, keys, allowed, router(path_name), job.spec.wire_encryption, lanes)
        self.jobs[job.job_id] = job
        self._locks[job.job_id] = asyncio.Lock()
        self._heard[job.job_id] = time.monotonic()
        self._set_load()
        log.info(
            "job %s: sub-DAG %d assigned by %s (%d nodes, %d parameters)",
            job.job_id,
            job.index,
            context.remote_peer,
            job.nodes,
            job.params,
        )
        return AssignReply(subdag=job.index, nodes=job.nodes)

    async def _assign_chunk(self, held: HeldJob, request: AssignRequest, context: RPCContext) -> AssignReply:
        """Another sub-DAG of a job and round we hold already (interleaved-1f1b: compnode d holds
        d, p + d, ...), built into the same host: its worker runs all of them in one loop."""
        if request.peers != held.peers or request.spec != held.spec:
            raise JobError(f"job {held.job_id}: sub-DAG {request.subdag}'s assignment disagrees with ours")
        request = self.staging.resolve(context.remote_peer, request)
        self.node.make_way_for_work()
        if isinstance(held.host, JobHost):  # --sandbox off: built here, on the compute thread
            build = partial(
                build_assignment,
                request,
                own_peer_id=self.node.peer_id,
                broker=held.broker,
                send=partial(self._send, held),
                device=self.node.device,
            )
            built = await asyncio.get_running_loop().run_in_executor(self.node.compute, build)
            for hook in (*fault_hooks(self.fault), *throttle_hooks(self.node.settings.slowdown)):
                built.executor.hooks.add(hook)
            held.host.add(built)
            nodes, params = len(built.subdag.nodes), len(built.subdag.params)
        else:
            nodes, params = await held.host.assign_more(request)  # type: ignore[attr-defined]
        held.add_subdag(nodes, params)
        log.info("job %s: sub-DAG %d assigned too (%d nodes)", held.job_id, request.subdag, nodes)
        return AssignReply(subdag=request.subdag, nodes=nodes)

    async def _build(self, request: AssignRequest, broker: str, send: Any) -> HeldJob:
        """The assignment decoded, checked and built where it will run: in a sandbox worker, or on the
        compute thread (placing the state on the device is compute-stream work). A first start-up's
        calibration on that thread gives way at once instead of delaying the job."""
        self.node.make_way_for_work()
        if self.sandboxes is not None:
            sandboxed = SandboxedJob(
                self.sandboxes,
                self.node.peer_id,
                request.job_id,
                request.subdag,
                send,
                counted=partial(self.node.metrics.count_data, "tcp"),
                refusals=self.node.metrics.count_refusal,
            )
            try:
                nodes, params = await sandboxed.assign(request, broker, str(self.node.device))
            except BaseException:
                await sandboxed.close("its assignment was refused")
                raise
            return HeldJob.of(request, broker, nodes, params, sandboxed)
        build = partial(
            build_assignment,
            request,
            own_peer_id=self.node.peer_id,
            broker=broker,
            send=send,
            device=self.node.device,
        )
        built = await asyncio.get_running_loop().run_in_executor(self.node.compute, build)
        for hook in (*fault_hooks(self.fault), *throttle_hooks(self.node.settings.slowdown)):
            built.executor.hooks.add(hook)
        host = JobHost(built, self.node.compute)
        return HeldJob.of(request, broker, len(built.subdag.nodes), len(built.subdag.params), host)

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
        for dst in sorted(set(targets)):
            link, samples = await prober.measure(dst, sizes, repeats)
            links[str(dst)] = ProbedLink(alpha=link.alpha, beta=link.beta, round_trips=samples)
            log.info(
                "job %s: link to sub-DAG %d (%s): alpha %.0f us, %.3g GB/s",
                job.job_id, dst, job.peers[dst].peer_id, link.alpha * 1e6, link.bandwidth / 1e9,
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
