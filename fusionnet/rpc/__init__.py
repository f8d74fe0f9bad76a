"""Request/response RPC carrying msgpack dicts between peers over hivemind's libp2p daemon (p2pd).

Map of the package:

- ``protocol.py``  the wire format (pure): request/response envelopes, stream frame headers, limits,
                   ``RPCError`` and the mapping of remote errors back to project error classes.
- ``streams.py``   read/write one length-prefixed frame on an asyncio stream, with size and idle limits.
- ``server.py``    ``RPCServer``: a table of ``rpc_<name>`` coroutines served over one unary, one
                   stream and one kept-stream protocol; every bad request gets an error response,
                   never a crash.
- ``limits.py``     per-peer and total caps on calls and request bytes in flight, request deadlines.
- ``client.py``    ``RPCClient.call(peer_id, "name", payload, timeout=)``.
- ``kept.py``      the client's pool of streams kept open between calls to the same peer.
- ``windows.py``   ``in_window``: calls kept a few at a time in flight (a transfer's chunks, a
                   collection's sub-DAGs).

Handlers have the signature ``async def rpc_name(self, payload: dict, context: RPCContext) -> dict``;
the daemons write theirs typed (``fusionnet.messages.base.handles``: a request model in, a reply model
out, a malformed payload refused with one ``WireError``) and call each other through typed clients
(``fusionnet.messages``' ``BrokerClient`` / ``CompnodeClient``) built on ``RPCClient.call``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use (PEP 562): ``protocol`` is pure, but ``client``/``server`` import hivemind (1 s),
# which a compnode's sandbox workers never need.
_HOME = {
    "RPCClient": "client",
    "as_peer_id": "client",
    "RPCError": "protocol",
    "RPCContext": "server",
    "RPCServer": "server",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = ["RPCClient", "RPCContext", "RPCError", "RPCServer", "as_peer_id"]
