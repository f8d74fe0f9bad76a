"""What a job member's (or a keyless peer's) crafted bytes could once make a decoder raise, past the
refusals: each is now a refusal that says what, the value it was for fails at once, and nothing stops
(a sandbox worker, a connection loop). Also a keyless peer cannot hold a connection for the idle
timeout, and ``expand``'s -1 sizes count in the element cap."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from typing import Any

import msgpack
import pytest
import torch

from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.sandbox_ipc import IPCError, frame_of
from fusionnet.compnode.value_frames import split_route
from fusionnet.compnode.valuepack import MAGIC, pack_value, unpack_value
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import ExecutionError, JobError, WireError
from fusionnet.wire.compression import decompress
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import MAGIC as FRAME_MAGIC
from fusionnet.wire.header import VERSION, is_shape
from fusionnet.wire.job_routes import Timeouts
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.sources import StreamReaderSource

pytestmark = pytest.mark.timeout(120)
HUGE_EMPTY = [[0, 2**39, 2**39], [2**39, 2**39, 0], [0] + [2**39 - 1] * 5]


def _packed(shape: list[int]) -> torch.Tensor:
    head = msgpack.packb({"tree": {"$t": 0}, "parts": [["float32", shape, 0]], "codecs": [None]})
    raw = MAGIC + struct.pack(">I", len(head)) + head
    return torch.frombuffer(bytearray(raw + b"\0" * (-len(raw) % 64)), dtype=torch.uint8)


@pytest.mark.parametrize("shape", HUGE_EMPTY)
def test_an_empty_tensor_with_huge_sizes_is_a_bad_shape_not_a_torch_error(shape: list[int]) -> None:
    """No bytes, so the length checks pass; torch cannot lay it out (its strides overflow int64)."""
    assert not is_shape(shape, 1 << 40) and not is_shape([*shape, 0])
    with pytest.raises(WireError, match="bad shape"):
        unpack_value(_packed(shape))
    header = {"dtype": "float32", "shape": shape, "job": "j", "sender": "s", "kind": "act"}
    with pytest.raises(IPCError, match="frame shape"):
        frame_of(header, [torch.empty(0, dtype=torch.uint8)])
    assert is_shape([0, 2**20, 2**20]) and is_shape([1] * 17)  # what the wire allows: rank 32


def _keyless(job: str, shape: list[int]) -> bytes:
    """A frame header naming a job and a non-member sender, no payload, two zero tags."""
    doc = {"v": VERSION, "job": job, "from": "stranger", "kind": "act", "step": 0, "mb": 0, "name": "x",
           "dtype": "uint8", "shape": shape, "nonce": os.urandom(16), "to": "me", "seq": 1, "enc": False,
           "bare": False}  # fmt: skip
    head = msgpack.packb(doc, use_bin_type=True)
    return struct.pack(">4sIQ", FRAME_MAGIC, len(head), 0) + head + b"\0" * 64


async def _served(first: bytes | None, timeouts: Timeouts) -> tuple[float, FrameReceiver]:
    receiver = FrameReceiver(peer_id="me", max_payload=1 << 20, timeouts=timeouts)
    receiver.register_job("J", {"member": b"k" * 32}, ["member"], lambda f: None)
    reader = asyncio.StreamReader()
    if first is not None:
        reader.feed_data(first)
    started = time.monotonic()
    await receiver.serve(StreamReaderSource(reader), "attacker")  # never raises
    return time.monotonic() - started, receiver


def test_a_keyless_peer_keeps_the_handshake_deadline_after_a_refused_frame() -> None:
    """A refused frame that leaves the stream in sync used to give its connection the idle timeout (30
    minutes), so a peer without the key could hold a host's connection slots with one header each."""
    timeouts = Timeouts(handshake=0.3, idle=30.0, progress=0.3)
    took, receiver = asyncio.run(_served(_keyless("J", [0]), timeouts))
    assert took < 5.0 and receiver.stats["J"].frames_refused.get("sender_not_allowed") == 1
    took, receiver = asyncio.run(_served(_keyless("J", [0, 2**47, 2**47]), timeouts))
    assert took < 5.0 and receiver.stats["J"].frames_refused.get("bad_shape") == 1


