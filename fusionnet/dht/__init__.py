"""Thin layer over hivemind's DHT: record schemas, well-known keys, announce/lookup with expiration.

Map of the package:

- ``records.py``   pydantic v2 schemas (``CompnodeRecord``, ``HardwareInfo``, ``BrokerRecord``, ``NodeState``,
                   ``Role``) that ignore unknown fields; msgpack encode/decode (never pickle).
- ``node.py``      ``DHTConfig``, ``start_dht`` / ``stop_dht`` / ``kill_dht``: the hivemind DHT child process
                   (which runs p2pd), made to leave no process behind; the persisted record-signing key.
- ``announce.py``  ``Announcer``: signed, expiring announcements under ``fusionnet/v1/compnodes`` and
                   ``fusionnet/v1/brokers`` (subkey = peer id + owner key); lookups that skip bad records.
"""

from fusionnet.dht.announce import BROKERS_KEY, COMPNODES_KEY, Announcer, Found
from fusionnet.dht.node import DHTConfig, SwarmDHT, kill_dht, start_dht, stop_dht
from fusionnet.dht.records import (
    BrokerRecord,
    CompnodeRecord,
    HardwareInfo,
    NodeState,
    Role,
    decode_record,
    encode_record,
)

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
