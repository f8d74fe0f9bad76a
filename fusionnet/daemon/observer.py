"""A swarm client that looks without joining as a server: compnode and broker records straight from the
DHT, and the broker's own status over RPC. Used by ``fusionnet status`` (and by tools that need to find
the broker, e.g. a job submitter).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from fusionnet.daemon.swarm import SwarmPeer
from fusionnet.dht.announce import Found
from fusionnet.dht.node import DHTConfig
from fusionnet.dht.records import BrokerRecord, CompnodeRecord, NodeState
from fusionnet.messages.broker_rpc import BrokerClient, StatusRequest
from fusionnet.rpc.protocol import RPCError


class SwarmObserver:
    def __init__(self, initial_peers: Sequence[str], *, startup_timeout: float = 60.0):
        if not initial_peers:
            raise ValueError("--initial-peers: at least one peer of the swarm is needed")
        self.config = DHTConfig(
            initial_peers=tuple(initial_peers), client_mode=True, startup_timeout=startup_timeout
        )
        self.peer: SwarmPeer | None = None

    async def __aenter__(self) -> SwarmObserver:
        self.peer = await SwarmPeer.start(self.config, serve=False)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.peer is not None:
            await self.peer.stop(rpc_grace=0.0)
            self.peer = None
            # hivemind's P2P handles close themselves in __del__, which needs a running loop: collect
            # them now rather than after asyncio.run() has closed it (noisy tracebacks otherwise).
            gc.collect()

    def _peer(self) -> SwarmPeer:
        assert self.peer is not None, "use SwarmObserver as an async context manager"
        return self.peer

    async def compnodes(self) -> list[Found[CompnodeRecord]]:
        return await self._peer().announcer.lookup(CompnodeRecord)

    async def brokers(self) -> list[Found[BrokerRecord]]:
        return await self._peer().announcer.lookup(BrokerRecord)

    async def find_broker(self) -> str:
        """The peer id of the most recently announced ONLINE broker."""
        online = [b for b in await self.brokers() if b.record.state == NodeState.ONLINE]
        if not online:
            raise RPCError("no ONLINE broker is announced in the DHT (is a broker running and reachable?)")
        return max(online, key=lambda b: b.record.updated_at).record.peer_id

    async def call(self, peer_id: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        return await self._peer().client.call(peer_id, method, payload, **kw)

    async def broker_status(self, timeout: float = 10.0) -> dict[str, Any]:
        """The broker's ``status`` reply (``messages.broker_rpc.StatusReply``) as a map."""
        client = BrokerClient(self.call)
        reply = await client.call_status(await self.find_broker(), StatusRequest(), timeout=timeout)
        return reply.model_dump()
