"""A deployment's batches straight from the broker to a compnode's sandbox worker over the data path
(``messages.serve_frames``, ``broker.serve_links``, ``compnode.worker_serves``): the frames' round trip
and refusals (pure), then a link against a real data path server whose hand-off gives the connection to a
worker's ``DirectReceiver``: answers come back on it, an error raises the class the RPC would, a
``serve`` frame from a compnode of the job (not the broker) is refused, a closed connection is opened
again for the next batch, and a link that cannot connect leaves the batch to the RPC."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import torch

from fusionnet.broker.serve_links import GIVE_UP_AFTER, LinkLost, ServeLink, ServeLinks
from fusionnet.compnode.worker_receives import DirectReceiver
from fusionnet.compnode.worker_serves import WorkerServes
from fusionnet.errors import ComputeError, ExecutionError, WireError
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.messages.serve_frames import SERVE, answer_frame, answer_of, request_frame, request_of
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.wire.datapath import DataPathClient, DataPathServer
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import OTHER_LANES, WORKER_LANE, pass_socket
from fusionnet.wire.replay import set_seq_lane
from tests.test_subtask_service import BROKER, PEERS, figure3_assign_docs

pytestmark = pytest.mark.timeout(60)
SERVE_KEY = b"k" * 32
_DOCS = figure3_assign_docs(3)


def _request(step: int) -> ServeStepRequest:
    return ServeStepRequest(job_id="j1", step=step, sizes=[2], data=b"\x01\x02", keep=[True, False])


def test_serve_frames_round_trip_and_refuse_what_is_not_theirs() -> None:
    request = _request(3)
    frame = request_frame(BROKER, request)
    assert (frame.kind, frame.name, frame.step, frame.sender) == ("ctrl", SERVE, 3, BROKER)
    assert request_of(frame) == request
    reply = ServeStepReply(step=3, fp_seconds=0.25, outputs=b"out", ids=None)
    assert answer_of(answer_frame("j1", PEERS[1], 3, reply)) == reply
    with pytest.raises(ComputeError, match="index out of range"):  # the class the RPC would raise
        answer_of(answer_frame("j1", PEERS[1], 3, None, ComputeError("index out of range")))
    with pytest.raises(ExecutionError, match="ValueError: boom"):  # any other: named, never evaluated
        answer_of(answer_frame("j1", PEERS[1], 3, None, ValueError("boom")))
    garbage = TensorFrame("j1", BROKER, "ctrl", 3, 0, SERVE, torch.tensor([0xC1], dtype=torch.uint8))
    with pytest.raises(WireError, match="not msgpack"):
        request_of(garbage)
    other_step = TensorFrame("j1", BROKER, "ctrl", 4, 0, SERVE, frame.tensor)
    with pytest.raises(WireError, match="names job j1 step 3"):
        request_of(other_step)
    floats = TensorFrame("j1", BROKER, "ctrl", 3, 0, SERVE, torch.zeros(2))
    with pytest.raises(WireError, match="flat uint8"):
        request_of(floats)


class _Worker:
    """PEERS[1]'s data path, handing the job's connections to a worker's ``DirectReceiver`` that serves
    the broker's batches with ``serve`` (counted in ``served``)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.served: list[int] = []
        self.told: list[dict[str, Any]] = []

    async def serve(self, request: ServeStepRequest) -> ServeStepReply:
        self.served.append(request.step)
        if request.step == self.fail_on:
            raise ComputeError("the model raised on these rows")
        return ServeStepReply(step=request.step, fp_seconds=0.01, outputs=request.data * 2)

    async def tell(self, message: dict[str, Any]) -> None:
        self.told.append(message)

    async def __aenter__(self) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self._ours = ours
        doc = dict(_DOCS[1]) | {"serve_key": SERVE_KEY}
        request = AssignRequest.model_validate(doc)
        self.serves = WorkerServes(PEERS[1], BROKER, "j1", SERVE_KEY, "auto", self.serve, self.tell)
        self.receiver = DirectReceiver(PEERS[1], theirs)
        self.values: list[TensorFrame] = []
        self.receiver.use(request, self.values.append, BROKER, self.serves.on_frame)
        self.server = DataPathServer(peer_id=PEERS[1])
        keys = request.keys_by_sender()
        self.server.register_job("j1", keys, keys, lambda frame: None, lanes=OTHER_LANES)
        self.server.handoff = lambda job_id, connection: pass_socket(ours, connection)
        host, port = await self.server.start()
        self.address = f"{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()
        await self.serves.close()
        await self.receiver.close()
        self._ours.close()


async def _rpc_never() -> ServeStepReply:
    raise AssertionError("the batch went to the RPC")


def test_a_link_serves_batches_on_the_workers_connection() -> None:
    async def scenario() -> None:
        async with _Worker(fail_on=2) as worker:
            links = ServeLinks()
            link = ServeLink(BROKER, "j1", PEERS[1], worker.address, SERVE_KEY, "auto")
            await links.replace({0: link})
            try:
                replies = await asyncio.gather(*(links.call(0, _request(s), _rpc_never) for s in (0, 1)))
                assert [(r.step, r.outputs) for r in replies] == [(0, b"\x01\x02" * 2), (1, b"\x01\x02" * 2)]
                with pytest.raises(ComputeError, match="raised on these rows"):
                    await links.call(0, _request(2), _rpc_never)
                assert links.calls == {"direct": 2, "rpc": 0} and worker.served == [0, 1, 2]
                # the worker tells its daemon what it served, within a second
                deadline = asyncio.get_running_loop().time() + 5
                while (sum(len(t["fp"]) for t in worker.told), sum(t["failed"] for t in worker.told)) != (
                    2,
                    1,
                ):
                    assert asyncio.get_running_loop().time() < deadline, worker.told
                    await asyncio.sleep(0.05)
                # the worker's end closes (its idle timeout, say): not given up, the next batch reconnects
                for source in list(worker.receiver._sources):
                    source.close()
                while link._source is not None:
                    await asyncio.sleep(0.01)
                assert link.lost is None and link._losses == 1 < GIVE_UP_AFTER
                reply = await links.call(0, _request(3), _rpc_never)
                assert reply.step == 3 and link._losses == 0 and worker.server.handed_off == 2
            finally:
                await links.replace({})

    asyncio.run(scenario())


