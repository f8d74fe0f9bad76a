"""Attacks on the data path (issue 12, deliver 4): replay, frames for another receiver, a 1 GiB header
for an unknown job, a flood of stalled connections, and values nobody will take."""

from __future__ import annotations

import asyncio
import os
import resource
from typing import Any

import pytest
import torch

from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.value_frames import check_against_meta
from fusionnet.compnode.valuepack import pack_value
from fusionnet.dag.channel import MAX_STEPS_AHEAD, Mailbox
from fusionnet.errors import JobError, WireError
from fusionnet.wire import NO_JOB, DataPathServer, TensorFrame
from fusionnet.wire.datapath import read_hello
from fusionnet.wire.job_routes import Timeouts
from fusionnet.wire.replay import SEQ_LANES, ReplayWindow, next_seq, set_seq_lane
from tests.wire_support import KEY, craft, frame, frame_bytes, until


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _connect(addr: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*addr)
    await read_hello(reader)
    return reader, writer


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_a_captured_frame_is_accepted_once_and_by_no_other_receiver() -> None:
    async def scenario() -> None:
        got: dict[str, list[TensorFrame]] = {"S": [], "T": []}
        servers = {name: DataPathServer(peer_id=name) for name in got}
        try:
            addrs = {}
            for name, server in servers.items():
                server.register_job("job1", KEY, {"A"}, got[name].append)
                addrs[name] = await server.start()
            captured = frame_bytes(frame(torch.arange(4.0), name="w"), receiver="S")
            for _ in range(5):  # the attack: the same frame five times
                _, writer = await _connect(addrs["S"])
                writer.write(captured)
                await writer.drain()
                writer.close()
            _, writer = await _connect(addrs["T"])  # and to another receiver of the same job
            writer.write(captured)
            await writer.drain()
            writer.close()
            s, t = servers["S"].stats["job1"], servers["T"].stats["job1"]
            await until(lambda: s.refused_total == 4 and t.refused_total == 1, what="refusals")
            assert len(got["S"]) == 1 and s.frames_refused == {"replay": 4}
            assert got["T"] == [] and t.frames_refused == {"wrong_receiver": 1}
            # a fresh frame of the same sender still gets through
            _, writer = await _connect(addrs["S"])
            writer.write(frame_bytes(frame(torch.ones(2), name="next"), receiver="S"))
            await writer.drain()
            await until(lambda: len(got["S"]) == 2, what="fresh frame")
            writer.close()
        finally:
            for server in servers.values():
                await server.stop()

    run(scenario())


def test_replay_window_accepts_out_of_order_once_and_stays_bounded() -> None:
    w = ReplayWindow(span=1000, max_seen=64)
    assert w.accept(500) and w.accept(400) and not w.accept(400) and not w.accept(500)
    assert w.accept(1600) and not w.accept(500)  # more than ``span`` below the top: too old
    for seq in range(2000, 2400):
        assert w.accept(seq)
    assert len(w._seen) <= 64 and not w.accept(2000) and not w.accept(2100)
    a, b = next_seq(), next_seq()
    assert b > a > 0


