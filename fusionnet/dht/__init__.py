"""Thin layer over hivemind's DHT: record schemas, well-known keys, announce/lookup with expiration.

Map of the package:

- ``records.py``   pydantic v2 schemas (``CompnodeRecord``, ``HardwareInfo``, ``BrokerRecord``, ``NodeState``,
                   ``Role``) that ignore unknown fields; msgpack encode/decode (never pickle).
- ``node.py``      ``DHTConfig``, ``start_dht`` / ``stop_dht`` / ``kill_dht``: the hivemind DHT child process
                   (which runs p2pd), made to leave no process behind.
- ``identity.py``  the peer's RSA identity: its libp2p peer id *and* the signer of its records; owner key
                   -> peer id (how a lookup tells a peer's own record from a forgery); 0600 key files.
- ``announce.py``  ``Announcer``: signed, expiring announcements under ``fusionnet/v1/compnodes`` and
                   ``fusionnet/v1/brokers`` (subkey = peer id + owner key); lookups that skip bad records,
                   records not signed by their own peer, and take times from the DHT's expiration.
- ``peerids.py``   the peer ids ``/p2p/<id>`` multiaddrs name (whom a compnode or a submitter pins).
"""

from __future__ import annotations

import importlib
from typing import Any

# Names resolved on first use (PEP 562): ``records`` is imported by processes that never touch the DHT
# (a compnode's sandbox workers, message models), and ``announce``/``node`` import hivemind (1 s).
_HOME = {
    "BROKERS_KEY": "announce",
    "COMPNODES_KEY": "announce",
    "Announcer": "announce",
    "Found": "announce",
    "DHTConfig": "node",
    "SwarmDHT": "node",
    "kill_dht": "node",
    "start_dht": "node",
    "stop_dht": "node",
    "BrokerRecord": "records",
    "CompnodeRecord": "records",
    "HardwareInfo": "records",
    "NodeState": "records",
    "Role": "records",
    "decode_record": "records",
    "encode_record": "records",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = [
    "BROKERS_KEY",
    "COMPNODES_KEY",
    "Announcer",
    "BrokerRecord",
    "CompnodeRecord",
    "DHTConfig",
    "Found",
    "HardwareInfo",
    "NodeState",
    "Role",
    "SwarmDHT",
    "decode_record",
    "encode_record",
    "kill_dht",
    "start_dht",
    "stop_dht",
]
