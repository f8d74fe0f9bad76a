"""A sandbox worker's own sends (``compnode.worker_sends``): values go straight to the receiving
compnode's data path under the link's key; a peer without an address or one TCP fails to is left to
the daemon (the caller), and stays so; what went is tallied for the daemon's metrics."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from fusionnet.compnode.worker_sends import DirectSender
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.wire.datapath import DataPathServer
from fusionnet.wire.frames import TensorFrame
from tests.test_subtask_service import PEERS, figure3_assign_docs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(addresses: list[str | None]) -> AssignRequest:
    doc = dict(_DOC)  # sub-DAG 0 on PEERS[0]; 1 and 2 on the others
    doc["peers"] = [{"peer_id": p, "data_address": a} for p, a in zip(PEERS, addresses)]
    return AssignRequest.model_validate(doc)


_DOC = figure3_assign_docs(3)[0]  # one set of link keys for every request of a test


def _frame(step: int) -> TensorFrame:
    t = torch.arange(4096, dtype=torch.float32) + step
    return TensorFrame("j1", PEERS[0], "act", step, 0, "relu", t)


@pytest.mark.timeout(60)
def test_values_go_straight_to_the_peer_and_a_failed_peer_is_left_to_the_daemon() -> None:
    async def scenario() -> None:
        got: list[TensorFrame] = []
        server = DataPathServer(peer_id=PEERS[1])
        request = _request([None, None, None])
        server.register_job("j1", request.key_of_link(1), {PEERS[0]}, got.append)
        host, port = await server.start()
        dead = f"127.0.0.1:{_free_port()}"  # nobody listens there
        request = _request([None, f"{host}:{port}", dead])
        sender = DirectSender(PEERS[0], "j1")
        try:
            assert not await sender.send(1, _frame(0))  # no assignment yet: the daemon carries it
            sender.use(request)
            assert await sender.send(1, _frame(0)) and await sender.send(1, _frame(1))
            deadline = asyncio.get_running_loop().time() + 10
            while len(got) < 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert [f.step for f in got] == [0, 1]
            assert torch.equal(got[1].tensor, _frame(1).tensor)
            assert sender.take_tally() == [2 * 4096 * 4, 2] and sender.take_tally() is None
            assert not await sender.send(2, _frame(0))  # TCP refused: the daemon's turn, from now on
            assert not await sender.send(2, _frame(1))
            assert not await sender.send(0, _frame(0))  # our own sub-DAG has no address to send to
            assert not await sender.send(7, _frame(0))  # no such sub-DAG
            assert sender.take_tally() is None
        finally:
            await sender.close()
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_frame_under_a_wrong_link_key_is_refused_by_the_receiver() -> None:
    """The worker signs with its own link's key: a receiver expecting another key refuses the frame."""

    async def scenario() -> None:
        got: list[TensorFrame] = []
        server = DataPathServer(peer_id=PEERS[1])
        server.register_job("j1", b"k" * 32, {PEERS[0]}, got.append)
        host, port = await server.start()
        sender = DirectSender(PEERS[0], "j1")
        sender.use(_request([None, f"{host}:{port}", None]))
        try:
            await sender.send(1, _frame(0))
            deadline = asyncio.get_running_loop().time() + 10
            while not server.stats["j1"].refused_total and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert not got and server.stats["j1"].refused_total
        finally:
            await sender.close()
            await server.stop()

    asyncio.run(scenario())


def test_worker_sends_daemon_makes_the_workers_hand_every_value_to_the_daemon() -> None:
    from fusionnet.compnode.daemon import CompnodeConfig
    from fusionnet.compnode.sandbox_pool import SandboxPool

    assert SandboxPool.of(CompnodeConfig(), None).direct_sends
    assert not SandboxPool.of(CompnodeConfig(worker_sends="daemon"), None).direct_sends
    with pytest.raises(ValueError, match="--worker-sends must be 'direct' or 'daemon'"):
        CompnodeConfig(worker_sends="p2p")
