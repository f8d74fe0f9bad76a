"""A data path address that black-holes its connects (audit x1: a wrong announced data address made a
step of 8 micro-batches take 80 s). The connection pool fails frames queued behind a timed-out connect,
and later ones, at once, naming that failure; the daemon's down peers expire, are handed to a new job's
sandbox worker and learned back from it, so each process pays the connect timeout once, not per frame
or per job."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import torch

from fusionnet.compnode.sandbox_client import SandboxedJob
from fusionnet.compnode.sandbox_ipc import IPCChannel, frame_message
from fusionnet.compnode.sandbox_pool import SandboxPool
from fusionnet.compnode.tcp_down import Down, DownPeers
from fusionnet.compnode.worker_sends import DirectSender
from fusionnet.wire import DataPathClient, PeerUnreachable, TensorFrame
from fusionnet.wire.pool import StreamPool
from tests.test_subtask_service import PEERS
from tests.wire_support import KEY, frame


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the connection pool ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_frames_queued_behind_a_timed_out_connect_fail_at_once_until_the_failure_is_old() -> None:
    clock = FakeClock()
    opened: list[Any] = []

    async def black_hole(dest: Any) -> Any:
        opened.append(dest)
        await asyncio.sleep(0)  # the others queue behind this connect meanwhile
        clock.now += 10.0  # what the connect timeout cost
        raise TimeoutError  # ``asyncio.timeout``'s: no message of its own

    async def scenario() -> None:
        pool = StreamPool(black_hole, describe=lambda d: f"host:{d}", down_for=30.0, clock=clock)
        results = await asyncio.gather(
            *(pool.send(1, frame(torch.ones(1), step=k), KEY) for k in range(8)), return_exceptions=True
        )
        assert len(opened) == 1  # one connect paid for all eight frames
        assert all(isinstance(r, PeerUnreachable) for r in results)
        assert str(results[0]) == "cannot open a stream to host:1: TimeoutError"  # never an empty reason
        assert all(str(r).startswith("cannot open a stream to host:1: TimeoutError (") for r in results[1:])
        assert "not tried again for 30 s" in str(results[1])
        clock.now += 29.0
        with pytest.raises(PeerUnreachable, match=r"29\.0 s ago"):
            await pool.send(1, frame(torch.ones(1)), KEY)
        assert len(opened) == 1
        clock.now += 1.0  # remembered long enough: the next frame tries again
        with pytest.raises(PeerUnreachable, match=r"TimeoutError$"):
            await pool.send(1, frame(torch.ones(1)), KEY)
        assert len(opened) == 2

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_refused_connect_is_not_remembered() -> None:
    """Nothing listening answers at once: a peer that restarts is reachable on the next frame."""
    tries: list[Any] = []

    async def refused(dest: Any) -> Any:
        tries.append(dest)
        raise ConnectionRefusedError(111, "Connection refused")

    async def scenario() -> None:
        pool = StreamPool(refused, down_for=30.0)
        for _ in range(2):
            with pytest.raises(PeerUnreachable, match="Connection refused"):
                await pool.send(1, frame(torch.ones(1)), KEY)
        assert len(tries) == 2

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_data_path_client_pays_one_connect_timeout_for_a_black_holed_address(monkeypatch) -> None:
    connects: list[tuple[str, int]] = []

    async def unanswered(host: str, port: int, **kw: Any) -> Any:  # SYNs that vanish
        connects.append((host, port))
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio, "open_connection", unanswered)

    async def scenario() -> None:
        async with DataPathClient(peer_id="A", connect_timeout=0.3) as client:
            sends = (client.send(("192.0.2.1", 40041), frame(torch.ones(1), step=k), KEY) for k in range(8))
            results = await asyncio.gather(*sends, return_exceptions=True)
            assert connects == [("192.0.2.1", 40041)]
            assert all(isinstance(r, PeerUnreachable) for r in results)
            assert str(results[0]) == "cannot open a stream to 192.0.2.1:40041: timed out after 0.3 s"
            with pytest.raises(PeerUnreachable, match=r"timed out after 0\.3 s \(.* s ago"):
                await client.send(("192.0.2.1", 40041), frame(torch.ones(1)), KEY)
            assert len(connects) == 1

    asyncio.run(scenario())


# ---- the daemon's down peers --------------------------------------------------------------------------
def test_down_peers_expire_and_a_fixed_address_is_not_down() -> None:
    clock = FakeClock()
    told: list[Down] = []
    down = DownPeers(retry_after=600.0, clock=clock, on_mark=told.append)
    assert down.mark("p1", "192.0.2.1:40041", "timed out")
    assert not down.mark("p1", "192.0.2.1:40041", "again")  # once: frames queued with it say nothing
    assert told == [Down("p1", "192.0.2.1:40041", "timed out", 600.0)]
    assert down.is_down("p1", "192.0.2.1:40041")
    assert not down.is_down("p1", "10.0.0.5:40041")  # the peer announced a working address since
    clock.now += 599.0
    assert [(d.peer_id, d.seconds_left) for d in down.entries()] == [("p1", pytest.approx(1.0))]
    clock.now += 1.0
    assert not down.is_down("p1", "192.0.2.1:40041") and not down.entries()  # TCP gets its chance again
    learner = DownPeers(clock=clock)
    learner.learn([Down("p2", "h:1", "refused", 5.0)])
    assert learner.is_down("p2", "h:1")
    clock.now += 5.0
    assert not learner.is_down("p2", "h:1")  # a worker's copy ends when its daemon's does


def _request(addresses: list[str | None]) -> Any:
    from tests.test_worker_sends import _request as request

    return request(addresses)


def _frame(step: int) -> TensorFrame:
    return TensorFrame("j1", PEERS[0], "act", step, 0, "relu", torch.ones(4))


@pytest.mark.timeout(60)
def test_a_new_worker_does_not_dial_the_peers_its_daemon_found_down() -> None:
    async def scenario() -> None:
        request = _request([None, "192.0.2.1:40041", None])
        sender = DirectSender(PEERS[0], "j1", [Down(PEERS[1], "192.0.2.1:40041", "timed out", 60.0)])
        sender.use(request)

        async def no_connect(*args: Any, **kw: Any) -> None:
            raise AssertionError("a peer its daemon found down was dialled")

        sender.client.send = no_connect  # type: ignore[method-assign]
        try:
            assert not await sender.send(1, _frame(0))  # straight to the daemon
            assert sender.take_failure(1) is None  # the daemon knows already
        finally:
            await sender.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_workers_failure_is_reported_once_and_its_daemon_learns_from_it() -> None:
    async def scenario() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request([None, dead, None]))
        try:
            assert not await sender.send(1, _frame(0))
            why = sender.take_failure(1)
            assert why is not None and "cannot open a stream to" in why
            assert sender.take_failure(1) is None
            sender.learn(Down(PEERS[2], "h:2", "the daemon's", 30.0))
            assert sender.down.is_down(PEERS[2], "h:2")
        finally:
            await sender.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_down_peers_cross_the_worker_socket_both_ways() -> None:
    """The daemon's side of a worker: a worker spawned now gets the daemon's down peers in its config; a
    failure the worker reports with a value marks the peer down for the daemon (its own TCP client does not
    pay the connect timeout again); one the daemon finds is passed on to the worker."""

    async def scenario() -> None:
        pool = SandboxPool(None, 1.0, None, None)
        pool.tcp_down = DownPeers()
        pool.tcp_down.mark(PEERS[2], "192.0.2.2:1", "timed out")
        carried: list[int] = []

        async def send(dst: int, f: TensorFrame) -> None:
            carried.append(dst)

        configs: list[Any] = []

        class Process:
            pid = None

            def __init__(self, target: Any, args: tuple, **kw: Any) -> None:
                configs.append(args[1])

            def start(self) -> None:
                pass

        pool.context = type("Context", (), {"Process": Process})()  # type: ignore[assignment]
        pool._warming = asyncio.get_running_loop().create_future()
        pool._warming.set_result(None)
        _, channel, handoff = await pool.spawn(PEERS[0], "j1", 0)
        channel.close()
        if handoff is not None:
            handoff.close()
        assert [(d.peer_id, d.address) for d in configs[0].tcp_down] == [(PEERS[2], "192.0.2.2:1")]

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        job = SandboxedJob(pool, PEERS[0], "j1", 0, send=send)
        job.channel = IPCChannel(ours)
        job._addresses = [(PEERS[0], None), (PEERS[1], "192.0.2.1:40041"), (PEERS[2], "192.0.2.2:1")]
        job._reader = asyncio.ensure_future(job._read())
        worker = IPCChannel(theirs)
        try:
            header, blobs = frame_message(_frame(0))
            why = "cannot open a stream to 192.0.2.1:40041: timed out after 10 s"
            await worker.send({"op": "send", "id": 1, "dst": 1, **header, "tcp_failed": why}, blobs)
            reply, _ = await asyncio.wait_for(worker.recv(), 10)
            assert reply["op"] == "sent" and "error" not in reply and carried == [1]
            assert pool.tcp_down.is_down(PEERS[1], "192.0.2.1:40041")

            job.tell_down(Down(PEERS[1], "192.0.2.1:40041", why, 42.0))
            told, _ = await asyncio.wait_for(worker.recv(), 10)
            assert (told["op"], told["peer"], told["address"], told["seconds"]) == (
                "down", PEERS[1], "192.0.2.1:40041", 42.0,
            )  # fmt: skip
            job.tell_down(Down("QmNotOfThisJob", "h:1", why, 42.0))  # not this job's peer: not told
        finally:
            await job.close("done")
            worker.close()

    asyncio.run(scenario())


def test_the_service_shares_its_down_peers_with_its_sandbox_workers() -> None:
    from tests.test_sandbox import service

    s = service(sandbox=True)
    assert s.sandboxes is not None and s.sandboxes.tcp_down is s._tcp_down
    assert s._tcp_down.on_mark is not None  # the running workers are told
