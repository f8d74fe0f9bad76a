"""One peer's presence in the swarm: the DHT node, this process's handle on p2pd, RPC server and client,
and the announcer, started and stopped together in the right order.

Used by both daemons and by client tools (``fusionnet status``), which run it in DHT client mode without
an RPC server.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from hivemind.p2p import P2P

from fusionnet.dht.announce import Announcer
from fusionnet.dht.node import (
    DHTConfig,
    SwarmDHT,
    join_through,
    kill_dht,
    remove_with_parent,
    start_dht,
    stop_dht,
)
from fusionnet.rpc.client import RPCClient
from fusionnet.rpc.protocol import DEFAULT_MAX_MESSAGE_BYTES
from fusionnet.rpc.server import RPCServer

log = logging.getLogger("fusionnet.daemon.swarm")


@dataclass
class SwarmPeer:
    dht: SwarmDHT
    p2p: P2P  # replica of the DHT child's p2pd connection, for RPC in this process
    peer_id: str
    announcer: Announcer
    client: RPCClient
    server: RPCServer | None

    @classmethod
    async def start(
        cls, config: DHTConfig, *, serve: bool, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> SwarmPeer:
        dht, validator = await start_dht(config)
        try:
            p2p = await dht.replicate_p2p()
            await remove_with_parent(dht, p2p)
            peer_id = p2p.peer_id.to_base58()
            server = RPCServer(p2p, max_message_bytes=max_message_bytes) if serve else None
            return cls(
                dht=dht,
                p2p=p2p,
                peer_id=peer_id,
                announcer=Announcer(dht, validator, peer_id),
                # Every call on its own stream: p2pd's unary calls share one persistent control connection,
                # and we saw it wedge for good after a unary call was cancelled by its timeout (a ping
                # to a busy compnode); a stream that times out is simply closed.
                client=RPCClient(p2p, max_message_bytes=max_message_bytes, unary_limit=0),
                server=server,
            )
        except BaseException:
            await stop_dht(dht)
            raise

    async def join_through(self, maddrs: list[str]) -> int:
        """Adds the DHT peers at ``maddrs`` (``/p2p/`` ids included); how many answered."""
        return await join_through(self.dht, maddrs)

    async def visible_maddrs(self) -> list[str]:
        return sorted(str(m) for m in await self.p2p.get_visible_maddrs(latest=True))

    async def stop(self, *, rpc_grace: float) -> None:
        """Graceful: finish in-flight calls (up to ``rpc_grace``), detach from p2pd, stop the DHT child."""
        if self.server is not None:
            await self.server.stop(grace=rpc_grace)
        self.client.close()
        with contextlib.suppress(Exception):  # p2pd may be gone already; the replica only holds sockets
            await self.p2p.shutdown()
        await stop_dht(self.dht)

    async def kill(self) -> None:
        """Forced exit: no goodbyes, just make sure the DHT child and p2pd go away and our sockets close."""
        kill_dht(self.dht)
        if self.server is not None:
            await self.server.abort()
        with contextlib.suppress(Exception):
            await self.p2p.shutdown()  # a replica has no child process: this only closes and unlinks sockets
