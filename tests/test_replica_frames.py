"""Snapshot chunks over the direct data path (``compnode.replica_frames``): an owner's snapshot reaches
its holder over a real TCP data path and is confirmed by a ``replicate`` call that carries no bytes; a
holder without a data path gets the bytes in the call; frames that are not the holder's to keep are
refused, counted and leave nothing on disk; a confirmation for a chunk that never came fails with the
reason instead of hanging; a chunk that would fill the disk is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from fusionnet.compnode import replica_frames
from fusionnet.compnode.replica_frames import Landings, replica_frame
from fusionnet.compnode.replicas import ReplicaStore, pack_chunks
from fusionnet.compnode.tasks import SubtaskService
from fusionnet.errors import JobError
from fusionnet.messages.compnode_rpc import ReplicateRequest
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.datapath import DataPathClient, DataPathServer
from fusionnet.wire.frames import TensorFrame
from tests.test_subtask_service import BROKER, PEERS, FakeNode, FakePath, figure3_assign_docs, service

pytestmark = pytest.mark.timeout(60)
HOLDERS = [1, 2, 0]  # a ring: sub-DAG 1 (PEERS[1]) keeps sub-DAG 0's snapshots


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return [dict(d, replica_holders=HOLDERS) for d in figure3_assign_docs(3)]


def _context(sender: str, method: str) -> RPCContext:
    return RPCContext(remote_peer=sender, method=method)


def _snapshot(seed: int) -> list[tuple[str, bytearray]]:
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(300, 1000, generator=g) for i in range(3)}  # 3.6 MB in 2 chunks
    optim = {"w0.momentum_buffer": torch.randn(300, 1000, generator=g)}
    return pack_chunks("state", state, limit=2_500_000) + pack_chunks("optim", optim)  # type: ignore[return-value]


async def _replicate(
    docs: list[dict[str, Any]], over_tcp: bool
) -> tuple[SubtaskService, list[dict[str, Any]], list[tuple[str, bytearray]], int | None]:
    """Sub-DAG 0's owner sends one snapshot to its holder (over TCP when the holder announces a data path
    address)."""
    holder = service()
    server = DataPathServer(peer_id=PEERS[1])
    host, port = await server.start("127.0.0.1", 0)
    holder.server = server
    await holder.rpc_assign(docs[1], _context(BROKER, "assign"))

    owner = SubtaskService(FakeNode(PEERS[0]))  # type: ignore[arg-type]
    owner.server, owner.p2p = FakePath(), FakePath()  # type: ignore[assignment]
    owner.bulk = DataPathClient(peer_id=PEERS[0])
    calls: list[dict[str, Any]] = []

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        assert peer == PEERS[1] and method == "replicate" and payload is not None
        calls.append(payload)
        return await holder.rpc_replicate(payload, _context(PEERS[0], method))

    owner.node.call = call  # type: ignore[method-assign]
    doc = dict(docs[0])
    if over_tcp:
        doc["peers"] = [dict(p) for p in doc["peers"]]
        doc["peers"][1]["data_address"] = f"{host}:{port}"
    await owner.rpc_assign(doc, _context(BROKER, "assign"))
    chunks = _snapshot(7)
    replicator = owner._replicator(owner.jobs["j1"])
    assert replicator is not None
    pack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pack.set_result(([(p, bytearray(b)) for p, b in chunks], 0.1))
    replicator.start(4, pack)
    await replicator.wait()
    await owner.bulk.close()
    await server.stop()
    return holder, calls, chunks, replicator.confirmed


def test_a_snapshot_reaches_its_holder_over_a_real_data_path_and_the_call_carries_no_bytes(
    docs: list[dict[str, Any]],
) -> None:
    holder, calls, chunks, confirmed = asyncio.run(_replicate(docs, True))
    assert confirmed == 4
    assert [(c["landed"], c["blob"], c["chunk"], c["chunks"]) for c in calls] == [
        (True, b"", i, len(chunks)) for i in range(len(chunks))
    ]
    assert holder.replicas.held("j1", 1) == {0: [4]}
    for i, (part, blob) in enumerate(chunks):
        got_part, count, data, size = holder.replicas.read("j1", 1, 0, 4, i)
        assert (got_part, count, size) == (part, len(chunks), len(blob)) and data == bytes(blob)
    assert holder._refused("j1") == 0


def test_a_holder_without_a_data_path_gets_the_bytes_in_the_call(docs: list[dict[str, Any]]) -> None:
    holder, calls, chunks, confirmed = asyncio.run(_replicate(docs, False))
    assert confirmed == 4
    assert [(c["landed"], c["blob"]) for c in calls] == [(False, bytes(b)) for _, b in chunks]
    assert holder.replicas.held("j1", 1) == {0: [4]}


def _frame(sender: str, name: str, tensor: torch.Tensor, step: int = 4, chunk: int = 0) -> TensorFrame:
    return TensorFrame("j1", sender, "param", step, chunk, name, tensor)


def test_replica_frames_that_are_not_the_holders_to_keep_are_refused_counted_and_leave_nothing(
    docs: list[dict[str, Any]],
) -> None:
    blob = torch.frombuffer(bytearray(b"0123456789"), dtype=torch.uint8)
    bad = [
        _frame(PEERS[0], "replica/1/0/state", blob),  # no chunk count
        _frame(PEERS[0], "replica/1/state/1", blob),  # no sub-DAG
        _frame(PEERS[0], "replica/1/0/all/1", blob),  # no such part
        _frame(PEERS[2], "replica/1/2/state/1", blob),  # sub-DAG 2's snapshots are not kept here
        _frame(PEERS[2], "replica/1/0/state/1", blob),  # sub-DAG 0's, but from another compnode
        _frame(PEERS[0], "replica/1/1/state/1", blob),  # our own sub-DAG's, from another compnode
        _frame(PEERS[0], "replica/1/7/state/1", blob),  # no such sub-DAG
        _frame(PEERS[0], "replica/0/0/state/1", blob),  # an old attempt
        _frame(PEERS[0], "replica/1/0/state/2", blob, chunk=2),  # chunk 2 of 2
        _frame(PEERS[0], "replica/1/0/state/1", torch.ones(3)),  # not raw bytes
        _frame(PEERS[0], "replica/1/0/state/1", blob.view(2, 5)),
    ]

    async def run() -> tuple[SubtaskService, bool]:
        s = service()
        await s.rpc_assign(docs[1], _context(BROKER, "assign"))
        route = s.server.routes["j1"]  # type: ignore[union-attr]
        for frame in bad:
            await route(frame)
        assert s._refused("j1") == len(bad) and s.replicas.held("j1", 1) == {}
        assert not any((s.replicas.folder / "j1").glob("*"))
        good = replica_frame("j1", PEERS[0], 1, 0, 4, (0, 1, "state"), bytearray(b"0123456789"))
        await route(good)
        confirm = {"job_id": "j1", "attempt": 1, "subdag": 0, "step": 4, "part": "state", "landed": True}
        reply = await s.rpc_replicate(dict(confirm, blob=b""), _context(PEERS[0], "replicate"))
        return s, reply["complete"]

    s, complete = asyncio.run(run())
    assert complete and s.replicas.read("j1", 1, 0, 4, 0)[2] == b"0123456789"


def test_a_confirmation_for_a_chunk_that_never_came_fails_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr(replica_frames, "LANDING_TIMEOUT", 0.2)
    key = ("j1", 1, 0, 4, 0)

    async def run() -> None:
        landings = Landings()
        with pytest.raises(JobError, match=r"did not arrive over the data path within 0\.2 s"):
            await landings.wait(key)
        landings.landed(key, JobError("the replica chunk was not stored: disk full"))
        with pytest.raises(JobError, match="disk full"):
            await landings.wait(key)
        landings.landed(key)  # a resent chunk that was stored: confirmed, before or after the call
        await landings.wait(key)
        waiting = asyncio.ensure_future(landings.wait(key))  # its first step runs before the landing
        asyncio.get_running_loop().call_soon(landings.landed, key)
        await waiting
        landings.forget("j1")
        assert not landings._waits

    asyncio.run(run())


def test_a_chunk_comes_either_in_the_call_or_over_the_data_path() -> None:
    base = {"job_id": "j1", "attempt": 1, "subdag": 0, "step": 4, "part": "state"}
    for bad in (dict(base, blob=b"x", landed=True), dict(base, blob=b"")):
        with pytest.raises(ValueError, match="either in 'blob' or"):
            ReplicateRequest.model_validate(bad)
    ReplicateRequest.model_validate(dict(base, blob=b"x"))
    ReplicateRequest.model_validate(dict(base, blob=b"", landed=True))


def test_a_store_keeps_a_chunk_given_as_a_view_without_copying_it_first(tmp_path) -> None:
    data = bytearray(b"abcdef")
    ReplicaStore(tmp_path).put("j", 1, 0, 2, (0, 1, "state"), memoryview(data))
    assert ReplicaStore(tmp_path).read("j", 1, 0, 2, 0)[2] == b"abcdef"


def test_a_chunk_that_would_fill_the_disk_is_refused_and_nothing_is_written(tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    from fusionnet.compnode import replicas

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(100 << 30, 0, (1 << 30) + 5))
    store = ReplicaStore(tmp_path)
    store.put("j", 1, 0, 2, (0, 1, "state"), b"12345")  # leaves exactly the 1 GiB reserve
    with pytest.raises(JobError, match=r"would leave 1073741823 bytes free .* under the 1073741824"):
        store.put("j", 1, 0, 3, (0, 1, "state"), b"123456")
    assert store.held("j", 1) == {0: [2]} and len(list((tmp_path / "j").iterdir())) == 1
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 20, 0, (1 << 19) + 6))  # a 10 MiB disk
    store.put("j", 1, 0, 4, (0, 1, "state"), b"123456")  # 5 % of it, 512 KiB, stays free
    assert replicas.DISK_RESERVE_SHARE == 0.05 and store.held("j", 1) == {0: [2, 4]}


def _interleaved_assign_docs() -> list[dict[str, Any]]:
    """figure3 cut into 4 sub-DAGs for interleaved-1f1b on 2 compnodes: PEERS[0] holds 0 and 2, PEERS[1]
    (the service's own id) 1 and 3; the ring puts each chunk's replica on the next chunk's compnode."""
    spec = {"schedule": "interleaved-1f1b", "chunks": 2, "compnodes": 2, "microbatches": 2}
    peers = [PEERS[0], PEERS[1], PEERS[0], PEERS[1]]
    return figure3_assign_docs(4, peers, spec, replica_holders=[1, 2, 3, 0])


def test_a_compnode_of_interleaved_chunks_keeps_the_replicas_of_both_chunks_before_its_own() -> None:
    """We hold sub-DAGs 1 and 3; the ring [1, 2, 3, 0] gives us the replicas of 0 and 2, both from
    PEERS[0], by call or over the data path, and nothing of our own chunks or from anybody else."""
    docs = _interleaved_assign_docs()
    blob = torch.frombuffer(bytearray(b"0123456789"), dtype=torch.uint8)

    async def run() -> SubtaskService:
        s = service()
        for doc in (docs[1], docs[3]):
            await s.rpc_assign(doc, _context(BROKER, "assign"))
        assert s.jobs["j1"].indices == [1, 3]
        snap = {"job_id": "j1", "attempt": 1, "step": 2, "part": "state", "blob": b"abc"}
        refusals = [
            (dict(snap, subdag=1), PEERS[0], "keeps no replica of sub-DAG 1"),
            (dict(snap, subdag=3), PEERS[0], "keeps no replica of sub-DAG 3"),
            (dict(snap, subdag=2), PEERS[2], "only the compnode of sub-DAG 2 may replicate it"),
        ]
        for payload, sender, why in refusals:
            with pytest.raises(JobError, match=why):
                await s.rpc_replicate(payload, _context(sender, "replicate"))
        kept = await s.rpc_replicate(dict(snap, subdag=0), _context(PEERS[0], "replicate"))
        assert kept == {"complete": True}
        route = s.server.routes["j1"]  # type: ignore[union-attr]
        await route(_frame(PEERS[0], "replica/1/3/state/1", blob))  # our own chunk's: refused
        await route(_frame(PEERS[0], "replica/1/2/state/1", blob))
        confirm = {"job_id": "j1", "attempt": 1, "subdag": 2, "step": 4, "part": "state", "landed": True}
        reply = await s.rpc_replicate(dict(confirm, blob=b""), _context(PEERS[0], "replicate"))
        assert reply == {"complete": True} and s.replica_refused["j1"] == 1
        return s

    s = asyncio.run(run())
    assert s.replicas.held("j1", 1) == {0: [2], 2: [4]}
    assert s.replicas.read("j1", 1, 2, 4, 0)[2] == b"0123456789"
