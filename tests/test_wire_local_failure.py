"""A frame lost to this compnode's own failure (out of memory while reading it) fails its job's receives.

The defect: a sandbox worker at its ``--sandbox-memory-gb`` budget could not allocate a gradient frame's
payload; ``FrameReceiver.serve`` took torch's "can't allocate memory" for the peer's malformed bytes,
dropped the frame and closed the connection. The sender reconnected but never sent that frame again,
and the step waited for its value until the submitter's timeout, with no error and no failover. Now the
receiver tells ``on_local_failure`` and the job's ``NetChannel`` fails every receive with the reason.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
import torch

import fusionnet.wire.frame_reader as frame_reader
from fusionnet.compnode import netchannel as netchannel_module
from fusionnet.compnode.netchannel import NetChannel
from fusionnet.dag.channel import MessageKey
from fusionnet.errors import ExecutionError, JobError
from fusionnet.wire import refusal as R
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.job_routes import NO_JOB, is_local_failure
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.sources import as_source
from tests.wire_support import KEY, RECEIVER, frame, frame_bytes, reader_of

pytestmark = pytest.mark.timeout(30)

# What torch's CPU allocator raised in the worker of the reported job (RLIMIT_DATA reached).
TORCH_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1048704 bytes. Error code 12 (Cannot allocate memory)"
)
KEY_GRAD: MessageKey = ("grad", 0, 0, "out")
Lost = tuple[str | None, str | None, BaseException]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(TORCH_OOM),
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
        RuntimeError("can't start new thread"),
        OSError(errno.ENOMEM, "Cannot allocate memory"),
    ],
)
def test_allocation_failures_are_local(error: BaseException) -> None:
    assert is_local_failure(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("shape '[3]' is invalid for input of size 4"),
        ValueError("cannot allocate"),  # not an error an allocator raises
        RuntimeError("the storage was allocated by another tensor"),  # names no failed allocation
        OSError(errno.ECONNRESET, "Connection reset by peer"),
        JobError("malformed value structure"),
    ],
)
def test_other_errors_are_not_local(error: BaseException) -> None:
    assert not is_local_failure(error)


def _receiver(on_frame: Any = None) -> tuple[FrameReceiver, list[Lost], list[TensorFrame]]:
    got: list[TensorFrame] = []
    receiver = FrameReceiver(peer_id=RECEIVER, max_payload=1 << 24)
    receiver.register_job("job1", KEY, {"A"}, on_frame or got.append)
    lost: list[Lost] = []
    receiver.on_local_failure = lambda job, sender, e: lost.append((job, sender, e))
    return receiver, lost, got


def _serve(receiver: FrameReceiver, data: bytes, peer: str) -> None:
    """``receiver.serve`` over one connection that carries ``data``, then ends."""

    async def go() -> None:
        await receiver.serve(as_source(await reader_of(data)), peer)

    asyncio.run(go())


def _failing_allocation(monkeypatch: pytest.MonkeyPatch, error: BaseException, after: int = 0) -> None:
    """``read_frame``'s payload allocation raises ``error`` from its ``after``-th call on."""
    real = frame_reader.allocate_tensor
    calls = [0]

    def allocate(h: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise error
        return real(h)

    monkeypatch.setattr(frame_reader, "allocate_tensor", allocate)


def test_an_allocation_failure_is_reported_for_the_frames_job_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver, lost, got = _receiver()
    _failing_allocation(monkeypatch, RuntimeError(TORCH_OOM), after=1)
    data = frame_bytes(frame(torch.ones(4), name="a"), seq=1) + frame_bytes(
        frame(torch.ones(4), name="b"), seq=2
    )
    data += frame_bytes(frame(torch.ones(4), name="c"), seq=3)
    _serve(receiver, data, "127.0.0.1:50702")
    assert [f.name for f in got] == ["a"]  # "b" was lost and the connection closed: "c" is not read
    assert [(job, sender) for job, sender, _ in lost] == [("job1", "A")]
    assert "can't allocate memory" in str(lost[0][2])
    # The sender did nothing wrong: no refusal charged to anyone.
    assert all(not s.frames_refused for s in receiver.stats.values())
    assert receiver.frames_lost == 1


def test_a_failure_before_the_header_is_authentic_goes_to_the_connections_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver, lost, got = _receiver()
    real, calls = frame_reader.parse_header, [0]

    def parse(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            raise MemoryError()
        return real(*args)

    monkeypatch.setattr(frame_reader, "parse_header", parse)
    data = frame_bytes(frame(torch.ones(4), name="a"), seq=1) + frame_bytes(
        frame(torch.ones(4), name="b"), seq=2
    )
    _serve(receiver, data, "peer")
    assert [f.name for f in got] == ["a"]
    assert [(job, sender) for job, sender, _ in lost] == [("job1", "A")]  # whose frames it carried

    # A connection that delivered nothing yet: job unknown, the owner decides.
    receiver, lost, _ = _receiver()
    calls[0] = 1
    _serve(receiver, data, "peer")
    assert [(job, sender) for job, sender, _ in lost] == [(None, None)]


def test_a_frame_of_a_job_that_ended_meanwhile_fails_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, lost, _ = _receiver()

    def allocate(h: Any) -> Any:
        receiver.unregister_job("job1")  # released while its frame arrived
        raise MemoryError()

    monkeypatch.setattr(frame_reader, "allocate_tensor", allocate)
    _serve(receiver, frame_bytes(frame(torch.ones(4))), "p")
    assert lost == [] and receiver.frames_lost == 1


def test_other_decoder_errors_are_still_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, lost, _ = _receiver()
    _failing_allocation(monkeypatch, RuntimeError("a decoder choked on the peer's bytes"))
    _serve(receiver, frame_bytes(frame(torch.ones(4))), "p")
    assert lost == []
    assert receiver.stats[NO_JOB].frames_refused == {R.MALFORMED: 1}


def test_a_handler_out_of_memory_loses_the_value_and_keeps_the_connection() -> None:
    names: list[str] = []

    def on_frame(f: TensorFrame) -> None:
        if f.name == "big":
            raise MemoryError()
        names.append(f.name)

    receiver, lost, _ = _receiver(on_frame)
    data = frame_bytes(frame(torch.ones(4), name="big"), seq=1) + frame_bytes(
        frame(torch.ones(4), name="next"), seq=2
    )
    _serve(receiver, data, "p")
    assert names == ["next"]  # the frame was read whole: the stream is still at a frame boundary
    assert [(job, sender) for job, sender, _ in lost] == [("job1", "A")]
    assert R.HANDLER_ERROR not in receiver.stats["job1"].frames_refused


async def _value_frame(value: torch.Tensor, key: MessageKey) -> TensorFrame:
    """The frame sub-DAG 0 (peer "A") sends sub-DAG 1 for ``value``."""
    sent: list[TensorFrame] = []

    async def capture(dst: int, f: TensorFrame) -> None:
        sent.append(f)

    sender = NetChannel(job_id="job1", peer_id="A", subdag_of_peer={}, send_frame=capture)
    await sender.send(1, key, value)
    assert len(sent) == 1
    return sent[0]


def _channel() -> NetChannel:
    async def no_send(dst: int, f: TensorFrame) -> None:
        raise AssertionError("the receiving channel sends nothing here")

    return NetChannel(job_id="job1", peer_id=RECEIVER, subdag_of_peer={"A": 0}, send_frame=no_send)


def test_the_step_waiting_for_a_frame_lost_to_memory_fails_promptly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported hang, at unit level: the worker's wait for sub-DAG 0's gradient ends with an error
    naming the memory failure instead of lasting until the submitter's timeout."""

    async def scenario() -> None:
        channel = _channel()
        receiver = FrameReceiver(peer_id=RECEIVER, max_payload=1 << 24)
        receiver.register_job("job1", KEY, {"A"}, channel.on_frame)
        # The hook a compnode (or its sandbox worker) sets: the job's channels fail their receives.
        receiver.on_local_failure = lambda job, sender, e: channel.fail_receives(sender, e)
        data = frame_bytes(await _value_frame(torch.randn(64, 64), KEY_GRAD))
        waiting = asyncio.ensure_future(channel.recv(0, KEY_GRAD))
        _failing_allocation(monkeypatch, RuntimeError(TORCH_OOM))
        await receiver.serve(as_source(await reader_of(data, eof=False)), "127.0.0.1:50702")
        with pytest.raises(
            ExecutionError, match="ran out of memory while receiving a value from A \\(sub-DAG 0\\)"
        ):
            await asyncio.wait_for(waiting, 5)
        # A value asked for later (the step's next receive) fails at once too: it can never come either.
        with pytest.raises(ExecutionError, match="can't allocate memory"):
            await asyncio.wait_for(channel.recv(0, ("grad", 0, 1, "out")), 5)

    asyncio.run(scenario())


def test_a_decoder_out_of_memory_in_the_channel_fails_its_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        channel = _channel()
        f = await _value_frame(torch.randn(8), KEY_GRAD)
        waiting = asyncio.ensure_future(channel.recv(0, KEY_GRAD))

        def unpack(*args: Any) -> Any:
            raise RuntimeError(TORCH_OOM)

        monkeypatch.setattr(netchannel_module, "unpack_value", unpack)
        channel.on_frame(f)
        with pytest.raises(ExecutionError, match="compnode S ran out of memory"):
            await asyncio.wait_for(waiting, 5)
        assert channel.refused == 0  # not the sender's fault

    asyncio.run(scenario())


def test_a_released_jobs_reason_stands() -> None:
    async def scenario() -> None:
        channel = _channel()
        channel.mailbox.fail_all(JobError("job job1 was released: cancelled"))
        channel.fail_receives("A", MemoryError())
        with pytest.raises(JobError, match="released"):
            await asyncio.wait_for(channel.recv(0, KEY_GRAD), 5)

    asyncio.run(scenario())


def test_the_error_names_the_senders_sub_dags_of_an_interleaved_job() -> None:
    async def scenario() -> None:
        async def no_send(dst: int, f: TensorFrame) -> None:
            raise AssertionError("nothing is sent here")

        peers = ["A", RECEIVER, "A", RECEIVER]  # interleaved: each compnode holds two sub-DAGs
        channel = NetChannel(
            job_id="job1", peer_id=RECEIVER, subdag_of_peer={}, send_frame=no_send, routes=(1, peers)
        )
        channel.fail_receives("A", RuntimeError(TORCH_OOM))
        with pytest.raises(ExecutionError, match=r"from A \(sub-DAG 0, 2\): RuntimeError: .*can't allocate"):
            await asyncio.wait_for(channel.recv(2, KEY_GRAD), 5)

    asyncio.run(scenario())
