"""The compnode daemon (FusionAI 3.3): joins the DHT, profiles itself, announces its hardware record and
keeps it fresh, answers the broker's pings, and leaves gracefully on SIGTERM.

Record states over a lifetime: JOINING (in the swarm, profiling and starting services) -> ONLINE (takes
sub-tasks) -> DRAINING (SIGTERM: services finish or hand over their work) -> OFFLINE (written just before
the DHT node stops, so the swarm learns of the departure at once instead of after the record expires).

Extension points for sub-task execution (a ``Service``, see ``fusionnet.daemon.base``; ``cmd_compnode``
adds ``fusionnet.compnode.tasks.SubtaskService(compnode)``):
- its ``rpc_<name>`` coroutines (assignments from the broker, handovers) are served with ``rpc_ping``;
- its ``start()`` runs after profiling and before ONLINE: the place to start the data path server on
  ``settings.data_address.listen``/``settings.data_port`` and report the address to announce
  (``addresses.announced_host``) with ``set_data_path_address("host:port")``;
- ``make_way_for_work()`` before a job's first compute: a first start-up's calibration gives way;
- ``set_load(load=, running_tasks=)`` updates what the next announcement says (``announce_now()`` to
  publish at once); ``hardware`` holds the profile; ``stop()`` is the graceful hand-over;
- ``metrics`` (a ``fusionnet.metrics.CompnodeMetrics``) takes what only the services see:
  ``observe_compute(phase, seconds)`` per micro-batch phase (forward|backward|update, or fp|bp),
  ``observe_prediction(measured_seconds, predicted_seconds)``, ``count_data(path, direction, nbytes,
  frames=1)`` (path tcp|p2p, direction sent|received), ``count_refusal(reason)``, ``count_subtask(outcome)``.
  State, load and hardware (speed factor, peak FLOPS) are kept by the daemon itself.

With ``--metrics-port`` the record carries ``metrics_address`` ("host:port"), from which the broker builds
Prometheus service discovery: ``--metrics-announce-host``, else ``--metrics-host`` unless that binds every
interface, else the host of our first announced multiaddr.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusionnet import __version__
from fusionnet.compnode.compute import INLINE_COMPUTE_MS, compute_pool
from fusionnet.compnode.throttle import check_slowdown, slowed_hardware
from fusionnet.compnode.trust import DEFAULT_ASSIGNMENT_TTL
from fusionnet.daemon.addresses import data_address, useful_maddrs
from fusionnet.daemon.base import Daemon
from fusionnet.daemon.config import DaemonConfig
from fusionnet.dht.records import (
    CompnodeRecord,
    HardwareInfo,
    NodeState,
    Role,
    is_bind_all,
    is_host_port,
    join_host_port,
)
from fusionnet.messages.base import handles
from fusionnet.messages.broker_rpc import PingReply, PingRequest
from fusionnet.messages.compnode_rpc import InfoRequest
from fusionnet.metrics import CompnodeMetrics
from fusionnet.profiling.node import profile_hardware, profile_software_overheads
from fusionnet.rpc.server import RPCContext

if TYPE_CHECKING:
    import torch

log = logging.getLogger("fusionnet.compnode")

CALIBRATION_IDLE = 10.0  # seconds without a job before a calibration that gave way runs again
IDLE_POLL = 1.0
CALIBRATION_WAIT = 1.0  # seconds the start-up waits for the overheads (a cache hit) before going ONLINE


@dataclass
class CompnodeConfig:
    common: DaemonConfig = field(default_factory=DaemonConfig)
    role: Role = Role.SUPERNODE
    backup: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default
    device: str = "cpu"
    data_host: str | None = None  # --data-host; None: derived (``fusionnet.daemon.addresses``)
    data_port: int = 0  # 0 = any free port
    reprofile: bool = False  # ignore the cached hardware profile
    metrics_announce_host: str | None = None  # where Prometheus reaches our metrics port; default: derived
    slowdown: float = 1.0  # emulate a device this many times slower (``fusionnet.compnode.throttle``)
    trusted_brokers: tuple[str, ...] = ()  # brokers obeyed besides those named in --initial-peers
    assignment_ttl: float = DEFAULT_ASSIGNMENT_TTL  # s without a word from its broker voids an assignment
    sandbox: bool = True  # each assignment in a worker process of its own (``compnode.sandbox_client``)
    sandbox_memory_gb: float | None = None  # a worker's memory budget; None: 90 % of this machine's RAM
    worker_sends: str = "direct"  # a worker's values: over its own TCP ("direct") or via the daemon
    worker_receives: str = "direct"  # its peers' values: read by the worker ("direct") or relayed by us
    inline_compute_ms: float = INLINE_COMPUTE_MS  # a worker's stretches this short run on its loop

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port must be in 0..65535, got {self.data_port}")
        dht = self.common.dht
        self.data_address = data_address(
            self.data_host, dht.host_maddrs, dht.announce_maddrs, dht.initial_peers
        )
        self.slowdown = check_slowdown(self.slowdown)
        self.trusted_brokers = tuple(self.trusted_brokers)
        for peer in self.trusted_brokers:
            if not peer or not peer.isalnum() or len(peer) > 128:
                raise ValueError(f"--trusted-broker: {peer!r} is not a peer id")
        if not self.assignment_ttl > 0:
            raise ValueError(f"--assignment-ttl must be > 0 seconds, got {self.assignment_ttl}")
        if self.sandbox_memory_gb is None and self.sandbox:
            self.sandbox_memory_gb = 0.9 * _physical_memory_gb()
        if self.sandbox_memory_gb is not None and not 0 < self.sandbox_memory_gb < 1 << 20:
            raise ValueError(f"--sandbox-memory-gb must be > 0, got {self.sandbox_memory_gb}")
        for flag, value in (
            ("--worker-sends", self.worker_sends),
            ("--worker-receives", self.worker_receives),
        ):
            if value not in ("direct", "daemon"):
                raise ValueError(f"{flag} must be 'direct' or 'daemon', got {value!r}")
        if not 0 <= self.inline_compute_ms <= 10_000:
            raise ValueError(f"--inline-compute-ms must be in 0..10000, got {self.inline_compute_ms}")
        from fusionnet.dag.devices import resolve_device  # torch: only when a compnode is configured

        self.device = str(resolve_device(self.device))  # a clear start-up error without CUDA / MPS
        host = self.metrics_announce_host
        if host is not None and (is_bind_all(host) or not is_host_port(join_host_port(host, 1))):
            raise ValueError(f"--metrics-announce-host: {host!r} is not a host name or IP address to reach")

    def job_memory_bytes(self) -> int | None:
        """What one job may allocate on this node, announced as D_cpu when below the host's RAM (the
        broker plans against D_cpu): the sandbox worker's budget (``SandboxPool.of``), which caps only CPU
        devices; None without a sandbox, or on an accelerator."""
        if not self.sandbox or self.sandbox_memory_gb is None or self.device != "cpu":
            return None
        return int(self.sandbox_memory_gb * 2**30)


def _physical_memory_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


class CompnodeDaemon(Daemon):
    role = "compnode"
    metrics: CompnodeMetrics

    def __init__(self, config: CompnodeConfig, metrics: CompnodeMetrics | None = None):
        super().__init__(config.common, metrics if metrics is not None else CompnodeMetrics(process=False))
        self.settings = config
        self.state = NodeState.JOINING
        self.hardware: HardwareInfo | None = None
        self.load = 0.0
        self.running_tasks = 0
        self._calibrating = False  # a calibration holds the compute thread (``make_way_for_work``)
        self.calibrated = asyncio.Event()  # set once the per-op overheads are known (measured or cached)
        self.data_path_address: str | None = None
        self.metrics_address: str | None = None
        self._maddrs: list[str] = []
        self._announce_lock = asyncio.Lock()
        # told the caller of every heartbeat, and the jobs a broker's heartbeat says it runs
        self.ping_listeners: list[Callable[[str, list[str] | None], None]] = []
        self.compute = compute_pool(config.threads)  # FP/BP/Update and the calibration run there

    @property
    def device(self) -> torch.device:
        """Where sub-DAGs run (``--device``): their parameters, gradients and optimizer state live there."""
        import torch

        return torch.device(self.settings.device)

    # ---- API for services ------------------------------------------------------------------------
    def set_load(self, *, load: float, running_tasks: int) -> None:
        if not 0.0 <= load <= 1.0 or running_tasks < 0:
            raise ValueError(f"load must be in [0, 1] and running_tasks >= 0, got {load}, {running_tasks}")
        self.load, self.running_tasks = load, running_tasks
        self.metrics.set_load(load, running_tasks)

    def set_data_path_address(self, address: str | None) -> None:
        self.data_path_address = address
        self.record()  # validates "host:port" now rather than at the next announcement

    def record(self) -> CompnodeRecord:
        return CompnodeRecord(
            peer_id=self.peer_id,
            role=self.settings.role,
            backup=self.settings.backup,
            state=self.state,
            hardware=self.hardware,
            load=self.load,
            running_tasks=self.running_tasks,
            data_path_address=self.data_path_address,
            metrics_address=self.metrics_address,
            maddrs=self._maddrs,
            version=__version__,
        )

    async def announce_now(self) -> None:
        assert self.peer is not None and self.config.record_ttl is not None
        async with self._announce_lock:  # the refresh loop and a state change must not interleave
            if not self._maddrs:
                self._maddrs = useful_maddrs(await self.peer.visible_maddrs())
            ok = await self.peer.announcer.announce(self.record(), ttl=self.config.record_ttl)
            if not ok:
                log.warning("no DHT node accepted our %s record (will retry)", self.state.value)
            self.metrics.set_state(self.state)

    # ---- lifecycle hooks -------------------------------------------------------------------------
    async def on_startup(self) -> None:
        self.metrics_address = await self._metrics_address()
        await self.announce_now()  # JOINING: visible while we profile
        # Refreshed from now on, not from ONLINE: profiling and calibration take seconds (more with
        # several nodes starting on a few cores), longer than a record lives, and a JOINING record that
        # expired reads to the broker as a node gone without an OFFLINE announcement.
        self.every(self.config.refresh_period, self.announce_now, "dht refresh")
        if self.settings.threads is not None:
            import torch

            torch.set_num_threads(self.settings.threads)
        hardware = await asyncio.to_thread(
            profile_hardware,
            self.state_dir.path,
            device=self.settings.device,
            threads=self.settings.threads,
            refresh=self.settings.reprofile,
            job_memory_bytes=self.settings.job_memory_bytes(),
        )
        # The per-op overheads: from the cache at once on a restart; on a first start the calibration
        # (seconds, tens of them with several nodes starting on 2 cores) goes on after ONLINE, on the
        # compute thread, so that no job's compute overlaps its timings; the record goes out without
        # overheads until then (the planner then only loses their precision).
        calibration = self._start_calibration(hardware)
        done, _ = await asyncio.wait({calibration}, timeout=CALIBRATION_WAIT)
        self._set_hardware(calibration.result() if done else hardware)
        self._calibrating = not done
        if done:
            self.calibrated.set()
        await self.start_services()
        self.state = NodeState.ONLINE
        await self.announce_now()
        if not done:
            log.info("calibrating the per-op overheads in the background")
            self.spawn(self._calibrated(hardware, calibration), "calibration")

    def _start_calibration(self, hardware: HardwareInfo) -> asyncio.Future[HardwareInfo]:
        self._calibrating = True
        return asyncio.get_running_loop().run_in_executor(
            self.compute, profile_software_overheads, hardware, self.state_dir.path
        )

    def make_way_for_work(self) -> None:
        """A job is coming to the compute thread: a calibration on it gives way (``_calibrated``)."""
        if self._calibrating:
            from fusionnet.profiling.calibration import yield_to_work

            yield_to_work()

    async def _calibrated(self, hardware: HardwareInfo, calibration: asyncio.Future[HardwareInfo]) -> None:
        """The background calibration's outcome; when it gave way to a job, it runs again from the start
        once the node has been idle for ``CALIBRATION_IDLE`` seconds (the planner does without the
        overheads meanwhile)."""
        from fusionnet.profiling.calibration import CalibrationStopped, CalibrationYielded, allow_calibrating

        while True:
            try:
                result = await calibration
            except CalibrationYielded:
                result = None
            except CalibrationStopped:
                return  # the daemon stops
            finally:
                self._calibrating = False
            if result is not None:
                self._set_hardware(result)
                self.calibrated.set()
                await self.announce_now()
                return
            log.info("calibration gave way to a job; it runs again once the node is idle")
            await self._until_idle(CALIBRATION_IDLE)
            allow_calibrating()
            calibration = self._start_calibration(hardware)

    async def _until_idle(self, seconds: float) -> None:
        """Until no job has been held here for ``seconds`` in a row."""
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            if self.running_tasks:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= seconds:
                return
            await asyncio.sleep(IDLE_POLL)

    def _set_hardware(self, hardware: HardwareInfo) -> None:
        if self.settings.slowdown != 1.0:
            # Announce the device we emulate (the cached profile stays the real machine's).
            hardware = slowed_hardware(hardware, self.settings.slowdown)
            log.info(
                "--slowdown %g: emulating a device %g times slower (announced λ=%.3g, overheads x%g)",
                self.settings.slowdown,
                self.settings.slowdown,
                hardware.speed_factor,
                self.settings.slowdown,
            )
        self.hardware = hardware
        self.metrics.set_hardware(speed_factor=hardware.speed_factor, peak_flops=hardware.peak_flops)

    async def on_draining(self) -> None:
        if self.state in (NodeState.JOINING, NodeState.ONLINE):
            self.state = NodeState.DRAINING
            await self.announce_now()

    async def on_stopped(self) -> None:
        calibration = sys.modules.get("fusionnet.profiling.calibration")
        if calibration is not None:  # loaded: a first start-up's calibration may still be running
            calibration.stop_calibrating()
        self.compute.shutdown(wait=False, cancel_futures=True)
        self.state = NodeState.OFFLINE
        await self.announce_now()
        log.info("announced OFFLINE")

    async def _metrics_address(self) -> str | None:
        """Where Prometheus can scrape us, as "host:port", or None without a metrics endpoint."""
        if self.metrics_endpoint is None:
            return None
        host = self.settings.metrics_announce_host
        if host is None and not is_bind_all(self.config.metrics_host):
            host = self.config.metrics_host
        if host is None:
            assert self.peer is not None
            announced = list(self.config.dht.announce_maddrs) or await self.peer.visible_maddrs()
            host = _maddr_host(announced)
        if host is None:
            log.warning(
                "--metrics-host %s binds every interface and no announced multiaddr names a host: "
                "not announcing a metrics address (set --metrics-announce-host)",
                self.config.metrics_host,
            )
            return None
        address = join_host_port(host, self.metrics_endpoint.port)
        log.info("announcing metrics endpoint %s", address)
        return address

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(PingRequest)
    async def rpc_ping(self, request: PingRequest, context: RPCContext) -> PingReply:
        """The broker's heartbeat (FusionAI 3.2): echoes the nonce, says how we are doing."""
        for listener in self.ping_listeners:
            listener(context.remote_peer, request.jobs)
        return PingReply(
            nonce=request.nonce,
            peer_id=self.peer_id,
            state=self.state.value,
            load=self.load,
            running_tasks=self.running_tasks,
            time=time.time(),
        )

    @handles(InfoRequest)
    async def rpc_info(self, request: InfoRequest, context: RPCContext) -> CompnodeRecord:
        """Our current record, straight from us (no DHT round trip)."""
        return self.record()


def _maddr_host(maddrs: list[str]) -> str | None:
    """The first usable host in multiaddrs (/ip4/H, /ip6/H, /dns*/H), preferring non-loopback ones."""
    hosts = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and not is_bind_all(parts[2]):
            hosts.append(parts[2])
    for host in hosts:
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return host
        except ValueError:
            return host  # a DNS name
    return hosts[0] if hosts else None
