"""The compnode daemon (FusionAI 3.3): joins the DHT, profiles itself, announces its hardware record and
keeps it fresh, answers the broker's pings, and leaves gracefully on SIGTERM.

Record states over a lifetime: JOINING (in the swarm, profiling and starting services) -> ONLINE (takes
sub-tasks) -> DRAINING (SIGTERM: services finish or hand over their work) -> OFFLINE (written just before
the DHT node stops, so the swarm learns of the departure at once instead of after the record expires).

Extension points for sub-task execution (a ``Service``, see ``fusionnet.daemon.base``; ``cmd_compnode``
adds ``fusionnet.compnode.tasks.make_service(compnode)`` when that module exists):
- its ``rpc_<name>`` coroutines (assignments from the broker, handovers) are served with ``rpc_ping``;
- its ``start()`` runs after profiling and before ONLINE: the place to start the data path server on
  ``settings.data_host``/``settings.data_port`` and report it with ``set_data_path_address("host:port")``;
- ``set_load(load=, running_tasks=)`` updates what the next announcement says (``announce_now()`` to
  publish at once); ``hardware`` holds the profile; ``stop()`` is the graceful hand-over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fusionnet import __version__
from fusionnet.compnode.profile import profile_hardware
from fusionnet.daemon.base import Daemon
from fusionnet.daemon.config import DaemonConfig
from fusionnet.dht.records import CompnodeRecord, HardwareInfo, NodeState, Role
from fusionnet.rpc.server import RPCContext

log = logging.getLogger("fusionnet.compnode")


@dataclass
class CompnodeConfig:
    common: DaemonConfig = field(default_factory=DaemonConfig)
    role: Role = Role.SUPERNODE
    backup: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default
    device: str = "cpu"
    data_host: str = "127.0.0.1"  # where the data path server listens (started by the execution service)
    data_port: int = 0  # 0 = any free port
    reprofile: bool = False  # ignore the cached hardware profile

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port must be in 0..65535, got {self.data_port}")
        if not self.data_host:
            raise ValueError("--data-host must not be empty")


class CompnodeDaemon(Daemon):
    role = "compnode"

    def __init__(self, config: CompnodeConfig):
        super().__init__(config.common)
        self.settings = config
        self.state = NodeState.JOINING
        self.hardware: HardwareInfo | None = None
        self.load = 0.0
        self.running_tasks = 0
        self.data_path_address: str | None = None
        self._maddrs: list[str] = []
        self._announce_lock = asyncio.Lock()
        self._state_gauge = self.metrics.gauge(
            "fusionnet_compnode_state", "1 for the current state", ["state"]
        )
        self._load_gauge = self.metrics.gauge("fusionnet_compnode_load", "Announced load (0..1)")

    # ---- API for services ------------------------------------------------------------------------
    def set_load(self, *, load: float, running_tasks: int) -> None:
        if not 0.0 <= load <= 1.0 or running_tasks < 0:
            raise ValueError(f"load must be in [0, 1] and running_tasks >= 0, got {load}, {running_tasks}")
        self.load, self.running_tasks = load, running_tasks
        self._load_gauge.set(load)

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
            maddrs=self._maddrs,
            version=__version__,
        )

    async def announce_now(self) -> None:
        assert self.peer is not None and self.config.record_ttl is not None
        async with self._announce_lock:  # the refresh loop and a state change must not interleave
            if not self._maddrs:
                self._maddrs = await self.peer.visible_maddrs()
            ok = await self.peer.announcer.announce(self.record(), ttl=self.config.record_ttl)
            if not ok:
                log.warning("no DHT node accepted our %s record (will retry)", self.state.value)
            for state in NodeState:
                self._state_gauge.labels(state=state.value).set(1 if state == self.state else 0)

    # ---- lifecycle hooks -------------------------------------------------------------------------
    async def on_startup(self) -> None:
        await self.announce_now()  # JOINING: visible while we profile
        if self.settings.threads is not None:
            import torch

            torch.set_num_threads(self.settings.threads)
        self.hardware = await asyncio.to_thread(
            profile_hardware,
            self.state_dir.path,
            device=self.settings.device,
            threads=self.settings.threads,
            refresh=self.settings.reprofile,
        )
        await self.start_services()
        self.state = NodeState.ONLINE
        await self.announce_now()
        self.every(self.config.refresh_period, self.announce_now, "dht refresh")

    async def on_draining(self) -> None:
        if self.state in (NodeState.JOINING, NodeState.ONLINE):
            self.state = NodeState.DRAINING
            await self.announce_now()

    async def on_stopped(self) -> None:
        self.state = NodeState.OFFLINE
        await self.announce_now()
        log.info("announced OFFLINE")

    # ---- RPC -------------------------------------------------------------------------------------
    async def rpc_ping(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        """The broker's heartbeat (FusionAI 3.2): echoes the nonce, says how we are doing."""
        return {
            "nonce": payload.get("nonce"),
            "peer_id": self.peer_id,
            "state": self.state.value,
            "load": self.load,
            "running_tasks": self.running_tasks,
            "time": time.time(),
        }

    async def rpc_info(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        """Our current record, straight from us (no DHT round trip)."""
        return self.record().model_dump(mode="json")
