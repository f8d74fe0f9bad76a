"""Failure detection over slow links (issue 16): a compnode whose pings queue behind bulk bytes that are
still moving is alive; one that moves nothing is lost."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fusionnet.broker.failures import PROBE_PINGS, FailureWatch
from fusionnet.broker.registry import CompnodeRegistry
from fusionnet.dht.announce import Found
from fusionnet.dht.records import CompnodeRecord, NodeState
from fusionnet.messages.compnode_rpc import CompnodeClient
from fusionnet.rpc.protocol import RPCError

BUSY, DEAD = "12D3KooW" + "B" * 44, "12D3KooW" + "D" * 44


def registry(now: float, expires_in: float = 3600.0) -> CompnodeRegistry:
    reg = CompnodeRegistry(heartbeat_timeout=3.0)
    records = [CompnodeRecord(peer_id=p, state=NodeState.ONLINE) for p in (BUSY, DEAD)]
    reg.update_records([Found(r, now + expires_in, b"") for r in records], now)
    return reg


def test_traffic_counts_as_a_sign_of_life_for_the_heartbeat_timeout() -> None:
    reg = registry(100.0)
    for t in (101.0, 102.0, 103.0, 104.0, 105.0):  # pings fail, bulk bytes keep moving
        reg.record_failure(BUSY, t)
        reg.record_traffic(BUSY, t)
    assert reg.get(BUSY).reachable and reg.heard_from(BUSY, 105.5)
    assert not reg.get(DEAD).reachable  # silent since 100
    assert [e.peer_id for e in reg.check_timeouts(108.1)] == [BUSY]  # bytes stopped at 105: now lost


class Calls:
    """Pings to BUSY fail until ``answer_at``, while a bulk transfer keeps recording traffic; DEAD never
    answers."""

    def __init__(self, answer_at: float) -> None:
        self.answer_at = answer_at
        self.pings: dict[str, int] = {BUSY: 0, DEAD: 0}

    async def call(self, peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        assert method == "ping"
        self.pings[peer] += 1
        if peer == BUSY and time.time() >= self.answer_at:
            return {"nonce": "probe", "peer_id": peer, "state": "ONLINE"}
        await asyncio.sleep(0.05)
        raise RPCError(f"rpc ping on peer {peer}: no answer", peer=peer, method=method, kind="Timeout")


class Context:
    def __init__(self, reg: CompnodeRegistry, calls: Calls) -> None:
        self.registry = reg
        self.compnodes = CompnodeClient(calls.call)


@pytest.mark.timeout(30)
def test_probe_tells_a_saturated_link_from_a_dead_peer() -> None:
    async def main() -> tuple[set[str], Calls]:
        now = time.time()
        reg = registry(now)
        calls = Calls(answer_at=now + 1.0)
        watch = FailureWatch(Context(reg, calls), lambda: [BUSY, DEAD], set())  # type: ignore[arg-type]

        async def bulk() -> None:  # the weights still streaming to BUSY
            while time.time() < now + 1.2:
                reg.record_traffic(BUSY, time.time())
                await asyncio.sleep(0.05)

        mover = asyncio.ensure_future(bulk())
        dead = await watch.probe()
        await mover
        return dead, calls

    dead, calls = asyncio.run(main())
    assert dead == {DEAD}
    assert calls.pings[BUSY] > 1  # asked again while its bytes moved, until the ping got through


@pytest.mark.timeout(30)
def test_a_compnode_that_misses_one_ping_is_kept_and_a_dead_one_gets_a_few() -> None:
    """A compnode starved of CPU (its record expired, heartbeats missed) may not answer one ping in time
    and answer the next: it is kept; a dead one is lost after ``PROBE_PINGS`` unanswered pings."""

    async def main() -> tuple[set[str], Calls]:
        now = time.time()
        reg = registry(now, expires_in=5.0)
        reg.check_timeouts(now + 10)
        reg.update_records([], now + 10)  # both records expired: the registry gave up on both
        calls = Calls(answer_at=now + 0.03)  # BUSY's first ping fails, its second is answered
        watch = FailureWatch(Context(reg, calls), lambda: [BUSY, DEAD], set())  # type: ignore[arg-type]
        return await watch.probe(), calls

    dead, calls = asyncio.run(main())
    assert dead == {DEAD}
    assert calls.pings == {BUSY: 2, DEAD: PROBE_PINGS}


@pytest.mark.timeout(30)
def test_probe_pings_a_compnode_the_registry_gave_up_on_and_keeps_it_if_it_answers() -> None:
    """Missed heartbeats and an expired record raise the alarm, but a CPU-starved compnode shows both
    and is alive: the probe asks it. Only a goodbye (OFFLINE announced) is final without a ping."""

    async def main() -> tuple[set[str], set[str], Calls]:
        now = time.time()
        reg = registry(now, expires_in=5.0)
        reg.check_timeouts(now + 10)  # no pong from either for 10 s: both UNREACHABLE
        reg.update_records([], now + 10)  # and both records expired: both gone
        assert [reg.get(p).effective_state for p in (BUSY, DEAD)] == ["UNREACHABLE", "UNREACHABLE"]
        calls = Calls(answer_at=now)  # BUSY answers at once, DEAD never
        watch = FailureWatch(Context(reg, calls), lambda: [BUSY, DEAD], set())  # type: ignore[arg-type]
        dead = await watch.probe()
        goodbye = CompnodeRecord(peer_id=BUSY, state=NodeState.OFFLINE, updated_at=time.time() + 1)
        reg.update_records([Found(goodbye, now + 9000, b"")], now + 11)
        calls.pings[BUSY] = 0
        return dead, await watch.probe(), calls

    dead, after_goodbye, calls = asyncio.run(main())
    assert dead == {DEAD}
    assert after_goodbye == {BUSY, DEAD}
    assert calls.pings[BUSY] == 0  # the goodbye is believed without a ping
