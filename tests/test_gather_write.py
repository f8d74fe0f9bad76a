"""``wire.gather.write_buffers``: a frame's buffers reach the peer whole and in order without being
joined first, whether the kernel takes them at once, in part (a small send buffer), or only after bytes
already queued on the transport."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from fusionnet.wire.gather import write_buffers

pytestmark = pytest.mark.timeout(60)


async def _pair(sndbuf: int | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, list[object]]:
    """A connected pair: the reader's end, the writer's end, and the ends' other halves (kept alive: a
    collected StreamWriter closes its socket)."""
    a, b = socket.socketpair()
    if sndbuf is not None:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    unused_reader, writer = await asyncio.open_connection(sock=a)
    reader, unused_writer = await asyncio.open_connection(sock=b)
    writer.transport.set_write_buffer_limits(high=0)
    return reader, writer, [unused_reader, unused_writer]


@pytest.mark.parametrize("sndbuf", [None, 4096])
def test_buffers_arrive_whole_and_in_order(sndbuf: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    buffers = [b"head", memoryview(payload.numpy()), bytearray(b"tag"), b""]
    expected = b"".join(bytes(b) for b in buffers)

    async def run() -> bytes:
        reader, writer, _keep = await _pair(sndbuf)
        writer.write(b"queued-first:" * (1 if sndbuf is None else 10_000))  # may stay queued
        before = writer.transport.get_write_buffer_size()
        write_buffers(writer, buffers)
        write_buffers(writer, [b"second"])
        total = len(b"queued-first:") * (1 if sndbuf is None else 10_000) + len(expected) + 6
        got = asyncio.ensure_future(reader.readexactly(total))
        await writer.drain()
        data = await got
        writer.close()
        assert sndbuf is None or before > 0  # the small buffer case did take the queued path
        return data

    data = asyncio.run(run())
    head = data[: len(data) - len(expected) - 6]
    assert set(head.split(b":")) <= {b"queued-first", b""}
    assert data[len(head) :] == expected + b"second"


def test_a_closed_peer_is_an_os_error() -> None:
    async def run() -> None:
        _, writer, keep = await _pair(None)
        keep[1].close()  # type: ignore[attr-defined]  # the peer goes
        await keep[1].wait_closed()  # type: ignore[attr-defined]
        with pytest.raises(OSError):  # writev to a socket whose peer is closed: EPIPE at once
            write_buffers(writer, [b"x" * (1 << 20)])

    asyncio.run(run())
