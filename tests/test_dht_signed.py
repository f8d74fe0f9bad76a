"""Signed DHT records (issue 12, deliver 3): a record counts only when it is signed by the libp2p
identity of the peer it describes, and its times come from the DHT's expiration.

Two real hivemind DHT nodes (child processes on loopback); B is the attacker.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from hivemind.utils import get_dht_time

from fusionnet.dht import (
    BROKERS_KEY,
    COMPNODES_KEY,
    Announcer,
    BrokerRecord,
    CompnodeRecord,
    DHTConfig,
    NodeState,
    encode_record,
    start_dht,
    stop_dht,
)
from fusionnet.dht.identity import owner_peer_id

pytestmark = pytest.mark.swarm


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.mark.timeout(120)
def test_records_not_signed_by_their_peer_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        dht_a, val_a = await start_dht(DHTConfig(identity_path=tmp_path / "a.key"))
        dht_b = None
        try:
            peer_a = (await dht_a.replicate_p2p()).peer_id.to_base58()
            maddrs = [str(m) for m in await (await dht_a.replicate_p2p()).get_visible_maddrs()]
            dht_b, val_b = await start_dht(DHTConfig(initial_peers=maddrs))  # no state dir: scratch identity
            peer_b = (await dht_b.replicate_p2p()).peer_id.to_base58()
            # the record signer *is* the libp2p identity
            assert owner_peer_id(val_a.local_public_key[len(b"[owner:") : -1]) == peer_a
            assert owner_peer_id(val_b.local_public_key[len(b"[owner:") : -1]) == peer_b
            ann_a, ann_b = Announcer(dht_a, val_a, peer_a), Announcer(dht_b, val_b, peer_b)
            assert await ann_a.announce(CompnodeRecord(peer_id=peer_a, state=NodeState.ONLINE), ttl=30)
            assert await ann_a.announce(BrokerRecord(peer_id=peer_a, maddrs=maddrs), ttl=30)

            # B writes, under A's peer id but with B's own (valid) signature, a fake OFFLINE record for
            # A and a fake broker record for A, both stamped far in the future: they used to win
            now = get_dht_time()
            forged_subkey = peer_a.encode() + val_b.local_public_key
            fake_offline = CompnodeRecord(peer_id=peer_a, state=NodeState.OFFLINE, updated_at=now + 1e6)
            fake_broker = BrokerRecord(peer_id=peer_a, maddrs=["/ip4/6.6.6.6/tcp/1"], updated_at=now + 1e6)
            for key, record in ((COMPNODES_KEY, fake_offline), (BROKERS_KEY, fake_broker)):
                assert await dht_b.store(
                    key, encode_record(record), now + 50, subkey=forged_subkey, return_future=True
                )
            # B's own record claiming a future announcement time, and one that would live for a day
            assert await ann_b.announce(CompnodeRecord(peer_id=peer_b, state=NodeState.ONLINE), ttl=30)
            with caplog.at_level(logging.WARNING, logger="fusionnet.dht.announce"):
                for ann in (ann_a, ann_b):
                    found = {f.record.peer_id: f for f in await ann.lookup(CompnodeRecord)}
                    assert found[peer_a].record.state == NodeState.ONLINE
                    brokers = await ann.lookup(BrokerRecord)
                    assert [(b.record.peer_id, b.record.maddrs) for b in brokers] == [(peer_a, maddrs)]
            assert f"record for peer {peer_a} is signed by peer {peer_b}, not by that peer" in caplog.text

            future = CompnodeRecord(peer_id=peer_b, state=NodeState.ONLINE, updated_at=get_dht_time() + 1e6)
            assert await dht_b.store(
                COMPNODES_KEY, encode_record(future), get_dht_time() + 40, subkey=ann_b.subkey,
                return_future=True,
            )  # fmt: skip
            found = {f.record.peer_id: f for f in await ann_a.lookup(CompnodeRecord)}
            assert found[peer_b].record.updated_at <= get_dht_time()  # the claim is clamped to now
            long_lived = CompnodeRecord(peer_id=peer_b, state=NodeState.OFFLINE)
            assert await dht_b.store(
                COMPNODES_KEY, encode_record(long_lived), get_dht_time() + 86400, subkey=ann_b.subkey,
                return_future=True,
            )  # fmt: skip
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fusionnet.dht.announce"):
                found = {f.record.peer_id: f for f in await ann_a.lookup(CompnodeRecord)}
            assert peer_b not in found and "beyond the 3600 s a record may live" in caplog.text
        finally:
            if dht_b is not None:
                await stop_dht(dht_b)
            await stop_dht(dht_a)

    run(scenario())
    assert (tmp_path / "a.key").stat().st_mode & 0o077 == 0
