"""Writing a frame's buffers to a stream without joining them first.

The daemons run the standard asyncio event loop, whose ``writelines`` on Python 3.11 is
``write(b"".join(buffers))``: every byte of every frame was copied once in the sender before the
kernel copied it again (uvloop and Python 3.12 send the buffers with one ``writev``/``sendmsg``
instead). ``write_buffers`` does what they do: when nothing is queued on the transport, one
``writev`` straight from the buffers' memory; whatever the kernel does not take at once is handed to
the transport, which queues (copies) only that rest. Transports without a socket get the buffers as
before. Used for the chunks of large frames only: for a small frame (``mac.SMALL_FRAME``) the copy costs
less than it saves, and ``benchmarks/transport.py`` measured 64 KiB frames slower through ``writev``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


def write_buffers(writer: asyncio.StreamWriter, buffers: Sequence[Buffer]) -> None:
    """Queues ``buffers`` on ``writer`` in order, sending what the socket takes now without a copy.
    ``OSError`` from the socket (a reset, a closed peer) propagates: the caller drops the stream."""
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing() or transport.get_write_buffer_size() > 0:
        writer.writelines(buffers)  # queued bytes first: order matters more than a copy
        return
    try:
        sent = os.writev(sock.fileno(), buffers)
    except (BlockingIOError, InterruptedError):
        sent = 0
    for buffer in buffers:
        size = len(buffer) if not isinstance(buffer, memoryview) else buffer.nbytes
        if sent >= size:
            sent -= size
            continue
        view = memoryview(buffer).cast("B")
        writer.write(view[sent:])  # the transport sends or queues the rest, in order
        sent = 0
