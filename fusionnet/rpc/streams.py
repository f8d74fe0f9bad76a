"""Reading and writing one length-prefixed RPC frame on an asyncio stream (a libp2p stream from p2pd).

Shared by the server and the client. The reader checks the header before touching the body, reads the
body in 1 MiB chunks, and gives up when the peer sends nothing for ``idle_timeout`` seconds or the whole
body is not in by a total deadline, so a peer can neither make us allocate more than the limit nor hold a
handler forever with a stalled or trickling upload. A server passes ``reserve`` to hold the body's bytes
against its budgets (``limits.CallBudget``) before reading any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fusionnet.errors import WireError
from fusionnet.rpc.protocol import FRAME_HEADER_LEN, STREAM_CHUNK, frame_header, parse_frame_header

Progress = Callable[[], None]  # called per chunk moved: a saturated link still moves bytes, a dead one not


async def read_frame(
    reader: asyncio.StreamReader,
    max_bytes: int,
    idle_timeout: float,
    what: str,
    progress: Progress | None = None,
    *,
    reserve: Callable[[int], None] | None = None,
    deadline: Callable[[int], float] | None = None,
    header: bytes | None = None,
    on_length: Callable[[int], None] | None = None,
) -> bytearray:
    """One frame's body. Raises ``WireError`` for garbage, oversize, a stall, a body not in within
    ``deadline(length)`` seconds, or one ``reserve(length)`` refuses; ``IncompleteReadError`` when the
    peer closes the stream early (nothing to answer then). ``progress`` is called per chunk read.
    ``header``: the frame's header, when the caller has read it already (a kept stream's server waits
    for it longer than for the rest). ``on_length(length)`` learns the body's size once the header is
    read (a client extends its call's deadline by the time a big answer takes)."""
    if header is None:
        try:
            header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER_LEN), idle_timeout)
        except TimeoutError as e:
            raise WireError(f"{what}: no frame header within {idle_timeout:g} s") from e
    length = parse_frame_header(header, max_bytes, what)
    if on_length is not None:
        on_length(length)
    if reserve is not None:
        reserve(length)
    loop = asyncio.get_running_loop()
    total = None if deadline is None else deadline(length)
    end = None if total is None else loop.time() + total
    # One growing buffer, not a list of chunks joined at the end: a big message is held once, not twice
    # (the join copied it). Grown as bytes arrive, never allocated from the declared length up front.
    body = bytearray()
    remaining = length
    while remaining:
        wait = idle_timeout if end is None else min(idle_timeout, end - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(reader.read(min(STREAM_CHUNK, remaining)), wait)
        except TimeoutError as e:
            if end is not None and loop.time() >= end:
                raise WireError(
                    f"{what}: only {length - remaining} of {length} bytes within the deadline "
                    f"of {total:.0f} s"
                ) from e
            raise WireError(
                f"{what}: stalled after {length - remaining} of {length} bytes "
                f"(nothing for {idle_timeout:g} s)"
            ) from e
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(body), length)
        body += chunk
        del chunk
        remaining = length - len(body)
        if progress is not None:
            progress()
    return body


async def write_frame(writer: asyncio.StreamWriter, body: bytes, progress: Progress | None = None) -> None:
    writer.write(frame_header(len(body)))
    view = memoryview(body)
    for offset in range(0, len(view), STREAM_CHUNK):
        writer.write(view[offset : offset + STREAM_CHUNK])
        await writer.drain()  # back-pressure per chunk: never queue the whole body in the transport
        if progress is not None:
            progress()
    await writer.drain()


async def discard_input(reader: asyncio.StreamReader, linger: float) -> None:
    """Reads and drops what the peer is still sending, until it stops or ``linger`` seconds pass.

    Used after refusing a request early: closing a socket with unread input resets the connection, and the
    reset can overtake our refusal on its way to the peer, which would then see a bare "connection reset".
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + linger
    with contextlib.suppress(TimeoutError, ConnectionError, OSError):
        while (left := deadline - loop.time()) > 0:
            if not await asyncio.wait_for(reader.read(STREAM_CHUNK), left):
                return


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