def test_two_processes_of_one_sender_never_number_a_frame_alike() -> None:
    """A daemon and its sandbox worker send under one peer id: their numbers live in separate lanes."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1, initializer=set_seq_lane, initargs=(1,)) as pool:
        theirs = pool.apply(_numbers, (2000,))
    ours = _numbers(2000)
    assert all(n % SEQ_LANES == 0 for n in ours) and all(n % SEQ_LANES == 1 for n in theirs)
    assert ours == sorted(set(ours)) and theirs == sorted(set(theirs)) and not set(ours) & set(theirs)
    with pytest.raises(ValueError, match="lane"):
        set_seq_lane(SEQ_LANES)


def _numbers(n: int) -> list[int]:
    return [next_seq() for _ in range(n)]


@pytest.mark.timeout(60)
def test_a_gib_header_for_an_unknown_job_closes_the_connection_at_once() -> None:
    async def scenario() -> None:
        server = DataPathServer(peer_id="S")
        server.register_job("job1", KEY, {"A"}, lambda f: None)
        addr = await server.start()
        try:
            reader, writer = await _connect(addr)
            head_only = craft(b"", job="nojob", payload_len=1 << 30, shape=[1 << 30])[:-64]
            writer.write(head_only)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing awaited
            assert server.stats[NO_JOB].frames_refused == {"unknown_job": 1}
            writer.close()
        finally:
            await server.stop()

    run(scenario())


@pytest.mark.timeout(120)
def test_a_flood_of_stalled_connections_is_capped_and_timed_out(capsys) -> None:
    """4000 connections that send nothing (the issue's attack took a compnode to 2.7 GB and 4020 fds)."""
    flood = min(4000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2 - 100)

    async def scenario() -> dict[str, float]:
        server = DataPathServer(peer_id="S", timeouts=Timeouts(handshake=1.0, idle=1.0, progress=1.0))
        server.register_job("job1", KEY, {"A"}, lambda f: None)
        addr = await server.start()
        rss0, fds0 = _rss_bytes(), _fds()
        conns = []
        try:
            for _ in range(flood):
                conns.append(await asyncio.open_connection(*addr))
            # a deadline, not a speed bound: 4000 accepts on a loaded 2-core machine can take a while
            refused_all = flood - server.max_connections
            await until(lambda: server.connections_refused >= refused_all, timeout=60, what="refusals")
            assert len(server._sources) <= server.max_connections
            peak_rss = _rss_bytes() - rss0
            # the stalled ones are cut at the handshake timeout; nothing is left open on the server
            await until(lambda: not server._sources, timeout=20, what="stalled connections closed")
            stats = server.stats[NO_JOB].frames_refused
            assert stats.get("timeout", 0) >= 1
            # a legitimate sender gets in afterwards
            _, writer = await _connect(addr)
            writer.write(frame_bytes(frame(torch.ones(2)), receiver="S"))
            await writer.drain()
            await until(lambda: server.stats["job1"].frames_accepted == 1, what="good frame")
            writer.close()
        finally:
            for _, w in conns:
                w.close()
            await server.stop()
        return {"connections": flood, "peak_rss_mib": peak_rss / 2**20, "fds_before": fds0}

    figures = run(scenario(), 100)
    with capsys.disabled():
        print(f"\nstalled-connection flood: {figures}")
    # Both ends live in this process: the bound covers the attacker's 4000 sockets as well.
    assert figures["peak_rss_mib"] < 64


@pytest.mark.timeout(60)
def test_a_frame_stalled_midway_is_cut_by_the_progress_timeout() -> None:
    async def scenario() -> None:
        server = DataPathServer(peer_id="S", timeouts=Timeouts(handshake=5.0, idle=5.0, progress=0.5))
        server.register_job("job1", KEY, {"A"}, lambda f: None)
        addr = await server.start()
        try:
            reader, writer = await _connect(addr)
            data = frame_bytes(frame(torch.zeros(1 << 16)), receiver="S")
            writer.write(data[: len(data) // 2])  # then nothing more
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert server.stats[NO_JOB].frames_refused == {"timeout": 1}
            writer.close()
        finally:
            await server.stop()

    run(scenario())


def _frame(step: int, name: str, t: torch.Tensor) -> TensorFrame:
    return TensorFrame(job_id="job1", sender="A", kind="act", step=step, microbatch=0, name=name, tensor=t)


def test_values_for_steps_nobody_will_take_are_refused_and_parking_is_bounded() -> None:
    async def scenario() -> None:
        channel = NetChannel(
            job_id="job1",
            peer_id="B",
            subdag_of_peer={"A": 0},
            send_frame=lambda dst, f: asyncio.sleep(0),
            max_pending_bytes=1 << 20,
        )
        channel.mailbox.forget_step(10)  # step 10 done: 10..10 + MAX_STEPS_AHEAD may still come, nothing else
        for step in (3, 9, 11 + MAX_STEPS_AHEAD, 10**6):
            channel.on_frame(_frame(step, "n/0", torch.ones(4)))
        assert channel.refused == 4 and not channel._pending
        channel.on_frame(_frame(11, "n/0", torch.ones(1 << 17)))  # 512 KiB parked
        channel.on_frame(_frame(11, "n/1", torch.ones(1 << 17)))  # another 512 KiB: at the cap
        channel.on_frame(_frame(11, "m/0", torch.ones(4)))  # over it: refused
        assert channel.refused == 5 and channel._pending_bytes == 1 << 20
        channel.mailbox.forget_step(12)  # step 11's unfinished value can never complete: freed
        channel.on_frame(_frame(12, "m/0", torch.ones(4)))
        channel.on_frame(_frame(12 + MAX_STEPS_AHEAD, "m/0", torch.ones(4)))  # the farthest one taken
        assert channel._pending_bytes == 32 and channel.refused == 5
        box = Mailbox()
        box.forget_step(5)
        assert not box.deliver(0, ("act", 2, 0, "x"), 1) and box.unexpected_dropped == 1
        assert box.deliver(0, ("act", 6, 0, "x"), 1)

    with pytest.raises(WireError):  # sanity: the structure check still runs
        NetChannel(job_id="j", peer_id="B", subdag_of_peer={}, send_frame=None)._on_frame(  # type: ignore[arg-type]
            _frame(0, "x", torch.ones(1))
        )
    run(scenario())


def test_a_members_refused_frame_fails_the_value_it_was_for_at_once() -> None:
    """A job member's frame that fails the IR's check can never be delivered: the step awaiting it fails
    with the reason (not the broker's step timeout later); a refused frame of a step nobody takes fails
    nothing."""

    async def scenario() -> None:
        def validate(src: int, key: Any, value: Any) -> None:
            check_against_meta(value, {"shape": [2, 4], "dtype": "float32"}, 2, f"act {key[3]!r}", rows=2)

        channel = NetChannel(
            job_id="job1",
            peer_id="B",
            subdag_of_peer={"A": 0},
            send_frame=None,
            validate=validate,  # type: ignore[arg-type]
        )
        channel.mailbox.forget_step(0)
        waiting = asyncio.ensure_future(channel.recv(0, ("act", 0, 0, "x")))
        await asyncio.sleep(0)
        channel.on_frame(_frame(0, "x", pack_value({"$t": 0}, [torch.ones(3, 4)], [None])))
        with pytest.raises(JobError, match=r"refused a frame from sub-DAG 0: act 'x'.*shape \[3, 4\]"):
            await asyncio.wait_for(waiting, 5)
        channel.on_frame(_frame(10**6, "x", pack_value({"$t": 0}, [torch.ones(3, 4)], [None])))
        assert channel.refused == 2 and not channel.mailbox._slots
        channel.on_frame(_frame(1, "y", pack_value({"$t": 0}, [torch.ones(2, 4)], [None])))  # a good one
        assert torch.equal(await asyncio.wait_for(channel.recv(0, ("act", 1, 0, "y")), 5), torch.ones(2, 4))

    run(scenario())


@pytest.mark.parametrize(
    "shape,rows,ok",
    [
        ([4, 32, 8], 4, True),  # the batch dimension at another micro-batch size
        ([128, 8], 4, True),  # batch x positions, flattened
        ([128, 8], None, True),  # the size unknown (an infer placement): consistent is enough
        ([128, 8], 3, False),  # implies 4 samples where the step has 3
        ([4, 33, 8], 4, False),  # a dimension that does not scale with the batch
        ([3, 128, 8], None, False),  # two dimensions implying different micro-batch sizes
        ([2, 32, 8], None, True),  # exactly as traced
        ([96, 8], None, True),  # 3 samples of 32 positions
        ([100, 8], None, False),  # not whole samples
    ],
)
def test_a_value_may_differ_from_the_ir_only_by_its_micro_batch_size(
    shape: list[int], rows: int | None, ok: bool
) -> None:
    meta = (
        {"shape": [2, 32, 8], "dtype": "float32"}
        if len(shape) == 3
        else {"shape": [64, 8], "dtype": "float32"}
    )
    value = torch.zeros(shape)
    if ok:
        check_against_meta(value, meta, 2, "act x", rows=rows)
    else:
        with pytest.raises(WireError, match="act x: shape"):
            check_against_meta(value, meta, 2, "act x", rows=rows)
