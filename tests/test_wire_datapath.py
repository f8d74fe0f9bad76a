"""The direct TCP data path: delivery, ordering, and refusals that never disturb other connections or jobs."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Coroutine

import pytest
import torch
import uvloop

from fusionnet.errors import WireError
from fusionnet.wire import (
    NO_JOB,
    DataPathClient,
    DataPathServer,
    PeerUnreachable,
    TensorFrame,
    parse_address,
    read_frame,
)
from fusionnet.wire import pool as pool_module
from fusionnet.wire.datapath import hello_bytes, read_hello
from tests.wire_support import KEY, OTHER_KEY, craft, frame, frame_bytes, reader_of, until

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop_name: str, coro: Coroutine) -> object:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(asyncio.wait_for(coro, 60))


async def raw_send(address: tuple[str, int], data: bytes) -> bool:
    """Writes bytes on a fresh connection; True if the server then closed it."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        assert await read_hello(reader) == "S"  # the server's first bytes: who it is
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


def _assert_delivered_and_counted(
    server: DataPathServer,
    job1: tuple[list[TensorFrame], list[torch.Tensor]],
    job2: tuple[list[TensorFrame], list[torch.Tensor]],
    closed: dict[str, bool],
) -> None:
    """Every good frame arrived in order, every attack was counted once under its reason."""
    (got1, sent1), (got2, sent2) = job1, job2
    assert [f.step for f in got1] == list(range(len(sent1)))  # in order, none lost
    assert all(torch.equal(f.tensor, t) for f, t in zip(got1, sent1))
    assert all(torch.equal(f.tensor, t) for f, t in zip(got2, sent2))
    assert server.stats["job1"].frames_refused == {"sender_not_allowed": 1, "bad_mac": 1, "size_mismatch": 1}
    assert server.stats["job2"].frames_refused == {"oversized": 1, "bad_dtype": 1}
    assert server.stats[NO_JOB].frames_refused == {"bad_magic": 1, "unknown_job": 1}
    assert server.stats["job1"].frames_accepted == len(sent1)
    assert server.stats["job2"].bytes_accepted == sum(t.numel() * 4 for t in sent2)
    # Streams that can no longer be trusted are closed; the raw senders saw their connection end.
    assert closed == {"mismatch": True, "oversized": True, "dtype": True, "garbled": True}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_bad_frames_are_refused_and_counted_while_good_ones_keep_flowing(loop_name: str, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fusionnet.wire")

    async def scenario() -> None:
        got1: list[TensorFrame] = []
        got2: list[TensorFrame] = []

        async def slow_handler(f: TensorFrame) -> None:  # awaitable handlers are awaited in order
            await asyncio.sleep(0)
            got2.append(f)

        server = DataPathServer(peer_id="S", max_payload=1 << 20)
        server.register_job("job1", KEY, {"A"}, got1.append)
        server.register_job("job2", OTHER_KEY, {"A", "B"}, slow_handler)
        addr = await server.start()
        # ``stray`` sends the frame of a job that never existed here: the server closes that connection
        # (it is out of step with us), so it must not be the one the good frames travel on
        good, intruder, wrong_key, stray = (DataPathClient(peer_id=p) for p in ("A", "Z", "A", "A"))
        sent1: list[torch.Tensor] = []
        sent2: list[torch.Tensor] = []
        closed: dict[str, bool] = {}

        async def good_round(i: int) -> None:
            t1, t2 = torch.full((4, 2), float(i)), torch.arange(i + 1, dtype=torch.int32)
            await good.send(addr, frame(t1, job="job1", step=i), KEY)
            await good.send(addr, frame(t2, job="job2", sender="A", step=i), OTHER_KEY)
            sent1.append(t1)
            sent2.append(t2)

        async def raw(name: str, data: bytes) -> None:
            closed[name] = await raw_send(addr, data)

        attacks: list[tuple[str, str, Callable[[], Coroutine]]] = [
            (
                "job1",
                "sender_not_allowed",
                lambda: intruder.send(addr, frame(torch.ones(3), sender="Z"), KEY),
            ),
            ("job1", "bad_mac", lambda: wrong_key.send(addr, frame(torch.ones(3)), OTHER_KEY)),
            ("job1", "size_mismatch", lambda: raw("mismatch", craft(b"abc", shape=[4]))),
            (
                "job2",
                "oversized",
                lambda: raw("oversized", craft(b"", job="job2", payload_len=2 << 20, shape=[2 << 20])),
            ),
            (
                "job2",
                "bad_dtype",
                lambda: raw("dtype", craft(b"abcd", job="job2", dtype="complex64", shape=[1])),
            ),
            (NO_JOB, "bad_magic", lambda: raw("garbled", os.urandom(4096))),
            (NO_JOB, "unknown_job", lambda: stray.send(addr, frame(torch.ones(2), job="nojob"), KEY)),
        ]
        try:
            for i, (job, reason, attack) in enumerate(attacks):
                await good_round(i)
                await attack()
                await until(lambda j=job, r=reason: server.stats[j].frames_refused.get(r) == 1, what=reason)
            await good_round(len(attacks))
            await until(lambda: len(got1) == len(sent1) and len(got2) == len(sent2), what="good frames")
        finally:
            for c in (good, intruder, wrong_key, stray):
                await c.close()
            await server.stop()

        _assert_delivered_and_counted(server, (got1, sent1), (got2, sent2), closed)

    run(loop_name, scenario())
    messages = [r.getMessage() for r in caplog.records if r.name == "fusionnet.wire"]
    for reason in ("sender_not_allowed", "bad_mac", "size_mismatch", "oversized", "bad_dtype", "bad_magic"):
        assert any(reason in m and "127.0.0.1:" in m for m in messages), reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_large_and_concurrent_frames_arrive_whole_and_in_order(loop_name: str) -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(9 << 18, generator=gen)  # 9 MiB: threaded, chunked MAC on both ends
    small = [torch.randn(100 + i, generator=gen) for i in range(40)]

    async def scenario() -> list[TensorFrame]:
        got: list[TensorFrame] = []
        async with DataPathServer(peer_id="S") as server, DataPathClient(peer_id="A") as client:
            server.register_job("job1", KEY, ["A"], got.append)
            addr = await server.start()
            await client.send(f"127.0.0.1:{addr[1]}", frame(big, name="big"), KEY)
            # Concurrent sends share one connection; each frame is written whole under its lock.
            await asyncio.gather(
                *(client.send(addr, frame(t, name=f"c{i}"), KEY) for i, t in enumerate(small))
            )
            for i, t in enumerate(small):  # sequential sends keep their order
                await client.send(addr, frame(t, name=f"s{i}", step=i), KEY)
            await until(lambda: len(got) == 1 + 2 * len(small), what="all frames")
            assert server.stats["job1"].frames_refused == {}
        return got

    got = run(loop_name, scenario())
    assert got[0].name == "big" and torch.equal(got[0].tensor, big)
    by_name = {f.name: f.tensor for f in got}
    assert all(torch.equal(by_name[f"c{i}"], t) for i, t in enumerate(small))
    assert [f.name for f in got[-len(small) :]] == [f"s{i}" for i in range(len(small))]


@pytest.mark.timeout(60)
def test_handler_errors_and_unregistered_jobs_do_not_break_the_connection() -> None:
    async def scenario() -> None:
        got: list[str] = []

        def handler(f: TensorFrame) -> None:
            if f.name == "boom":
                raise RuntimeError("handler bug")
            got.append(f.name)

        async with DataPathServer(peer_id="S") as server, DataPathClient(peer_id="A") as client:
            server.register_job("job1", KEY, {"A"}, handler)
            server.register_job("job2", OTHER_KEY, {"A"}, lambda f: got.append(f.name))
            addr = await server.start()
            await client.send(addr, frame(torch.ones(1), name="boom"), KEY)
            await client.send(addr, frame(torch.ones(1), name="after-boom"), KEY)
            await until(lambda: got == ["after-boom"])
            server.unregister_job("job1")
            await client.send(addr, frame(torch.ones(1), name="late"), KEY)
            await client.send(addr, frame(torch.ones(1), job="job2", name="other-job"), OTHER_KEY)
            await until(lambda: got == ["after-boom", "other-job"])
            assert server.stats["job1"].frames_refused == {"handler_error": 1, "unknown_job": 1}
            assert len(server._sources) == 1  # the same connection carried all of it

    run("asyncio", scenario())


@pytest.mark.timeout(60)
def test_client_reconnects_once_after_the_server_restarts() -> None:
    async def scenario() -> None:
        got: list[str] = []
        async with DataPathClient(peer_id="A") as client:
            first = DataPathServer(peer_id="S")
            first.register_job("job1", KEY, {"A"}, lambda f: got.append(f.name))
            addr = await first.start()
            await client.send(addr, frame(torch.ones(1), name="one"), KEY)
            await until(lambda: got == ["one"])
            await first.stop()
            with pytest.raises(PeerUnreachable, match=str(addr[1])):
                await client.send(addr, frame(torch.ones(1), name="lost"), KEY)
            second = DataPathServer(peer_id="S")
            second.register_job("job1", KEY, {"A"}, lambda f: got.append(f.name))
            await second.start(port=addr[1])
            try:
                await client.send(addr, frame(torch.ones(1), name="two"), KEY)
                await until(lambda: got == ["one", "two"])
            finally:
                await second.stop()

    run("asyncio", scenario())


@pytest.mark.timeout(60)
def test_a_write_that_breaks_is_retried_once_on_a_fresh_connection(monkeypatch) -> None:
    real_write = pool_module.write_prepared
    failures = {"left": 0}

    async def flaky_write(writer, prepared, **kw):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionResetError("simulated reset")
        await real_write(writer, prepared, **kw)

    monkeypatch.setattr(pool_module, "write_prepared", flaky_write)

    async def scenario() -> None:
        got: list[str] = []
        async with DataPathServer(peer_id="S") as server, DataPathClient(peer_id="A") as client:
            server.register_job("job1", KEY, {"A"}, lambda f: got.append(f.name))
            addr = await server.start()
            await client.send(addr, frame(torch.ones(1), name="warm"), KEY)
            failures["left"] = 1
            await client.send(addr, frame(torch.ones(1), name="retried"), KEY)
            await until(lambda: got == ["warm", "retried"])
            failures["left"] = 2  # breaks on the pooled and on the fresh connection
            with pytest.raises(PeerUnreachable, match="broke"):
                await client.send(addr, frame(torch.ones(1), name="gone"), KEY)

    run("asyncio", scenario())


def test_client_checks_before_touching_the_network() -> None:
    async def scenario() -> None:
        async with DataPathClient(peer_id="A") as client:
            with pytest.raises(WireError, match="claims sender"):
                await client.send(("127.0.0.1", 1), frame(torch.ones(1), sender="B"), KEY)
            with pytest.raises(WireError, match="key"):
                await client.send(("127.0.0.1", 1), frame(torch.ones(1)), b"short")
            with pytest.raises(PeerUnreachable):
                await client.send(("127.0.0.1", 1), frame(torch.ones(1)), KEY)  # nothing listens on port 1

    run("asyncio", scenario())


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9)), (("h", 5), ("h", 5))],
)
def test_parse_address(address, expected) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["host", "h:0", "h:70000", ":5", ("h", "5"), ("h", True), 5, "h:x"])
def test_parse_address_refuses_bad_input(address) -> None:
    with pytest.raises(WireError, match="address"):
        parse_address(address)