def _channel() -> NetChannel:
    return NetChannel(job_id="j", peer_id="B", subdag_of_peer={"A": 0}, send_frame=None)  # type: ignore[arg-type]


def _frame(name: str, t: torch.Tensor) -> TensorFrame:
    return TensorFrame("j", "A", "act", 0, 0, name, t)


def test_a_members_malformed_frame_is_refused_and_fails_the_value_it_was_for_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Codec maps of the wrong types, superscript digits (``"²".isdigit()``, ``int("²")`` raises), and
    whatever else a decoder might raise on a member's bytes: a refusal, and the awaited value fails with
    it instead of the step waiting out the broker's timeout."""

    async def scenario() -> None:
        channel = _channel()
        channel.mailbox.forget_step(0)
        bad_codec = pack_value({"$t": 0}, [torch.zeros(4, dtype=torch.bfloat16)], [{"c": "bf16", "d": ["x"]}])
        for name, payload, says in (
            ("x1", bad_codec, "malformed compression info"),
            ("x2", _packed([0, 2**39, 2**39]), "bad shape"),
        ):
            waiting = asyncio.ensure_future(channel.recv(0, ("act", 0, 0, name)))
            await asyncio.sleep(0)
            channel.on_frame(_frame(name, payload))
            with pytest.raises(JobError, match=says):
                await asyncio.wait_for(waiting, 5)
        channel.on_frame(_frame("x/\u00b2", torch.zeros(2)))
        with pytest.raises(WireError, match="names no route"):
            split_route("\u00b2>1:x")

        def broken(*args: Any) -> Any:
            raise OverflowError("a decoder's own error")

        monkeypatch.setattr("fusionnet.compnode.netchannel.decode_structure", broken)
        waiting = asyncio.ensure_future(channel.recv(0, ("act", 0, 0, "y")))
        await asyncio.sleep(0)
        channel.on_frame(_frame("y", pack_value({"$t": 0}, [torch.ones(2)], [None])))
        with pytest.raises(JobError, match="malformed frame \\(OverflowError"):
            await asyncio.wait_for(waiting, 5)
        assert channel.refused == 4

    asyncio.run(scenario())
    for info in ({"c": "bf16", "d": ["float32"]}, {"c": ["bf16"], "d": "float32"}, {"c": {}, "d": "float32"}):
        with pytest.raises(WireError, match="malformed compression info"):
            decompress(torch.zeros(2, dtype=torch.bfloat16), info)


def test_expand_to_minus_one_counts_selfs_size_in_the_element_cap() -> None:
    x = torch.zeros(2**20)
    for op, call in (
        ("method:expand", lambda fn: fn(x, 2**20, -1)),
        ("torch.broadcast_to", lambda fn: fn(x, (2**20, -1))),
    ):
        with pytest.raises(ExecutionError, match="over the per-op cap"):
            call(REGISTRY.executable(op))
    assert REGISTRY.executable("method:expand")(torch.zeros(3, 1), -1, 4).shape == (3, 4)
    assert REGISTRY.executable("method:new_zeros")(x, (2, 3)).shape == (2, 3)


def test_a_relayed_frame_the_channel_refuses_leaves_the_sandbox_worker_running() -> None:
    """A rank-17 tensor (the wire allows 32; the relay to the worker allowed 16) once ended the worker,
    and the job failed as if its own graph had crashed it."""
    from tests.test_sandbox import call, service
    from tests.test_subtask_service import PEERS, figure3_assign_docs

    async def scenario() -> None:
        s = service(sandbox=True)
        await call(s, "assign", figure3_assign_docs(1)[0])
        host = s.jobs["j1"].host
        worker = host.process  # type: ignore[attr-defined]
        try:
            route = s.server.routes["j1"]  # type: ignore[attr-defined]
            for name, t in (("x", torch.zeros([1] * 17)), ("x/\u00b2", torch.zeros(2))):
                route(TensorFrame("j1", PEERS[1], "act", 0, 0, name, t))
            reply = await asyncio.wait_for(call(s, "step", {"job_id": "j1", "step": 0}), 60)
            assert worker.is_alive() and isinstance(reply["loss"], float)
        finally:
            await call(s, "release", {"job_id": "j1", "reason": "done"})
            if worker.is_alive():
                worker.kill()

    asyncio.run(scenario())
