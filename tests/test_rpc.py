"""The msgpack RPC layer over real hivemind P2P daemons (two p2pd processes on loopback, one test process).

Every adversarial case (garbage, oversize, stalls, unknown methods, crashing handlers) must get an error
response and leave the server serving: each scenario ends with a normal call that must still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P

from fusionnet.errors import PlanError, WireError
from fusionnet.rpc import RPCClient, RPCContext, RPCError, RPCServer
from fusionnet.rpc.kept import CLIENT_IDLE, MAX_IDLE_PER_PEER, KeptStreams, _Idle
from fusionnet.rpc.limits import CallBudget, CallLimits
from fusionnet.rpc.protocol import (
    KEPT_PER_PEER,
    KEPT_PROTOCOL,
    STREAM_PROTOCOL,
    UNARY_PROTOCOL,
    decode_request,
    decode_response,
    encode_request,
    frame_header,
    parse_frame_header,
)
from fusionnet.rpc.streams import read_frame


class EchoService:
    """Handlers exercising each response path."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[tuple[str, str]] = []

    async def rpc_echo(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        self.calls.append((context.method, context.remote_peer))
        return {"echo": payload, "from": context.remote_peer}

    async def rpc_big(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return {"blob": bytes(range(256)) * (payload["n"] // 256)}

    async def rpc_plan_fails(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        raise PlanError("no feasible plan: compnode 3 lacks 2 GiB of memory")

    async def rpc_crash(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        raise RuntimeError("boom")

    async def rpc_bad_result(self, payload: dict[str, Any], context: RPCContext) -> Any:
        return ["not", "a", "dict"]

    async def rpc_slow(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        await asyncio.sleep(payload["seconds"])
        return {"n": len(payload.get("blob", b""))}

    async def rpc_wait(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        await self.release.wait()
        return {}


@contextlib.asynccontextmanager
async def pair(**server_kwargs: Any) -> AsyncIterator[tuple[RPCServer, RPCClient, EchoService, P2P]]:
    a = await P2P.create()
    b = None
    server = None
    try:
        b = await P2P.create(initial_peers=await a.get_visible_maddrs())
        service = EchoService()
        server = RPCServer(a, **server_kwargs)
        server.add_handlers(service)
        await server.start()
        yield server, RPCClient(b, default_timeout=10.0), service, b
    finally:
        if server is not None:
            await server.stop(grace=1.0)
        if b is not None:
            await b.shutdown()
        await a.shutdown()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


# ---- pure protocol ----------------------------------------------------------------------------------
def test_envelopes_roundtrip_and_refuse_garbage() -> None:
    req = decode_request(encode_request("echo", {"x": [1, 2.5, b"\x00"], "y": None}))
    assert req.method == "echo" and req.payload == {"x": [1, 2.5, b"\x00"], "y": None}
    for garbage, needle in [
        (b"\xc1\xff\x00", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": 99, "method": "echo", "payload": {}}), "protocol version 99"),
        (msgpack.packb({"v": 1, "method": "../etc", "payload": {}}), "not an identifier"),
        (msgpack.packb({"v": 1, "method": "echo", "payload": [1]}), "payload must be a map"),
        (msgpack.packb({1: 2}), "not valid msgpack"),  # non-string map keys are refused by the decoder
    ]:
        with pytest.raises(WireError, match=needle):
            decode_request(garbage)
    with pytest.raises(WireError, match="cannot be encoded"):
        encode_request("echo", {"x": object()})
    with pytest.raises(WireError, match="lacks a 'result'"):
        decode_response(msgpack.packb({"ok": True}))
    assert parse_frame_header(frame_header(10), 10, "x") == 10
    with pytest.raises(WireError, match="exceeds the limit of 9 bytes"):
        parse_frame_header(frame_header(10), 9, "x")
    with pytest.raises(WireError, match="bad magic"):
        parse_frame_header(b"GET / HTTP/1", 9, "x")


# ---- over p2pd --------------------------------------------------------------------------------------
@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_calls_small_large_and_stashed_answers() -> None:
    async def scenario() -> None:
        async with pair() as (server, client, service, b):
            peer = server.p2p.peer_id.to_base58()
            out = await client.call(peer, "echo", {"a": 1})
            assert out == {"echo": {"a": 1}, "from": b.peer_id.to_base58()}
            assert service.calls == [("echo", b.peer_id.to_base58())]
            blob = bytes(range(256)) * (3 * 4096)  # 3 MiB: over the unary limit -> chunked stream
            assert (await client.call(peer, "echo", {"blob": blob}))["echo"]["blob"] == blob
            # a small request whose answer is too big for a unary reply: stashed, then fetched over a stream
            big = await client.call(peer, "big", {"n": 5 * 1024 * 1024})
            assert big["blob"] == bytes(range(256)) * (5 * 1024 * 1024 // 256)
            assert server._stash == {}
            # an answer known to be large: the call goes over a stream at once and the answer comes back
            # on it, nothing stashed (one round trip)
            stashed: list[str] = []
            put_stash = server._put_stash
            server._put_stash = lambda response, peer, method: (
                stashed.append(method) or put_stash(response, peer, method)
            )
            direct = await client.call(peer, "big", {"n": 1 << 20}, large_answer=True)
            assert direct["blob"] == bytes(range(256)) * (1 << 12) and stashed == []
            await client.call(peer, "big", {"n": 1 << 20})
            assert stashed == ["big"]  # the same call without it: stashed and fetched

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_handler_errors_and_unknown_methods() -> None:
    async def scenario() -> None:
        async with pair() as (server, client, _, _b):
            peer = server.p2p.peer_id.to_base58()
            with pytest.raises(PlanError, match=r"^no feasible plan: compnode 3 lacks 2 GiB of memory$"):
                await client.call(peer, "plan_fails", {})
            with pytest.raises(RPCError, match="RuntimeError: boom") as info:
                await client.call(peer, "crash", {})
            assert info.value.kind == "RuntimeError" and info.value.method == "crash"
            with pytest.raises(RPCError, match="not a dict"):
                await client.call(peer, "bad_result", {})
            with pytest.raises(
                WireError, match=r"unknown rpc method 'nope'.*this peer serves: bad_result, big"
            ):
                await client.call(peer, "nope", {})
            with pytest.raises(WireError, match="not an identifier"):
                await client.call(peer, "no-such-name", {})
            with pytest.raises(WireError, match="not valid base58"):
                await client.call("0OIl", "echo", {})
            assert (await client.call(peer, "echo", {"still": "alive"}))["echo"] == {"still": "alive"}

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_garbled_oversized_and_stalled_requests_get_errors() -> None:
    async def raw_stream(b: P2P, peer: Any, data: bytes, close: bool = True) -> bytes:
        _, reader, writer = await b.call_binary_stream_handler(peer, STREAM_PROTOCOL)
        writer.write(data)
        await writer.drain()
        try:
            return await read_frame(reader, 1 << 20, 10.0, "answer")
        finally:
            writer.close()

    async def scenario() -> None:
        async with pair(max_message_bytes=1 << 20, idle_timeout=0.5) as (server, client, _, b):
            peer = server.p2p.peer_id
            # unary transport, payload not msgpack
            reply = await b.call_protobuf_handler(
                peer, UNARY_PROTOCOL, BytesValue(value=b"\xc1garbage"), BytesValue
            )
            assert "not valid msgpack" in decode_response(reply.value).error[1]
            # stream transport: bad magic, a 10 GiB header, a stalled upload, a valid frame with a bad body
            resp = decode_response(await raw_stream(b, peer, b"HELO" + bytes(8)))
            assert resp.error[0] == "WireError" and "bad magic" in resp.error[1]
            resp = decode_response(await raw_stream(b, peer, frame_header(10 << 30)))
            assert "10737418240 bytes exceeds the limit of 1048576 bytes" in resp.error[1]
            resp = decode_response(await raw_stream(b, peer, frame_header(1000) + b"x" * 10))
            assert "stalled after 10 of 1000 bytes" in resp.error[1]
            resp = decode_response(await raw_stream(b, peer, frame_header(3) + msgpack.packb([1, 2])))
            assert "must be a map" in resp.error[1]
            # a real request over the server's limit, sent by a client that allows more
            with pytest.raises(WireError, match="exceeds the limit of 1048576 bytes"):
                await client.call(peer, "echo", {"blob": b"x" * (2 << 20)})
            # the client's own limit is checked before sending anything
            small = RPCClient(b, max_message_bytes=4096)
            with pytest.raises(WireError, match="exceeds the limit of 4096 bytes"):
                await small.call(peer, "echo", {"blob": b"x" * 5000})
            assert (await client.call(peer, "echo", {"ok": True}))["echo"] == {"ok": True}

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_a_call_gets_the_time_its_bytes_take_at_the_slowest_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big request's attempt may take its timeout plus the request's transfer at ``SLOWEST_LINK``
    (here made 2 s for any body over 1 kB, so a 1 s handler fits a 0.5 s timeout); a small one may not.
    The server asks no more of an upload than that rate either."""
    from fusionnet.rpc import client as client_module
    from fusionnet.rpc.limits import SLOWEST_LINK, transfer_seconds

    assert CallLimits().min_rate == SLOWEST_LINK <= 1 << 17  # 1 Mbit/s uplinks are served
    assert transfer_seconds(32 << 20) == pytest.approx((32 << 20) / SLOWEST_LINK)
    monkeypatch.setattr(client_module, "transfer_seconds", lambda n: 2.0 if n > 1000 else 0.0)

    async def scenario() -> None:
        async with pair() as (server, client, _service, _b):
            peer = server.p2p.peer_id.to_base58()
            big = await client.call(peer, "slow", {"seconds": 1.0, "blob": b"x" * 4096}, timeout=0.5)
            assert big == {"n": 4096}
            with pytest.raises(RPCError, match=r"no answer within 0\.5 s"):
                await client.call(peer, "slow", {"seconds": 1.0}, timeout=0.5)

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_timeouts_and_stop_cancels_in_flight_calls() -> None:
    async def scenario() -> None:
        async with pair() as (server, client, service, _b):
            peer = server.p2p.peer_id.to_base58()
            with pytest.raises(RPCError, match=r"no answer within 0\.3 s") as info:
                await client.call(peer, "wait", {}, timeout=0.3)
            assert info.value.kind == "Timeout"
            pending = asyncio.create_task(client.call(peer, "wait", {}, timeout=10))
            deadline = asyncio.get_running_loop().time() + 10
            while server.in_flight == 0:  # wait until the call is being served
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            await server.stop(grace=0.2)
            assert server.in_flight == 0
            with pytest.raises(RPCError):
                await pending
            service.release.set()

    run(scenario())


def test_call_budget_counts_and_bytes_per_peer_and_in_total() -> None:
    budget = CallBudget(CallLimits(calls_per_peer=2, calls_total=3, bytes_total=150), max_message_bytes=100)
    budget.enter("a")
    budget.enter("a")
    with pytest.raises(WireError, match="peer a already has 2 rpc calls in flight"):
        budget.enter("a")
    budget.enter("b")
    with pytest.raises(WireError, match="serves 3 rpc calls already"):
        budget.enter("c")
    budget.reserve("a", 100)
    with pytest.raises(WireError, match="peer a already has 100 bytes of requests in flight"):
        budget.reserve("a", 1)
    with pytest.raises(WireError, match="100 bytes of requests are in flight here"):
        budget.reserve("b", 60)
    budget.leave("a", 100)
    budget.reserve("b", 60)
    assert budget.refused == 4 and dict(budget.held) == {"b": 60}
    for peer, held in (("a", 0), ("b", 60)):
        budget.leave(peer, held)
    assert not budget.calls and not budget.held
    assert CallLimits(read_base=2, min_rate=10).read_deadline(100) == 12


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_a_flooding_peer_is_refused_over_its_limits_and_others_are_served() -> None:
    """Calls over the per-peer count, bodies over the byte budget, uploads past their total deadline and
    handlers past theirs are refused with WireErrors; the server then serves as before."""
    limits = CallLimits(calls_per_peer=2, read_base=1.0, min_rate=1e6, handler_timeout=1.0)

    async def scenario() -> None:
        async with pair(max_message_bytes=1 << 20, idle_timeout=5.0, limits=limits) as (
            server,
            client,
            svc,
            b,
        ):
            peer = server.p2p.peer_id.to_base58()
            waiting = [asyncio.create_task(client.call(peer, "wait", {}, timeout=10)) for _ in range(2)]
            while server.budget.calls[b.peer_id.to_base58()] < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(WireError, match="already has 2 rpc calls in flight"):
                await client.call(peer, "echo", {})
            with pytest.raises(WireError, match="no answer within the server's 1 s"):
                await asyncio.gather(*waiting)
            # an upload that trickles (a byte per 0.4 s: under the idle timeout) misses its total deadline
            _, reader, writer = await b.call_binary_stream_handler(server.p2p.peer_id, STREAM_PROTOCOL)
            writer.write(frame_header(100))
            for _ in range(5):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.4)
            resp = decode_response(await read_frame(reader, 1 << 20, 10.0, "answer"))
            writer.close()
            assert "within the deadline of 1 s" in resp.error[1]
            svc.release.set()
            assert (await client.call(peer, "echo", {"ok": True}))["echo"] == {"ok": True}
            assert not server.budget.calls or server.budget.calls == {b.peer_id.to_base58(): 0}
            assert not server.budget.held

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_calls_share_a_kept_stream_and_survive_its_end() -> None:
    """Streamed calls to one peer reuse one kept stream; one the server closed (idle, stopped) is replaced
    by a fresh one without the caller noticing; a server without kept streams gets plain ones."""

    async def scenario() -> None:
        async with pair(kept_idle=0.3) as (server, _, _svc, b):
            peer = server.p2p.peer_id
            client = RPCClient(b, unary_limit=0, default_timeout=10.0)  # every call streamed, as daemons do
            for i in range(5):
                assert (await client.call(peer, "echo", {"i": i}))["echo"] == {"i": i}
            assert client.kept is not None and (client.kept.opened, client.kept.reused) == (1, 4)
            # concurrent calls each need a stream; the pool keeps at most MAX_IDLE_PER_PEER of them after
            got = await asyncio.gather(*(client.call(peer, "echo", {"i": i}) for i in range(12)))
            assert [g["echo"]["i"] for g in got] == list(range(12))
            assert len(client.kept._idle[peer]) == MAX_IDLE_PER_PEER
            # the server closes kept streams idle for kept_idle; the pool still holds them: the call
            # finds them closed and goes on a fresh stream
            while server._kept:
                await asyncio.sleep(0.05)
            opened = client.kept.opened
            assert (await client.call(peer, "echo", {"after": "idle"}))["echo"] == {"after": "idle"}
            assert client.kept.opened == opened + 1
            # a peer that does not serve kept streams (an older version): plain streams, and it is asked
            # again only after a while
            await server.p2p.remove_binary_stream_handler(KEPT_PROTOCOL)
            client.close()
            assert (await client.call(peer, "echo", {"plain": 1}))["echo"] == {"plain": 1}
            assert not client.kept.wanted(peer)
            assert (await client.call(peer, "echo", {"plain": 2}))["echo"] == {"plain": 2}
            client.close()

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_kept_streams_are_bounded_per_peer_and_garbage_on_one_ends_it() -> None:
    async def scenario() -> None:
        async with pair(idle_timeout=0.5) as (server, client, _svc, b):
            peer = server.p2p.peer_id
            held = []
            for _ in range(KEPT_PER_PEER):
                _, reader, writer = await b.call_binary_stream_handler(peer, KEPT_PROTOCOL)
                held.append(writer)
            while sum(server._kept.values()) < KEPT_PER_PEER:
                await asyncio.sleep(0.01)
            # one more from that peer is closed unanswered
            _, reader, writer = await b.call_binary_stream_handler(peer, KEPT_PROTOCOL)
            writer.write(frame_header(len(body := encode_request("echo", {}))) + body)
            with pytest.raises(asyncio.IncompleteReadError):
                await read_frame(reader, 1 << 20, 10.0, "answer")
            writer.close()
            for w in held:
                w.close()
            while server._kept:
                await asyncio.sleep(0.01)
            # garbage on a kept stream is answered with an error, and the stream ends
            _, reader, writer = await b.call_binary_stream_handler(peer, KEPT_PROTOCOL)
            writer.write(b"HELO" + bytes(8))
            resp = decode_response(await read_frame(reader, 1 << 20, 10.0, "answer"))
            assert resp.error[0] == "WireError" and "bad magic" in resp.error[1]
            assert await reader.read() == b""
            writer.close()
            # and the server serves as before, the flooding peer included
            assert (await client.call(peer, "echo", {"blob": b"x" * 100_000}))["echo"][
                "blob"
            ] == b"x" * 100_000
            client.close()

    run(scenario())


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_a_kept_stream_that_carried_a_refusal_is_not_used_again() -> None:
    """The server refuses a request over its limit on a kept stream and then drops what follows until it
    closes the stream: the pool closes that stream instead of keeping it, so the next call goes on a
    fresh stream at once and is not lost to the server's discarding."""

    async def scenario() -> None:
        async with pair(max_message_bytes=4096) as (server, _, _svc, b):
            peer = server.p2p.peer_id
            client = RPCClient(b, unary_limit=0, max_message_bytes=1 << 20, default_timeout=10.0)
            assert (await client.call(peer, "echo", {"i": 0}))["echo"] == {"i": 0}
            assert client.kept is not None and len(client.kept._idle[peer]) == 1
            with pytest.raises(WireError, match="exceeds"):
                await client.call(peer, "echo", {"blob": b"x" * 10_000})
            assert not client.kept._idle.get(peer)  # the refused stream was closed, not kept
            opened = client.kept.opened
            assert (await client.call(peer, "echo", {"i": 1}))["echo"] == {"i": 1}
            assert client.kept.opened == opened + 1
            assert len(client.kept._idle[peer]) == 1  # and that one is kept, as any answered call's
            client.close()

    run(scenario())


class _FakeWriter:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_the_pool_closes_streams_idle_too_long_of_peers_never_called_again() -> None:
    pool = KeptStreams(p2p=None)  # type: ignore[arg-type]  # no stream is opened here
    now = time.monotonic()
    old, recent = _FakeWriter(), _FakeWriter()
    pool._idle = {
        "gone": [_Idle(None, old, now - 2 * CLIENT_IDLE)],  # type: ignore[arg-type]
        "here": [_Idle(None, recent, now)],  # type: ignore[arg-type]
    }
    pool._sweep()  # swept at most once per CLIENT_IDLE: not yet
    assert not old.closed and set(pool._idle) == {"gone", "here"}
    pool._swept = now - CLIENT_IDLE
    pool._sweep()
    assert old.closed and not recent.closed and set(pool._idle) == {"here"}
