"""Record schemas and announce/lookup over real hivemind DHT nodes (two DHT child processes on loopback).

Checks: records round-trip and ignore unknown fields; a peer cannot overwrite another's record; malformed
or mislabelled records are skipped (with one log line) without hiding the good ones; records expire; and
an orphaned DHT child (its daemon SIGKILLed) takes itself and p2pd down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import msgpack
import pytest
from hivemind.utils import get_dht_time

from fusionnet.dht import (
    COMPNODES_KEY,
    Announcer,
    BrokerRecord,
    CompnodeRecord,
    DHTConfig,
    HardwareInfo,
    NodeState,
    Role,
    decode_record,
    encode_record,
    start_dht,
    stop_dht,
)
from fusionnet.errors import WireError
from fusionnet.runtime.processes import alive, descendants, wait_until
from tests.jobfiles import REPO

HW = HardwareInfo(
    device_kind="cpu", device_name="test cpu", peak_flops=1e11, speed_factor=0.5, d_cpu=2**33, d_disk=2**35,
    mem_bandwidth=1e10, threads=1,
)  # fmt: skip


def test_records_roundtrip_ignore_unknown_fields_and_refuse_bad_values() -> None:
    peer = "QmQVtDxdhZn2jLtHpMTB971nNXR2rcbXEwAbf8oJYRTxfU"
    record = CompnodeRecord(peer_id=peer, role=Role.ANTNODE, backup=True, state=NodeState.ONLINE, hardware=HW,
                            load=0.25, running_tasks=2, data_path_address="127.0.0.1:7001")  # fmt: skip
    assert decode_record(CompnodeRecord, encode_record(record), "x") == record
    assert record.hardware is not None and record.hardware.flops == 5e10
    newer = record.model_dump(mode="json") | {
        "gpu_topology": {"nvlink": True},
        "hardware": HW.model_dump() | {"tpu": 1},
    }
    assert decode_record(CompnodeRecord, msgpack.packb(newer), "x") == record
    for bad, needle in [
        (newer | {"load": 1.5}, "load"),
        (newer | {"state": "SLEEPING"}, "state"),
        (newer | {"peer_id": "not a peer id!"}, "peer_id"),
        (newer | {"data_path_address": "127.0.0.1"}, "data_path_address"),
        (newer | {"hardware": HW.model_dump() | {"peak_flops": -1}}, "hardware.peak_flops"),
    ]:
        with pytest.raises(WireError, match=needle):
            decode_record(CompnodeRecord, msgpack.packb(bad), "x")
    # metrics_address: optional (older records lack it) and lenient (a malformed one reads as None).
    with_metrics = record.model_copy(update={"metrics_address": "[::1]:9701"})
    assert decode_record(CompnodeRecord, encode_record(with_metrics), "x").metrics_address == "[::1]:9701"
    assert "metrics_address" in newer and newer["metrics_address"] is None
    older = {k: v for k, v in newer.items() if k != "metrics_address"}
    assert decode_record(CompnodeRecord, msgpack.packb(older), "x") == record
    for odd in ("compnode-1", "host:99999", 9701, ["a"], "a b:1"):
        assert decode_record(CompnodeRecord, msgpack.packb(newer | {"metrics_address": odd}), "x") == record
    with pytest.raises(WireError, match="not valid msgpack"):
        decode_record(CompnodeRecord, b"\xc1", "x")
    with pytest.raises(WireError, match="expected msgpack bytes"):
        decode_record(CompnodeRecord, {"peer_id": peer}, "x")


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(120)
def test_announce_lookup_ownership_malformed_and_expiry(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        dht_a, val_a = await start_dht(DHTConfig())
        dht_b = None
        try:
            p2p_a = await dht_a.replicate_p2p()
            peer_a = p2p_a.peer_id.to_base58()
            maddrs = [str(m) for m in await p2p_a.get_visible_maddrs()]
            dht_b, val_b = await start_dht(DHTConfig(initial_peers=maddrs))
            peer_b = (await dht_b.replicate_p2p()).peer_id.to_base58()
            ann_a, ann_b = Announcer(dht_a, val_a, peer_a), Announcer(dht_b, val_b, peer_b)

            mine = CompnodeRecord(peer_id=peer_a, state=NodeState.ONLINE, hardware=HW)
            assert await ann_a.announce(mine, ttl=30)
            assert await ann_b.announce(BrokerRecord(peer_id=peer_b, maddrs=maddrs), ttl=30)
            [found] = await ann_b.lookup(CompnodeRecord)
            assert found.record.model_copy(update={"updated_at": 0.0}) == mine
            assert (
                abs(found.record.updated_at - get_dht_time()) < 10 and found.expires_at > get_dht_time() + 20
            )
            assert [b.record.peer_id for b in await ann_a.lookup(BrokerRecord)] == [peer_b]

            # a record announced with a short ttl disappears on its own ...
            assert await ann_b.announce(CompnodeRecord(peer_id=peer_b, state=NodeState.JOINING), ttl=1.0)
            assert peer_b in {f.record.peer_id for f in await ann_a.lookup(CompnodeRecord)}
            deadline = time.monotonic() + 10
            while peer_b in {f.record.peer_id for f in await ann_a.lookup(CompnodeRecord)}:
                assert time.monotonic() < deadline, "expired record still returned"
                await asyncio.sleep(0.1)
            # ... and a restarted peer (same keys) replaces its previous, longer-lived record at once
            assert await ann_b.announce(CompnodeRecord(peer_id=peer_b, state=NodeState.OFFLINE), ttl=60.0)
            restarted = Announcer(dht_b, val_b, peer_b)
            assert await restarted.announce(CompnodeRecord(peer_id=peer_b, state=NodeState.JOINING), ttl=2.0)
            states = {f.record.peer_id: f.record.state for f in await ann_a.lookup(CompnodeRecord)}
            assert states == {peer_a: NodeState.ONLINE, peer_b: NodeState.JOINING}

            # B cannot overwrite A's record (A's subkey carries A's key; B cannot sign for it)
            forged = mine.model_copy(update={"state": NodeState.OFFLINE, "updated_at": get_dht_time() + 5})
            now = get_dht_time()
            stored = await dht_b.store(COMPNODES_KEY, encode_record(forged), now + 60, subkey=ann_a.subkey,
                                       return_future=True)  # fmt: skip
            assert not stored
            states = {f.record.peer_id: f.record.state for f in await ann_b.lookup(CompnodeRecord)}
            assert states == {peer_a: NodeState.ONLINE, peer_b: NodeState.JOINING}

            # B's own subkey with garbage, and with a record claiming to be A: both skipped, A still found
            await dht_b.store(
                COMPNODES_KEY, b"\xc1garbage", now + 70, subkey=ann_b.subkey, return_future=True
            )
            with caplog.at_level(logging.WARNING, logger="fusionnet.dht.announce"):
                assert [f.record.peer_id for f in await ann_a.lookup(CompnodeRecord)] == [peer_a]
                assert [f.record.peer_id for f in await ann_a.lookup(CompnodeRecord)] == [peer_a]
            bad_lines = [r for r in caplog.records if "skipping malformed DHT record" in r.getMessage()]
            assert (
                len(bad_lines) == 1 and "not valid msgpack" in bad_lines[0].getMessage()
            )  # once, not per lookup
            impostor = mine.model_copy(update={"state": NodeState.OFFLINE})
            await dht_b.store(COMPNODES_KEY, encode_record(impostor), now + 71, subkey=ann_b.subkey,
                              return_future=True)  # fmt: skip
            with caplog.at_level(logging.WARNING, logger="fusionnet.dht.announce"):
                [found] = await ann_a.lookup(CompnodeRecord)
            assert found.record.peer_id == peer_a and found.record.state == NodeState.ONLINE
            assert f"record for peer {peer_a} stored under subkey of b'{peer_b}'" in caplog.text

        finally:
            if dht_b is not None:
                await stop_dht(dht_b)
            await stop_dht(dht_a)

    run(scenario())


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from fusionnet.dht import DHTConfig, start_dht

    async def main():
        dht, _ = await start_dht(DHTConfig())
        print(dht.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_dht_child_and_p2pd_exit_when_their_daemon_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], stdout=subprocess.PIPE, cwd=REPO)
    family: set[int] = set()
    try:
        assert proc.stdout is not None
        dht_pid = int(proc.stdout.readline())
        family = wait_until(lambda: descendants(proc.pid) if len(descendants(proc.pid)) >= 2 else set(), 20,
                            "the DHT child and its p2pd")  # fmt: skip
        assert dht_pid in family
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(lambda: not any(alive(p) for p in family), 20, "the orphaned DHT child and p2pd to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in family:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