def test_register_job_checks_its_arguments() -> None:
    server = DataPathServer(peer_id="S")
    with pytest.raises(WireError, match="key"):
        server.register_job("j", b"short", {"A"}, print)
    with pytest.raises(WireError, match="collection"):
        server.register_job("j", KEY, "A", print)
    with pytest.raises(WireError, match="callable"):
        server.register_job("j", KEY, {"A"}, None)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="reserved"):
        server.register_job(NO_JOB, KEY, {"A"}, print)


@pytest.mark.timeout(60)
def test_stop_closes_every_connection_and_task() -> None:
    async def scenario() -> None:
        server = DataPathServer(peer_id="S")
        addr = await server.start()
        conns = [await asyncio.open_connection(*addr) for _ in range(3)]
        await until(lambda: len(server._tasks) == 3, what="connections accepted")
        await server.stop()
        assert not server._tasks and not server._sources
        for reader, writer in conns:
            assert await asyncio.wait_for(reader.read(), 5) == b"FNH1\x00\x01S"  # hello, then closed
            writer.close()

    run("asyncio", scenario())


@pytest.mark.timeout(60)
def test_a_peer_close_the_event_loop_has_not_seen_yet_does_not_swallow_the_next_frame() -> None:
    """The receiver here is a plain socket in a thread: its FIN reaches the kernel while the client's
    loop is blocked, so the loop has not seen it when the next send starts."""
    first = frame_bytes(frame(torch.ones(3), name="first"))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    addr = listener.getsockname()[:2]
    closed = threading.Event()
    got: list[bytes] = []

    def plain_receiver() -> None:
        conn, _ = listener.accept()
        conn.sendall(hello_bytes("S"))
        received = b""
        while len(received) < len(first):
            received += conn.recv(1 << 16)
        conn.close()  # a clean FIN
        closed.set()
        conn2, _ = listener.accept()  # the client saw the FIN and reconnected
        conn2.settimeout(10)
        conn2.sendall(hello_bytes("S"))
        data = b""
        while chunk := conn2.recv(1 << 16):
            data += chunk
            if len(data) >= len(first):
                break
        conn2.close()
        got.append(data)

    thread = threading.Thread(target=plain_receiver, daemon=True)
    thread.start()

    async def scenario() -> None:
        async with DataPathClient(peer_id="A") as client:
            await client.send(addr, frame(torch.ones(3), name="first"), KEY)
            assert closed.wait(10)  # blocks the loop on purpose: no await between the FIN and the send
            await client.send(addr, frame(torch.arange(3.0), name="second"), KEY)
            await asyncio.to_thread(thread.join, 10)
        f = await read_frame(
            await reader_of(got[0]),
            lambda job, sender: KEY,
            receiver="S",
            max_payload=1 << 20,
            bare_ok=lambda job: True,  # over loopback: sent bare
        )
        assert f.name == "second" and torch.equal(f.tensor, torch.arange(3.0))

    try:
        run("asyncio", scenario())
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_with_link_keys_no_member_can_pass_its_frames_off_as_another_members() -> None:
    """Three compnodes A, B, S of one job, each pair with its own key (``mac.link_key``). B holds the
    keys of its links to A and S only: a frame it signs as A (with either) is refused by S as a bad
    MAC, while A's and B's own frames are accepted; a sender with no link to S is refused outright."""
    from fusionnet.wire.mac import link_key

    master = os.urandom(32)
    a_s, b_s, a_b = link_key(master, 0, 2), link_key(master, 1, 2), link_key(master, 0, 1)
    assert len({a_s, b_s, a_b}) == 3 and link_key(master, 2, 0) == a_s

    async def scenario() -> None:
        got: list[TensorFrame] = []
        server = DataPathServer(peer_id="S", max_payload=1 << 20)
        server.register_job("job1", {"A": a_s, "B": b_s}, {"A", "B"}, got.append)
        addr = await server.start()
        a, b = DataPathClient(peer_id="A"), DataPathClient(peer_id="B")
        try:
            await a.send(addr, frame(torch.ones(2), sender="A"), a_s)
            await b.send(addr, frame(torch.full((2,), 2.0), sender="B"), b_s)
            await until(lambda: len(got) == 2, what="the members' own frames")
            for key in (b_s, a_b):  # B forging A's frame with what it holds (its client would refuse)
                await raw_send(addr, frame_bytes(frame(torch.zeros(2), sender="A", step=1), key))
            await until(lambda: server.stats["job1"].frames_refused.get("bad_mac") == 2, what="forgeries")
            await a.send(addr, frame(torch.full((2,), 3.0), sender="A", step=2), a_s)
            await until(lambda: len(got) == 3, what="A's frame after the forgeries")
            assert [(f.sender, f.tensor[0].item()) for f in got] == [("A", 1.0), ("B", 2.0), ("A", 3.0)]
        finally:
            await a.close()
            await b.close()
            await server.stop()

    asyncio.run(scenario())
    with pytest.raises(WireError, match="one link key per allowed sender"):
        DataPathServer(peer_id="S").register_job("job1", {"A": a_s}, {"A", "B"}, print)


