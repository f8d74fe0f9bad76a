"""A sandbox worker reads its peers' values itself (``wire.handoff``, ``compnode.worker_receives``): the
daemon's data path hands a worker's connection over to the receiving job's worker, which checks every
frame as the daemon would; the two never both accept one frame (sequence lanes); a connection the
daemon refuses leaves the sending worker's values to its daemon; a garbled hello hurts nobody else."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

from fusionnet.compnode.worker_receives import DirectReceiver
from fusionnet.compnode.worker_sends import DirectSender
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.wire import refusal as R
from fusionnet.wire.datapath import DataPathClient, DataPathServer, read_hello
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import OTHER_LANES, WORKER_HELLO, WORKER_LANE, pass_socket
from fusionnet.wire.header import MAGIC
from fusionnet.wire.replay import SEQ_LANES, set_seq_lane
from tests.test_subtask_service import PEERS, figure3_assign_docs

_DOCS = figure3_assign_docs(3)  # sub-DAG i on PEERS[i], one set of link keys


def _request(i: int, address: str | None = None) -> AssignRequest:
    doc = dict(_DOCS[i])
    doc["peers"] = [{"peer_id": p, "data_address": address if j == 1 else None} for j, p in enumerate(PEERS)]
    return AssignRequest.model_validate(doc)


def _frame(step: int, kind: str = "act") -> TensorFrame:
    return TensorFrame("j1", PEERS[0], kind, step, 0, "relu", torch.arange(2048, dtype=torch.float32) + step)


@pytest.fixture
def worker_lane() -> Iterator[None]:
    """This process numbers its frames as a sandbox worker does, for the test's length."""
    set_seq_lane(WORKER_LANE)
    yield
    set_seq_lane(0)


async def _until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _with_receiving_compnode(
    test: Callable[
        [DataPathServer, DirectReceiver, list[TensorFrame], list[TensorFrame], str], Awaitable[None]
    ],
    decide: Callable[[socket.socket, Any], bool | None] | None = None,
) -> None:
    """PEERS[1]'s daemon (its data path, lanes as a daemon whose worker reads values) and worker
    (``DirectReceiver`` behind a socket pair); ``decide`` overrides the daemon's hand-off."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    by_daemon: list[TensorFrame] = []
    by_worker: list[TensorFrame] = []
    receiver = DirectReceiver(PEERS[1], theirs)
    request = _request(1)
    receiver.use(request, by_worker.append)
    server = DataPathServer(peer_id=PEERS[1])
    keys = request.keys_by_sender()
    server.register_job("j1", keys, keys, by_daemon.append, lanes=OTHER_LANES)

    def hand_off(job_id: str, connection: Any) -> bool | None:
        if decide is not None:
            return decide(ours, connection)
        return pass_socket(ours, connection) if job_id == "j1" else False

    server.handoff = hand_off
    host, port = await server.start()
    try:
        await test(server, receiver, by_daemon, by_worker, f"{host}:{port}")
    finally:
        await server.stop()
        await receiver.close()
        ours.close()


@pytest.mark.timeout(60)
def test_a_workers_connection_is_read_by_the_receiving_worker(worker_lane: None) -> None:
    async def test(
        server: DataPathServer, receiver: DirectReceiver, by_daemon: list, by_worker: list, address: str
    ):
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request(0, address))
        try:
            for step in range(3):
                assert await sender.send(1, _frame(step))
            await _until(lambda: len(by_worker) == 3)
            assert [f.step for f in by_worker] == [0, 1, 2] and not by_daemon
            assert torch.equal(by_worker[2].tensor, _frame(2).tensor)
            assert server.handed_off == 1  # one pooled connection, read by the worker from its start
            assert receiver.take_tally() == {"received": [3 * 2048 * 4, 3]} and receiver.take_tally() == {}
            assert receiver.refused() == 0
        finally:
            await sender.close()

    asyncio.run(_with_receiving_compnode(test))


@pytest.mark.timeout(60)
def test_the_daemon_and_the_worker_never_accept_the_same_lane(worker_lane: None) -> None:
    """A frame numbered in the workers' lane is refused by the daemon (it could be one captured on the
    worker's connection, replayed); one in the daemon's lane is refused on a worker's connection."""

    async def test(
        server: DataPathServer, receiver: DirectReceiver, by_daemon: list, by_worker: list, address: str
    ):
        request = _request(0, address)
        reasons: list[str] = []
        server.receiver.on_refusal = reasons.append  # the compnode's fusionnet_frames_refused_total
        plain = DataPathClient(peer_id=PEERS[0])  # no worker hello: the daemon reads it
        try:
            await plain.send(address, _frame(0), request.key_of_link(1))
            await _until(lambda: server.stats["j1"].refused_total == 1)
            assert server.stats["j1"].frames_refused == {R.REPLAY: 1} and not by_daemon and not by_worker
            assert reasons == [R.REPLAY]
        finally:
            await plain.close()
        set_seq_lane(0)  # now a daemon's numbers, on a worker's connection
        as_worker = DirectSender(PEERS[0], "j1")
        as_worker.use(request)
        try:
            await as_worker.send(1, _frame(1))
            await _until(lambda: receiver.refused() == 1)
            assert not by_worker and not by_daemon
            assert receiver.take_tally() == {"refusals": {R.REPLAY: 1}}  # for the daemon's metrics
        finally:
            await as_worker.close()

    asyncio.run(_with_receiving_compnode(test))


