"""Streams kept open between calls to the same peer (``KEPT_PROTOCOL``), so a call does not pay for a
new libp2p stream.

Why: every daemon call went on a stream of its own (p2pd's unary calls share one control connection,
which wedged for good after a cancelled call). Opening one costs a new connection to p2pd, a stream
open across the swarm and a protocol negotiation: measured on loopback, 2.6 ms per 100 B call on a new
stream against 0.8 ms on a kept one (1.9 ms unary), and a broker makes one call per compnode per
training step and per served batch or token.

A kept stream carries one call at a time, each answered before the next is written, so a stream in the
pool is always between calls. Anything unexpected on one (a timeout, a cancel, an error while writing
or reading) closes it: its state is unknown. So does an answer that refuses the request itself (over a
budget, malformed): the server drops what follows for a while, then closes it. The server closes a
stream left idle for ``KEPT_IDLE`` seconds; the pool forgets streams idle for half that, so it rarely
hands out one being closed. When it
does, the call goes again on a fresh stream: every FusionNet method is safe to repeat. A peer that
closes a fresh kept stream without an answer (at its limit of kept streams, or a version that does not
serve the protocol) gets plain streams for ``PLAIN_FOR`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from fusionnet.rpc.protocol import KEPT_IDLE, KEPT_PROTOCOL

MAX_IDLE_PER_PEER = 8  # idle streams kept per peer; more concurrent calls open streams that close after
PLAIN_FOR = 60.0  # s a peer that refused a kept stream gets plain streams
CLIENT_IDLE = KEPT_IDLE / 2  # s the pool keeps an idle stream (the server closes it at KEPT_IDLE)
TRANSPORT_ERRORS = (asyncio.IncompleteReadError, ConnectionError, OSError)

Exchange = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bytes]]


@dataclass
class _Idle:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    since: float


class KeptStreams:
    """The client's pool of idle kept streams, by peer."""

    def __init__(self, p2p: P2P) -> None:
        self.p2p = p2p
        self._idle: dict[PeerID, list[_Idle]] = {}
        self._plain_until: dict[PeerID, float] = {}
        self.opened = self.reused = 0  # counts, for tests and logs
        self._swept = time.monotonic()

    def wanted(self, peer: PeerID) -> bool:
        """False while ``peer`` is known to refuse kept streams."""
        until = self._plain_until.get(peer)
        if until is None:
            return True
        if time.monotonic() >= until:
            del self._plain_until[peer]
            return True
        return False

    async def call(
        self, peer: PeerID, exchange: Exchange, left_open: Callable[[bytes], bool] = lambda _: True
    ) -> bytes | None:
        """``exchange(reader, writer)`` on a kept stream to ``peer`` (an idle one, else a new one): its
        answer, or None when ``peer`` does not take kept streams (the caller goes plain). The stream
        goes back to the pool unless ``left_open(answer)`` says the server ends it after that answer."""
        self._sweep()
        while True:
            idle = self._take(peer)
            reused = idle is not None
            if idle is None:
                try:
                    _, reader, writer = await self.p2p.call_binary_stream_handler(peer, KEPT_PROTOCOL)
                except P2PDaemonError as e:
                    if "protocol" not in str(e).lower():
                        raise  # unreachable: a plain stream would not get there either
                    self._plain_until[peer] = time.monotonic() + PLAIN_FOR
                    return None
                self.opened += 1
            else:
                reader, writer = idle.reader, idle.writer
                self.reused += 1
            try:
                answer = await exchange(reader, writer)
            except TRANSPORT_ERRORS:
                writer.close()
                if reused:
                    continue  # closed by the peer while idle (or it restarted): a fresh stream
                self._plain_until[peer] = time.monotonic() + PLAIN_FOR
                return None
            except BaseException:  # a timeout, a cancel, a refusal: the stream's state is unknown
                writer.close()
                raise
            if left_open(answer):
                self._give_back(peer, reader, writer)
            else:
                writer.close()
            return answer

    def _take(self, peer: PeerID) -> _Idle | None:
        idle = self._idle.get(peer)
        now = time.monotonic()
        while idle:
            entry = idle.pop()  # the most recently used: the least likely to be closed
            if now - entry.since < CLIENT_IDLE and not entry.writer.is_closing():
                return entry
            entry.writer.close()
        self._idle.pop(peer, None)
        return None

    def _sweep(self) -> None:
        """Closes the streams of every peer idle for too long, at most once per ``CLIENT_IDLE``: a peer
        that left is never called again, and its streams would hold their p2pd connections for good."""
        now = time.monotonic()
        if now - self._swept < CLIENT_IDLE:
            return
        self._swept = now
        for peer in list(self._idle):
            fresh = []
            for entry in self._idle[peer]:
                if now - entry.since < CLIENT_IDLE and not entry.writer.is_closing():
                    fresh.append(entry)
                else:
                    entry.writer.close()
            if fresh:
                self._idle[peer] = fresh
            else:
                del self._idle[peer]

    def _give_back(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) >= MAX_IDLE_PER_PEER or reader.at_eof():
            writer.close()
            return
        idle.append(_Idle(reader, writer, time.monotonic()))

    def close(self) -> None:
        """Closes every idle stream (the daemon is going)."""
        for idle in self._idle.values():
            for entry in idle:
                entry.writer.close()
        self._idle.clear()
