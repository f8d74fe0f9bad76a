"""Calling ``rpc_<name>`` handlers on other peers: ``await client.call(peer_id, "name", payload, timeout=)``.

Small requests go as one unary message over p2pd's persistent connection; larger ones (and any answer the
server stashed because it was too big for a unary reply) go over a libp2p stream in chunked frames, a
stream kept open for the next call to that peer (``kept.py``) where the peer serves them. Every
failure surfaces as a project error: the remote handler's own ``FusionNetError`` class with its message
verbatim, or ``RPCError`` (unreachable, timeout, transport, remote crash) naming the peer and the method.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from fusionnet.errors import WireError
from fusionnet.rpc.kept import KeptStreams
from fusionnet.rpc.limits import transfer_seconds
from fusionnet.rpc.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_UNARY_LIMIT,
    FETCH_METHOD,
    STREAM_PROTOCOL,
    UNARY_PROTOCOL,
    RPCError,
    decode_response,
    encode_request,
    remote_exception,
)
from fusionnet.rpc.streams import close_writer, read_frame, write_frame

DEFAULT_TIMEOUT = 30.0


def as_peer_id(peer: str | PeerID) -> PeerID:
    if isinstance(peer, PeerID):
        return peer
    if not isinstance(peer, str) or not peer:
        raise WireError(f"peer id must be a non-empty base58 string, got {peer!r}")
    try:
        return _decoded_peer_id(peer)
    except ValueError as e:
        raise WireError(f"peer id {peer!r} is not valid base58") from e


@functools.lru_cache(maxsize=4096)
def _decoded_peer_id(text: str) -> PeerID:
    # Daemons name peers by their base58 text and call the same few peers for every step, batch and
    # heartbeat; decoding base58 each time was a few percent of a serving broker's CPU.
    return PeerID.from_base58(text)


log = logging.getLogger("fusionnet.rpc")
TRANSIENT_KINDS = frozenset({"IncompleteReadError", "ConnectionResetError", "BrokenPipeError"})


class RPCClient:
    def __init__(
        self,
        p2p: P2P,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        unary_limit: int = DEFAULT_UNARY_LIMIT,
        default_timeout: float = DEFAULT_TIMEOUT,
        kept_streams: bool = True,
    ):
        self.p2p = p2p
        # Streamed calls go on streams kept open between calls (``kept.py``); False: a new one each.
        self.kept = KeptStreams(p2p) if kept_streams else None
        self.max_message_bytes = max_message_bytes
        self.unary_limit = unary_limit
        self.default_timeout = default_timeout
        # Called with the peer id whenever a chunk of a streamed call moves either way, and when any
        # answer arrives: the broker's failure detection tells a saturated link (bytes still moving,
        # pings stuck behind them) from a dead peer with it.
        self.on_progress: Callable[[str], None] | None = None

    async def call(
        self,
        peer: str | PeerID,
        method: str,
        payload: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        retries: int = 2,
        large_answer: bool = False,
    ) -> dict[str, Any]:
        """Calls ``rpc_<method>`` on ``peer`` and returns its result dict. ``timeout`` (seconds) bounds
        each attempt, plus the time its request and its answer take at the slowest link FusionNet works
        over (``limits.SLOWEST_LINK``): a 32 MiB state part over a 1 Mbit/s uplink is slow, not failed.
        ``large_answer``: the answer is expected over the unary limit,
        so the call goes over a stream at once (the answer comes back on it) instead of a unary call
        whose answer would be stashed and fetched over a stream: one round trip instead of two.

        A stream that p2pd closes before the answer arrives (seen now and then on loopback under load)
        is tried again up to ``retries`` times: every FusionNet method is safe to repeat (handlers that
        change state recognise a repeated request). Timeouts and the peer's own errors are not retried.
        """
        for attempt in range(retries + 1):
            try:
                return await self._call_once(peer, method, payload, timeout, large_answer)
            except RPCError as e:
                if attempt == retries or e.kind not in TRANSIENT_KINDS:
                    raise
                log.info("rpc %s to %s: %s; trying again", method, e.peer, e.kind)
                await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _call_once(
        self,
        peer: str | PeerID,
        method: str,
        payload: dict[str, Any] | None,
        timeout: float | None,
        large_answer: bool = False,
    ) -> dict[str, Any]:
        peer_id = as_peer_id(peer)
        label = peer_id.to_base58()
        body = encode_request(method, payload)
        if len(body) > self.max_message_bytes:
            raise WireError(
                f"rpc {method} to {label}: request of {len(body)} bytes exceeds the limit of "
                f"{self.max_message_bytes} bytes"
            )
        timeout = self.default_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        started = loop.time()
        allowed = timeout + transfer_seconds(len(body))  # seconds this attempt may take, from ``started``
        try:
            async with asyncio.timeout(allowed) as window:

                def answer_of(nbytes: int) -> None:
                    """A big answer is on its way: the call gets the time it takes at the slowest link."""
                    nonlocal allowed
                    allowed = max(allowed, loop.time() - started + timeout + transfer_seconds(nbytes))
                    window.reschedule(started + allowed)

                raw = await (
                    self._unary(peer_id, body)
                    if len(body) <= self.unary_limit and not large_answer
                    else self._stream(peer_id, body, timeout, answer_of)
                )
                self._progressed(label)
                response = decode_response(raw)
                if response.stashed is not None:
                    if response.size > self.max_message_bytes:
                        raise WireError(
                            f"rpc {method} to {label}: answer of {response.size} bytes exceeds the limit of "
                            f"{self.max_message_bytes} bytes"
                        )
                    answer_of(response.size)
                    raw = await self._stream(
                        peer_id, encode_request(FETCH_METHOD, {"token": response.stashed}), timeout, answer_of
                    )
                    response = decode_response(raw)
                    if response.stashed is not None:
                        raise WireError(f"rpc {method} to {label}: stash reference answered with another one")
        except TimeoutError as e:
            raise RPCError(
                f"rpc {method} on peer {label}: no answer within {allowed:.3g} s"
                + (f" (a request of {len(body)} bytes)" if transfer_seconds(len(body)) >= 1 else ""),
                peer=label,
                method=method,
                kind="Timeout",
            ) from e
        except (P2PHandlerError, P2PDaemonError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            raise RPCError(
                f"rpc {method} on peer {label} failed: {type(e).__name__}: {e}",
                peer=label,
                method=method,
                kind=type(e).__name__,
            ) from e
        if response.error is not None:
            raise remote_exception(*response.error, peer=label, method=method)
        assert response.result is not None
        return response.result

    def _progressed(self, label: str) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(label)
            except Exception:  # an observer's bug must not fail the call
                log.exception("rpc progress callback failed")

    async def _unary(self, peer_id: PeerID, body: bytes) -> bytes:
        reply = await self.p2p.call_protobuf_handler(
            peer_id, UNARY_PROTOCOL, BytesValue(value=body), BytesValue
        )
        return reply.value

    async def _stream(
        self,
        peer_id: PeerID,
        body: bytes,
        timeout: float,
        answer_of: Callable[[int], None] | None = None,
    ) -> bytes:
        """``timeout`` also bounds the wait for the answer's first frame: a handler may work on a big
        request (a 100M-parameter submission) for longer than the default before it answers.
        ``answer_of(nbytes)`` hears the answer's size once its header is in."""
        label = peer_id.to_base58()
        progress = None if self.on_progress is None else lambda: self._progressed(label)
        what = f"rpc answer from {label}"

        async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
            await write_frame(writer, body, progress)
            return await read_frame(
                reader, self.max_message_bytes, timeout, what, progress, on_length=answer_of
            )

        if self.kept is not None and self.kept.wanted(peer_id):
            answer = await self.kept.call(peer_id, exchange, left_open=_stream_left_open)
            if answer is not None:
                return answer
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, STREAM_PROTOCOL)
        try:
            # The server may refuse (oversize) and close before reading everything: its answer says why.
            with contextlib.suppress(ConnectionError, OSError):
                await write_frame(writer, body, progress)
            return await read_frame(
                reader, self.max_message_bytes, timeout, what, progress, on_length=answer_of
            )
        finally:
            await close_writer(writer)

    def close(self) -> None:
        """Closes the streams kept for later calls (the daemon is going)."""
        if self.kept is not None:
            self.kept.close()


REFUSAL_MAX_BYTES = 4096  # a refusal is a short error answer: larger answers are not looked into


def _stream_left_open(answer: bytes) -> bool:
    """Whether the server keeps a kept stream open after ``answer``. Not after a refusal of the request
    itself (over a budget, malformed: a ``WireError`` answer): the server then drops whatever follows
    for a while and closes, so a call sent on it meanwhile would be lost and wait for the close."""
    if len(answer) > REFUSAL_MAX_BYTES or b"WireError" not in answer:
        return True  # a byte search: most answers are small, and decoding each twice is on every call
    try:
        response = decode_response(answer)
    except WireError:
        return False
    return response.error is None or response.error[0] != "WireError"
