"""The zero-copy receiver: frames survive any split of the byte stream, and backpressure pauses reading."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionnet.wire import FrameRefused, StreamEnded, read_frame
from fusionnet.wire.sources import BufferedSource
from tests.wire_support import KEY, frame, frame_bytes


class FakeTransport:
    """Just enough of a transport for BufferedSource; records pause/resume calls."""

    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _feed(source: BufferedSource, data: memoryview) -> None:
    """Delivers ``data`` the way an event loop does: into whatever buffer the protocol hands out."""
    while data:
        buf = source.get_buffer(-1)
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        source.buffer_updated(n)
        data = data[n:]


def _make_source() -> tuple[BufferedSource, FakeTransport]:
    source = BufferedSource()
    transport = FakeTransport()
    source.connection_made(transport)  # type: ignore[arg-type]
    return source, transport


TENSORS = [
    torch.arange(10.0),
    torch.zeros(0),
    torch.randint(0, 9, (3000,), generator=torch.Generator().manual_seed(0)),
]
STREAM = b"".join(frame_bytes(frame(t, name=f"t{i}")) for i, t in enumerate(TENSORS))


@pytest.mark.timeout(120)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_frames_survive_any_split_of_the_stream(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [memoryview(STREAM)[a:b] for a, b in itertools.pairwise(bounds)]

    async def go() -> list[torch.Tensor]:
        source, _ = _make_source()

        async def producer() -> None:
            for piece in pieces:
                _feed(source, piece)
                await asyncio.sleep(0)  # let the reader run between network reads
            source.eof_received()

        task = asyncio.create_task(producer())
        got = [
            (await read_frame(source, lambda job, sender: KEY, receiver="S", max_payload=1 << 20)).tensor
            for _ in TENSORS
        ]
        try:
            await read_frame(source, lambda job, sender: KEY, receiver="S", max_payload=1 << 20)
            raise AssertionError("expected the end of the stream")
        except StreamEnded:
            pass
        await task
        return got

    for got, want in zip(asyncio.run(go()), TENSORS):
        assert torch.equal(got, want)


def test_payload_bytes_land_directly_in_the_frame_buffer() -> None:
    async def go() -> None:
        source, _ = _make_source()
        target = memoryview(bytearray(1000))
        reading = asyncio.create_task(source.readinto(target))
        await asyncio.sleep(0)
        buf = source.get_buffer(-1)
        assert buf.obj is target.obj  # the loop would recv_into the caller's buffer: no staging copy
        buf[:1000] = b"\x07" * 1000
        source.buffer_updated(1000)
        await reading
        assert bytes(target) == b"\x07" * 1000

    asyncio.run(go())


def test_reading_pauses_while_nobody_consumes_and_resumes_when_read() -> None:
    async def go() -> None:
        source, transport = _make_source()
        data = frame_bytes(frame(torch.zeros(BufferedSource.PAUSE_ABOVE // 4 + 10)))
        _feed(source, memoryview(data))
        assert transport.paused and transport.pauses == 1
        f = await read_frame(source, lambda job, sender: KEY, receiver="S", max_payload=1 << 30)
        assert not transport.paused and f.tensor.numel() == BufferedSource.PAUSE_ABOVE // 4 + 10

    asyncio.run(go())


def test_eof_inside_a_payload_is_a_truncation() -> None:
    async def go() -> FrameRefused:
        source, _ = _make_source()
        data = frame_bytes(frame(torch.zeros(100)))
        _feed(source, memoryview(data)[: len(data) // 2])
        source.connection_lost(None)
        try:
            await read_frame(source, lambda job, sender: KEY, receiver="S", max_payload=1 << 20)
        except FrameRefused as e:
            return e
        raise AssertionError("a truncated frame was accepted")

    assert asyncio.run(go()).reason == "truncated"