def test_a_serve_frame_from_a_compnode_of_the_job_is_refused() -> None:
    """PEERS[0] holds a link key to PEERS[1], not the broker's: its ``serve`` frame (even in the workers'
    lane, on a worker's connection) is refused and nothing runs."""

    async def scenario() -> None:
        async with _Worker() as worker:
            set_seq_lane(WORKER_LANE)
            client = DataPathClient(peer_id=PEERS[0], job_hello="j1")
            try:
                forged = request_frame(PEERS[0], _request(0))
                await client.send(
                    worker.address, forged, AssignRequest.model_validate(_DOCS[0]).key_of_link(1)
                )
                deadline = asyncio.get_running_loop().time() + 5
                while (
                    worker.receiver.refused()
                    + sum(
                        s.frames_refused.get("handler_error", 0)
                        for s in worker.receiver.receiver.stats.values()
                    )
                    == 0
                ):
                    assert asyncio.get_running_loop().time() < deadline, "not refused"
                    await asyncio.sleep(0.02)
                assert worker.served == []
            finally:
                set_seq_lane(0)
                await client.close()

    asyncio.run(scenario())


def test_a_link_that_cannot_connect_leaves_the_batch_to_the_rpc() -> None:
    async def scenario() -> None:
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()  # nothing listens there
        links = ServeLinks()
        await links.replace({0: ServeLink(BROKER, "j1", PEERS[1], f"127.0.0.1:{port}", SERVE_KEY, "auto")})
        rpc_reply = ServeStepReply(step=0)

        async def rpc() -> ServeStepReply:
            return rpc_reply

        assert await links.call(0, _request(0), rpc) is rpc_reply
        assert links.links[0].lost is not None and links.calls == {"direct": 0, "rpc": 1}
        with pytest.raises(LinkLost):
            await links.links[0].call(_request(1))
        await links.replace({})

    asyncio.run(scenario())


def test_a_worker_reached_by_a_name_answers_in_the_encryption_both_ends_agree_on() -> None:
    """Announced by a name that resolves to loopback (``--data-host $(hostname)``): the worker sees the
    broker at 127.0.0.1 and answers as on loopback; the broker judges by the address it reached, not the
    name, so it takes that answer (it used to refuse it and wait for the batch until its timeout)."""
    name = socket.gethostname()
    try:
        if not socket.gethostbyname(name).startswith("127."):
            pytest.skip(f"{name} does not resolve to loopback here")
    except OSError:
        pytest.skip(f"{name} does not resolve here")

    async def scenario() -> None:
        async with _Worker() as worker:
            port = worker.address.rpartition(":")[2]
            links = ServeLinks()
            await links.replace({0: ServeLink(BROKER, "j1", PEERS[1], f"{name}:{port}", SERVE_KEY, "auto")})
            try:
                reply = await asyncio.wait_for(links.call(0, _request(0), _rpc_never), 10)
                assert reply.step == 0 and links.calls == {"direct": 1, "rpc": 0}
            finally:
                await links.replace({})

    asyncio.run(scenario())


def test_a_connection_that_ends_right_after_its_go_leaves_the_batch_to_the_rpc() -> None:
    """A worker stopping right after its go: each batch goes to the RPC (it used to fail with an
    ``AssertionError``), and after ``GIVE_UP_AFTER`` such connections the link is given up."""
    from fusionnet.wire.datapath import hello_bytes
    from fusionnet.wire.handoff import GO, worker_hello

    async def scenario() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(hello_bytes(PEERS[1]))
            await reader.readexactly(len(worker_hello("j1")))
            writer.write(GO)
            writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        links = ServeLinks()
        await links.replace({0: ServeLink(BROKER, "j1", PEERS[1], f"127.0.0.1:{port}", SERVE_KEY, "auto")})

        async def rpc() -> ServeStepReply:
            return ServeStepReply(step=0)

        try:
            for step in range(GIVE_UP_AFTER + 2):
                await links.call(0, _request(step), rpc)
            assert links.calls == {"direct": 0, "rpc": GIVE_UP_AFTER + 2}
            assert links.links[0].lost is not None
        finally:
            await links.replace({})
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_link_closed_while_it_opens_leaves_its_batch_to_the_rpc() -> None:
    """A new placement closes the old links; a batch waiting for its link to open goes to the RPC (it
    used to be cancelled, and its requests failed as if the deployment were gone)."""

    async def scenario() -> None:
        opened = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            opened.set()
            await asyncio.sleep(30)  # never says hello: the link stays opening

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        links = ServeLinks()
        await links.replace({0: ServeLink(BROKER, "j1", PEERS[1], f"127.0.0.1:{port}", SERVE_KEY, "auto")})

        async def rpc() -> ServeStepReply:
            return ServeStepReply(step=0, outputs=b"rpc")

        try:
            call = asyncio.ensure_future(links.call(0, _request(0), rpc))
            await asyncio.wait_for(opened.wait(), 10)
            await links.replace({})  # the placement ends while the link opens
            reply = await asyncio.wait_for(call, 10)
            assert reply.outputs == b"rpc" and links.calls == {"direct": 0, "rpc": 1}
        finally:
            server.close()

    asyncio.run(scenario())