@pytest.mark.timeout(60)
def test_pace_caps_the_connection_s_tcp_rate_now_and_after_a_reconnection() -> None:
    """``DataPathClient.pace``: the kernel's SO_MAX_PACING_RATE on the open connection, again on the next
    one (a snapshot connection survives its holder's restart), and lifted with None."""
    from fusionnet.wire.datapath import NO_PACING, SO_MAX_PACING_RATE

    def rate_of(client: DataPathClient, addr: tuple[str, int]) -> int:
        writer = client._pool.writer_of(parse_address(addr))
        assert writer is not None
        raw = writer.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 4)
        return int.from_bytes(raw, sys.byteorder)

    async def scenario() -> None:
        got: list[str] = []
        async with DataPathClient(peer_id="A") as client:
            async with DataPathServer(peer_id="S") as server:
                server.register_job("job1", KEY, ["A"], lambda f: got.append(f.name))
                addr = await server.start()
                await client.send(addr, frame(torch.ones(4), name="before"), KEY)
                client.pace(addr, 3_125_000.7)  # a quarter of 100 Mbit/s
                assert rate_of(client, addr) == 3_125_000
                await client.send(addr, frame(torch.ones(4), name="paced"), KEY)
                await until(lambda: got == ["before", "paced"])
            async with DataPathServer(peer_id="S") as again:
                again.register_job("job1", KEY, ["A"], lambda f: got.append(f.name))
                await again.start(port=addr[1])
                await client.send(addr, frame(torch.ones(4), name="reconnected"), KEY)
                await until(lambda: got[-1] == "reconnected")
                assert rate_of(client, addr) == 3_125_000  # the cap went with the address
                client.pace(addr, None)
                assert rate_of(client, addr) == NO_PACING

    if sys.platform != "linux":
        pytest.skip("SO_MAX_PACING_RATE is Linux's")
    run("asyncio", scenario())