@pytest.mark.timeout(60)
def test_a_probe_or_snapshot_frame_on_a_workers_connection_is_refused(worker_lane: None) -> None:
    async def test(
        server: DataPathServer, receiver: DirectReceiver, by_daemon: list, by_worker: list, address: str
    ):
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request(0, address))
        try:
            assert await sender.send(1, _frame(0, kind="ctrl"))
            assert await sender.send(1, _frame(1))  # the connection goes on
            await _until(lambda: len(by_worker) == 1 and receiver.refused() == 1)
            assert by_worker[0].step == 1 and not by_daemon
        finally:
            await sender.close()

    asyncio.run(_with_receiving_compnode(test))


@pytest.mark.timeout(60)
def test_a_refused_hand_off_leaves_the_values_to_the_daemon_and_none_reads_here(worker_lane: None) -> None:
    async def test(
        server: DataPathServer, receiver: DirectReceiver, by_daemon: list, by_worker: list, address: str
    ):
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request(0, address))
        try:
            assert not await sender.send(1, _frame(0))  # refused: the caller (its daemon) carries it
            assert not await sender.send(1, _frame(1))  # and every later value to that peer
            assert not by_worker and not by_daemon and sender.take_tally() is None
        finally:
            await sender.close()

    asyncio.run(_with_receiving_compnode(test, decide=lambda channel, connection: False))


@pytest.mark.timeout(60)
def test_without_a_reading_worker_the_daemon_reads_a_workers_connection(worker_lane: None) -> None:
    """``--sandbox off`` (or ``--worker-receives daemon``): the hand-off answers None, the daemon says go
    and reads the frames itself; its route then takes every lane."""

    async def scenario() -> None:
        got: list[TensorFrame] = []
        server = DataPathServer(peer_id=PEERS[1])
        keys = _request(1).keys_by_sender()
        server.register_job("j1", keys, keys, got.append)
        server.handoff = lambda job_id, connection: None
        host, port = await server.start()
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request(0, f"{host}:{port}"))
        try:
            assert await sender.send(1, _frame(0)) and await sender.send(1, _frame(1))
            await _until(lambda: len(got) == 2)
            assert server.handed_off == 0 and [f.step for f in got] == [0, 1]
        finally:
            await sender.close()
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_garbled_worker_hello_is_refused_and_others_are_served() -> None:
    async def scenario() -> None:
        got: list[TensorFrame] = []
        server = DataPathServer(peer_id=PEERS[1])
        request = _request(0)
        server.register_job("j1", request.key_of_link(1), {PEERS[0]}, got.append)
        server.handoff = lambda job_id, connection: pytest.fail("a garbled hello reached the hand-off")
        host, port = await server.start()
        bad = [WORKER_HELLO + (0).to_bytes(2, "big"), WORKER_HELLO + (1).to_bytes(2, "big") + b"\xff"]
        for hello in bad:
            reader, writer = await asyncio.open_connection(host, port)
            assert await read_hello(reader) == PEERS[1]
            writer.write(hello)
            assert await reader.read() == b""  # closed, no go
            writer.close()
        assert server.stats["<no job>"].frames_refused == {R.MALFORMED: 2}
        client = DataPathClient(peer_id=PEERS[0])
        try:
            await client.send(f"{host}:{port}", _frame(0), request.key_of_link(1))
            await _until(lambda: len(got) == 1)
        finally:
            await client.close()
            await server.stop()

    asyncio.run(scenario())


def test_lanes_partition_the_sequence_numbers() -> None:
    assert WORKER_LANE not in OTHER_LANES and OTHER_LANES | {WORKER_LANE} == set(range(SEQ_LANES))
    assert WORKER_HELLO != MAGIC  # a connection's first 4 bytes tell a worker's hello from a frame


def test_worker_receives_daemon_keeps_the_relay() -> None:
    from fusionnet.compnode.daemon import CompnodeConfig
    from fusionnet.compnode.sandbox_pool import SandboxPool

    assert SandboxPool.of(CompnodeConfig(), None).direct_receives
    assert not SandboxPool.of(CompnodeConfig(worker_receives="daemon"), None).direct_receives
    with pytest.raises(ValueError, match="--worker-receives must be 'direct' or 'daemon'"):
        CompnodeConfig(worker_receives="p2p")
