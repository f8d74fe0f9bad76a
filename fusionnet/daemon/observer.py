"""A swarm client that looks without joining as a server: compnode and broker records straight from the
DHT, and the broker's own status over RPC. Used by ``fusionnet status`` (and by tools that need to find
the broker, e.g. a job submitter). The broker is the one named in ``--initial-peers`` (``find_broker``); a
call to it that finds no broker there (a compnode's or a plain DHT peer's address given instead) says so
in one line, for every command alike (``call``).
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
from fusionnet.errors import FusionNetError, WireError
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
        self._broker: str | None = None  # what ``find_broker`` answered: calls to it are broker calls

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
            self._broker = pinned[0]
        else:
            online = {b.record.peer_id for b in await self.brokers() if b.record.state == NodeState.ONLINE}
            self._broker = next((p for p in pinned if p in online), pinned[0])
        return self._broker

    async def call(self, peer_id: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        """``method`` on ``peer_id``. On the broker (``find_broker``'s), an answer that no broker would give
        (the method is unknown to a peer that serves no ``status``, or it speaks no FusionNet RPC) becomes
        one ``WireError`` naming the mistake: ``cancel``, ``results``, ``submit``, ``deploy``, ``undeploy``
        and ``status`` say it alike, instead of listing a compnode's methods or a libp2p failure."""
        try:
            return await self._peer().client.call(peer_id, method, payload, **kw)
        except FusionNetError as e:
            if peer_id != self._broker or not serves_no_broker(e):
                raise
            raise WireError(
                f"{peer_id} is not a broker (it answers no {method} call): give --initial-peers the broker's "
                "address (its --address-file lines)"
            ) from None

    async def broker_status(self, timeout: float = 10.0, auth: Any = None) -> dict[str, Any]:
        """The broker's ``status`` reply (``messages.broker_rpc.StatusReply``) as a map; ``auth``, a
        function of the broker's peer id giving a ``SubmitterAuth``, shows this submitter's jobs in full."""
        client = BrokerClient(self.call)
        broker = await self.find_broker()
        request = StatusRequest(auth=None if auth is None else auth(broker))
        reply = await client.call_status(broker, request, timeout=timeout)  # "not a broker": ``call``
        return reply.model_dump()


def serves_no_broker(error: FusionNetError) -> bool:
    """Whether a call's error shows that the peer is no broker: it lacks the method and ``status``, which
    every broker serves (a broker of another version lacking one method is still a broker), or it speaks
    no FusionNet RPC at all (libp2p could not agree on our protocol: a plain DHT peer)."""
    text = str(error)
    if isinstance(error, WireError) and text.startswith("unknown rpc method "):
        return "status" not in text.partition("; this peer serves: ")[2].split(", ")
    return isinstance(error, RPCError) and "protocols not supported" in text
