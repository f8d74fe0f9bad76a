"""Byte sources that frames are read from: an ``asyncio.StreamReader`` adapter and a zero-copy receiver.

``read_frame`` needs two operations: ``readexactly(n)`` for the small prefix/header/tag and
``readinto(view)`` to fill the payload buffer. Over a ``StreamReader`` (hivemind's P2P streams,
tests) ``readinto`` copies chunks out of the reader's buffer. ``BufferedSource`` is an
``asyncio.BufferedProtocol`` for the direct TCP path: while a payload is being read, the event loop
receives straight into the frame's preallocated buffer, so a payload is copied once, by the kernel.
Measured on loopback here: ~0.35 GB/s through ``StreamReader``, 1.2-2.3 GB/s through this protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

READ_CHUNK = 1 << 20


class ByteSource(Protocol):
    async def readexactly(self, n: int) -> bytes: ...

    async def readinto(self, view: memoryview) -> None: ...


class StreamReaderSource:
    """``ByteSource`` over an ``asyncio.StreamReader``; raises ``IncompleteReadError`` at a short EOF."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def readexactly(self, n: int) -> bytes:
        return await self.reader.readexactly(n)

    async def readinto(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            data = await self.reader.read(min(len(view) - filled, READ_CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", len(view))
            view[filled : filled + len(data)] = data
            filled += len(data)


def as_source(reader: object) -> ByteSource:
    if isinstance(reader, asyncio.StreamReader):
        return StreamReaderSource(reader)
    if hasattr(reader, "readinto") and hasattr(reader, "readexactly"):
        return reader  # type: ignore[return-value]
    raise TypeError(f"cannot read frames from a {type(reader).__name__}")


class BufferedSource(asyncio.BufferedProtocol):
    """One TCP connection's receiving side. One consumer task reads from it at a time.

    Bytes that arrive while no payload is being filled (prefix, header, tag, or a sender running
    ahead while the consumer delivers a frame) land in a small staging buffer and are appended to
    ``_pending``. Reading pauses as soon as ``_pending`` holds more than ``PAUSE_ABOVE`` bytes, which
    is enough for any frame head, and resumes when the consumer asks for more: so the bulk of every
    payload waits in the kernel until its buffer exists, then is received straight into it. The
    pause is also the connection's backpressure while a frame is being delivered.
    """

    STAGING = 64 * 1024
    PAUSE_ABOVE = 32 * 1024

    def __init__(self, on_connect: Callable[[BufferedSource], None] | None = None) -> None:
        self._on_connect = on_connect
        self._staging = memoryview(bytearray(self.STAGING))
        self._pending = bytearray()
        self._target: memoryview | None = None
        self._filled = 0
        self._gave_target = False
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._paused = False
        # Loop time by which the current read must complete (``PhasedSource``); a timer is armed only
        # while a read actually waits, so reads served from buffered bytes cost no timer at all.
        self.deadline: float | None = None
        self.transport: asyncio.Transport | None = None
        self.peername = "?"

    # -- protocol callbacks (event loop) --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are duck-typed
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            host = str(peer[0])
            # An IPv4 peer of a dual-stack (``::``) listener: its plain address, so that the loopback and
            # per-host rules see 127.0.0.1 as loopback and count a host the same whichever way it came.
            if host.startswith("::ffff:") and "." in host:
                host = host[len("::ffff:") :]
            self.peername = f"{host}:{peer[1]}"
        else:
            self.peername = str(peer)
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None and not self._pending and self._filled < len(self._target):
            self._gave_target = True
            return self._target[self._filled :]
        self._gave_target = False
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        if self._gave_target:
            assert self._target is not None
            self._filled += nbytes
            if self._filled == len(self._target):
                self._wake()
            return
        self._pending += self._staging[:nbytes]
        self._wake()
        if len(self._pending) > self.PAUSE_ABOVE and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport: frames only ever flow one way

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()

    # -- consumer side --
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        assert self._waiter is None, "BufferedSource supports one reader at a time"
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None
        if self.deadline is not None:
            timer = loop.call_at(self.deadline, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _consumed(self) -> None:
        if self._paused and len(self._pending) <= self.PAUSE_ABOVE // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    async def readexactly(self, n: int) -> bytes:
        while len(self._pending) < n:
            if self._eof:
                partial = bytes(self._pending)
                self._pending.clear()
                raise asyncio.IncompleteReadError(partial, n)
            if self._paused:  # the consumer wants more than is buffered: let bytes in again
                self._paused = False
                assert self.transport is not None
                self.transport.resume_reading()
            await self._wait()
        with memoryview(self._pending) as pending:  # one copy, released before the resize
            data = bytes(pending[:n])
        del self._pending[:n]
        self._consumed()
        return data

    async def readinto(self, view: memoryview) -> None:
        take = min(len(self._pending), len(view))
        if take:
            with memoryview(self._pending) as pending:  # released before the bytearray is resized
                view[:take] = pending[:take]
            del self._pending[:take]
        if take == len(view):
            self._consumed()
            return
        # _pending is empty now: every further byte of this payload goes straight into ``view``.
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._target, self._filled = view, take
        try:
            while self._filled < len(view):
                if self._eof:
                    raise asyncio.IncompleteReadError(b"", len(view))
                await self._wait()
        finally:
            self._target, self._gave_target = None, False

    def unread(self, data: bytes) -> None:
        """Puts ``data`` back in front of what is buffered (a look at a connection's first bytes)."""
        self._pending[:0] = data

    @property
    def buffered(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class PhasedSource:
    """A ``ByteSource`` whose reads must each complete in time, or raise ``TimeoutError``.

    The first read of a frame (its prefix) may wait ``next_frame(wait)`` seconds: the handshake
    timeout for a connection's first frame, the idle timeout after that. Every later read inside the
    frame (at most a few MiB each) gets ``progress`` seconds. A peer that opens a connection and
    sends nothing, or stops in the middle of a frame, is cut off instead of holding a buffer and a
    descriptor for ever.

    Over a ``BufferedSource`` the limit is its ``deadline`` (a timer only while a read waits: most
    reads of small frames are served from bytes already received); over other sources, an
    ``asyncio.timeout`` per read.
    """

    def __init__(self, inner: ByteSource, progress: float) -> None:
        self.inner = inner
        self.progress = progress
        self._next = progress
        self.between_frames = True  # whether the last read to start was a frame's first
        self._buffered = inner if isinstance(inner, BufferedSource) else None

    def next_frame(self, wait: float) -> None:
        self._next, self.between_frames = wait, True

    def _timeout(self) -> float:
        timeout, self._next = self._next, self.progress
        return timeout

    async def readexactly(self, n: int) -> bytes:
        if self._buffered is not None:
            self._buffered.deadline = asyncio.get_running_loop().time() + self._timeout()
            data = await self._buffered.readexactly(n)
        else:
            async with asyncio.timeout(self._timeout()):
                data = await self.inner.readexactly(n)
        self.between_frames = False
        return data

    async def readinto(self, view: memoryview) -> None:
        if self._buffered is not None:
            self._buffered.deadline = asyncio.get_running_loop().time() + self._timeout()
            await self._buffered.readinto(view)
        else:
            async with asyncio.timeout(self._timeout()):
                await self.inner.readinto(view)
        self.between_frames = False
