"""A swarm client that looks without joining as a server: compnode and broker records straight from the
DHT, and the broker's own status over RPC. Used by ``fusionnet status`` (and by tools that need to find
the broker, e.g. a job submitter). The broker is the one named in ``--initial-peers`` (``find_broker``).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from fusionnet.daemon.swarm import SwarmPeer
from fusionnet.dht.announce import Found
from fusionnet.dht.node import DHTConfig
from fusionnet.dht.peerids import peer_ids_of_maddrs
from fusionnet.dht.records import BrokerRecord, CompnodeRecord, NodeState
from fusionnet.errors import WireError
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

    @property
    def peer_id(self) -> str:
        """This client's libp2p peer id (what a submitter signature binds, ``messages.auth``)."""
        return self._peer().peer_id

    def _peer(self) -> SwarmPeer:
        assert self.peer is not None, "use SwarmObserver as an async context manager"
        return self.peer

    async def compnodes(self) -> list[Found[CompnodeRecord]]:
        return await self._peer().announcer.lookup(CompnodeRecord)

    async def brokers(self) -> list[Found[BrokerRecord]]:
        return await self._peer().announcer.lookup(BrokerRecord)

    async def find_broker(self) -> str:
        """The broker this client talks to: pinned to a peer named in ``--initial-peers``, never one a
        DHT record points at (a record could send the job, its weights and data to whoever wrote it).
        Among several initial peers, the first one announced as an ONLINE broker; when none is (yet),
        the first one, whose answer then says whether it is a broker."""
        pinned = peer_ids_of_maddrs(self.config.initial_peers)
        if not pinned:
            raise RPCError(
                "--initial-peers: no multiaddr names a peer id (/p2p/PEERID): cannot pin the broker"
            )
        if len(pinned) == 1:
            return pinned[0]
        online = {b.record.peer_id for b in await self.brokers() if b.record.state == NodeState.ONLINE}
        return next((p for p in pinned if p in online), pinned[0])

    async def call(self, peer_id: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        return await self._peer().client.call(peer_id, method, payload, **kw)

    async def broker_status(self, timeout: float = 10.0, auth: Any = None) -> dict[str, Any]:
        """The broker's ``status`` reply (``messages.broker_rpc.StatusReply``) as a map; ``auth``, a
        function of the broker's peer id giving a ``SubmitterAuth``, shows this submitter's jobs in full."""
        client = BrokerClient(self.call)
        broker = await self.find_broker()
        request = StatusRequest(auth=None if auth is None else auth(broker))
        try:
            reply = await client.call_status(broker, request, timeout=timeout)
        except WireError as e:
            if "unknown rpc method 'status'" not in str(e):
                raise
            raise WireError(
                f"{broker} is not a broker (it answers no status call): give --initial-peers the broker's "
                "address (its --address-file lines)"
            ) from None
        return reply.model_dump()
