"""Outgoing streams shared by both transports: one per destination, one writer at a time, reconnect once.

Frames from one sender to one destination travel over a single stream, in the order ``send`` was
called, and a frame is written whole under the stream's lock, so frames never interleave. That
order is what receivers rely on (a value's structure frame arrives after its tensors). A stream
found closed, or one that breaks while a frame is written, is dropped and the frame is sent again
once over a fresh stream; a second failure is ``PeerUnreachable``.

A connect that timed out or failed slowly (an address that black-holes its SYNs, a host that does not
answer ARP) is remembered for ``down_for`` seconds: frames queued behind it, and later ones, fail at once
with ``PeerUnreachable`` naming that first failure, instead of each paying the connect timeout again (a
step with 8 micro-batches paid it 8 times). A refused connection costs nothing to retry (a peer that
restarts is reachable again a moment later), so it is not remembered.

When ``send`` returns, the whole frame has been handed to the kernel (the write buffer is drained to
empty), so the caller may modify the tensor afterwards. It is not an acknowledgement: a frame
written in the instant the peer dies can be lost with no error (the next send to it then fails);
receivers that wait for a value therefore need their own timeout / retry, as for any peer failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from fusionnet.wire.crypt import is_loopback_host
from fusionnet.wire.frames import PreparedFrame, TensorFrame, check_frame, prepare_frame, write_prepared
from fusionnet.wire.refusal import PeerUnreachable

log = logging.getLogger("fusionnet.wire")

# ``open_stream(dest)`` -> (reader, writer, the peer id of the receiver at the other end)
Opener = Callable[[Hashable], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter, str]]]
SLOW_FAILURE = 1.0  # seconds: a connect that timed out, or took this long to fail, is remembered


@dataclass
class _Stream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    receiver: str  # frames on this stream are bound to this peer id (under their MAC)
    loopback: bool = False  # a TCP connection to a loopback address (``crypt.bare_ok``)

    def broken(self) -> bool:
        # Receivers never write back: anything readable on our end is the peer's FIN (or a protocol
        # violation), so the stream is done. Polling the socket sees a FIN the kernel already has but
        # the event loop has not processed yet, which would otherwise swallow the next frame.
        if self.writer.is_closing() or self.reader.at_eof():
            return True
        sock = self.writer.get_extra_info("socket")
        if sock is None or not hasattr(select, "poll"):
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
        return bool(poller.poll(0))


class StreamPool:
    """Sends over pooled streams opened by ``open_stream(dest)``; ``describe(dest)`` names a destination.
    ``down_for``: seconds a slow connect failure to a destination is remembered (0: never)."""

    def __init__(
        self,
        open_stream: Opener,
        describe: Callable[[Hashable], str] = str,
        *,
        down_for: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open_stream = open_stream
        self._describe = describe
        self._streams: dict[Hashable, _Stream] = {}
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._closed = False
        self.down_for = down_for
        self._clock = clock
        self._down: dict[Hashable, tuple[float, str]] = {}  # dest -> (when its connect failed, why)

    def _refuse_if_down(self, dest: Hashable) -> None:
        failed = self._down.get(dest)
        if failed is None:
            return
        at, why = failed
        age = self._clock() - at
        if age >= self.down_for:
            del self._down[dest]  # time to try again
            return
        raise PeerUnreachable(f"{why} ({age:.1f} s ago; not tried again for {self.down_for - age:.0f} s)")

    async def _open(self, dest: Hashable) -> _Stream:
        if self._closed:
            raise PeerUnreachable(f"cannot send to {self._describe(dest)}: the client is closed")
        self._refuse_if_down(dest)  # frames queued behind a connect that timed out fail at once
        started = self._clock()
        try:
            reader, writer, receiver = await self._open_stream(dest)
        except (TimeoutError, OSError) as e:
            # str(e) is empty for a bare TimeoutError (an ``asyncio.timeout``): name its type at least
            why = f"cannot open a stream to {self._describe(dest)}: {str(e) or type(e).__name__}"
            now = self._clock()
            if self.down_for > 0 and (isinstance(e, TimeoutError) or now - started >= SLOW_FAILURE):
                self._down[dest] = (now, why)
            raise PeerUnreachable(why) from e
        if self._closed:  # closed while connecting
            writer.close()
            raise PeerUnreachable(f"cannot send to {self._describe(dest)}: the client is closed")
        # high=0: drain() returns only once the buffer is empty, so no payload view outlives send().
        writer.transport.set_write_buffer_limits(high=0)
        peer = writer.get_extra_info("peername")
        loopback = isinstance(peer, tuple) and bool(peer) and is_loopback_host(str(peer[0]))
        stream = _Stream(reader, writer, receiver, loopback)
        self._streams[dest] = stream
        return stream

    async def _drop(self, dest: Hashable) -> None:
        stream = self._streams.pop(dest, None)
        if stream is not None:
            stream.writer.close()
            with contextlib.suppress(Exception):
                await stream.writer.wait_closed()

    async def send(
        self, dest: Hashable, frame: TensorFrame, key: bytes, *, encrypt: bool = False, bare_ok: bool = False
    ) -> None:
        """Writes ``frame`` on the pooled stream to ``dest`` (opened, or opened again once, as needed).
        ``bare_ok``: the job lets its payloads go without a MAC where the stream is a loopback TCP
        connection (``crypt.bare_ok``); encrypted frames never do."""
        if self._closed:
            raise PeerUnreachable(f"cannot send to {self._describe(dest)}: the client is closed")
        check_frame(frame, key)  # every check before a stream is touched

        def prepared_for(stream: _Stream) -> PreparedFrame:
            bare = bare_ok and stream.loopback and not encrypt
            return prepare_frame(frame, key, stream.receiver, encrypt=encrypt, bare=bare)

        lock = self._locks.setdefault(dest, asyncio.Lock())
        async with lock:
            stream = self._streams.get(dest)
            if stream is not None and stream.broken():
                await self._drop(dest)
                stream = None
            if stream is not None:
                try:
                    prepared = prepared_for(stream)
                    await write_prepared(stream.writer, prepared)
                    return
                except OSError as e:
                    log.info("stream to %s broke (%s); reconnecting once", self._describe(dest), e)
                    await self._drop(dest)
                except BaseException:
                    await self._drop(dest)  # a partial frame is on that stream: it is unusable
                    raise
            stream = await self._open(dest)
            try:
                # prepared again: a new sequence number, and the receiver may have changed
                prepared = prepared_for(stream)
                await write_prepared(stream.writer, prepared)
            except OSError as e:
                await self._drop(dest)
                raise PeerUnreachable(f"stream to {self._describe(dest)} broke while sending: {e}") from e
            except BaseException:
                await self._drop(dest)
                raise

    def writer_of(self, dest: Hashable) -> asyncio.StreamWriter | None:
        """The open stream's writer to ``dest``, if one is open (to set socket options on it)."""
        stream = self._streams.get(dest)
        return None if stream is None else stream.writer

    async def close(self) -> None:
        """Closes every stream; later sends raise ``PeerUnreachable``."""
        self._closed = True
        for dest in sorted(self._streams, key=self._describe):
            await self._drop(dest)
