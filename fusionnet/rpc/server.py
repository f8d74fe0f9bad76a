"""Serving ``rpc_<name>`` handlers to other peers over hivemind's libp2p daemon.

One unary protocol (small calls, multiplexed over p2pd's persistent connection), one stream protocol
(large calls, chunked frames) and kept streams (calls one after another on one stream, ``kept.py``)
dispatch to the same handler table, so adding a method is adding a coroutine
``rpc_<name>(payload, context) -> dict``. Whatever a peer sends, the server answers with an error response
and goes on: garbage, oversize, unknown methods and handler crashes never escape into the daemon.
What one peer and all peers together may hold at once (calls, request bytes) and how long a request may
take are bounded (``limits.py``): a call over a limit is refused with a ``WireError`` before its body is
read, and everybody else is served as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext

from fusionnet.errors import FusionNetError, WireError
from fusionnet.rpc.limits import CallBudget, CallLimits
from fusionnet.rpc.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_UNARY_LIMIT,
    FETCH_METHOD,
    FRAME_HEADER_LEN,
    KEPT_IDLE,
    KEPT_PER_PEER,
    KEPT_PROTOCOL,
    REMOTE_ERROR_CLASSES,
    STREAM_PROTOCOL,
    UNARY_PROTOCOL,
    check_method_name,
    decode_request,
    encode_error,
    encode_result,
    encode_stashed,
)
from fusionnet.rpc.streams import close_writer, discard_input, read_frame, write_frame

log = logging.getLogger("fusionnet.rpc.server")

HANDLER_PREFIX = "rpc_"
_REFUSAL_LOG_EVERY = 10.0  # s between two log lines about calls refused over a limit (a flood is one line)
# At most this long a stream's handler reads on after its answer, waiting for the caller to close first.
LINGER_SECONDS = 2.0


@dataclass(frozen=True)
class RPCContext:
    """What a handler knows about a call: the caller's libp2p peer id (authenticated by libp2p) and the
    method name."""

    remote_peer: str
    method: str


Handler = Callable[[dict[str, Any], RPCContext], Awaitable[dict[str, Any] | None]]


def _error_kind(exc: BaseException) -> str:
    """The name a caller can map back to a project error class (nearest allow-listed base)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in REMOTE_ERROR_CLASSES:
            return cls.__name__
    return type(exc).__name__


class RPCServer:
    """Handler table + the two libp2p protocol handlers. ``start()`` registers them with p2pd, ``stop()``
    unregisters, then waits (up to a grace period) for calls still in flight."""

    def __init__(
        self,
        p2p: P2P,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        unary_limit: int = DEFAULT_UNARY_LIMIT,
        idle_timeout: float = 30.0,
        kept_idle: float = KEPT_IDLE,
        stash_ttl: float = 60.0,
        limits: CallLimits | None = None,
    ):
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if not 0 < unary_limit <= 2 * 1024 * 1024:
            raise ValueError(
                f"unary_limit must be in (0, 2 MiB] (p2pd refuses unary messages > 4 MiB), got {unary_limit}"
            )
        self.p2p = p2p
        self.max_message_bytes = max_message_bytes
        self.unary_limit = unary_limit
        self.idle_timeout = idle_timeout
        self.kept_idle = kept_idle  # s a kept stream may wait for its next call
        self.stash_ttl = stash_ttl
        self._handlers: dict[str, Handler] = {}
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._streams: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}  # in-flight stream calls
        self._kept: Counter[str] = Counter()  # kept streams open, by peer
        self._kept_idle: set[asyncio.StreamWriter] = set()  # kept streams between two calls
        self._stream_work: dict[asyncio.Task[Any], asyncio.Task[bytes]] = {}  # their running handlers
        # token -> (peer allowed to fetch it, body, expiry): answers too big for a unary reply.
        self._stash: dict[bytes, tuple[str, bytes, float]] = {}
        self._started = False
        self.limits = limits or CallLimits()
        self.budget = CallBudget(self.limits, max_message_bytes)
        self._last_refusal_log = -_REFUSAL_LOG_EVERY

    # ---- handler table ---------------------------------------------------------------------------
    def add_handler(self, name: str, handler: Handler) -> None:
        check_method_name(name)
        if name in self._handlers:
            raise ValueError(f"rpc method {name!r} is already registered")
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"rpc handler for {name!r} must be an async function")
        self._handlers[name] = handler

    def add_handlers(self, obj: object) -> list[str]:
        """Registers each ``rpc_<name>`` coroutine method of ``obj`` as method ``<name>``; returns names."""
        names = []
        for attr in sorted(dir(type(obj))):
            if attr.startswith(HANDLER_PREFIX):
                self.add_handler(attr[len(HANDLER_PREFIX) :], getattr(obj, attr))
                names.append(attr[len(HANDLER_PREFIX) :])
        return names

    @property
    def methods(self) -> list[str]:
        return sorted(self._handlers)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        assert not self._started, "RPCServer.start() called twice"
        await self.p2p.add_protobuf_handler(UNARY_PROTOCOL, self._on_unary, BytesValue)
        await self.p2p.add_binary_stream_handler(STREAM_PROTOCOL, self._on_stream)
        await self.p2p.add_binary_stream_handler(KEPT_PROTOCOL, self._on_kept)
        self._started = True

    async def stop(self, grace: float) -> None:
        """Stops taking calls, lets in-flight calls finish for up to ``grace`` seconds, cancels the rest."""
        if self._started:
            self._started = False
            # p2pd may already be gone (killed from outside); unregistering is then moot.
            with contextlib.suppress(Exception):
                await self.p2p.remove_protobuf_handler(UNARY_PROTOCOL)
            with contextlib.suppress(Exception):
                await self.p2p.remove_binary_stream_handler(STREAM_PROTOCOL)
            with contextlib.suppress(Exception):
                await self.p2p.remove_binary_stream_handler(KEPT_PROTOCOL)
            for writer in list(self._kept_idle):  # between calls: nothing to wait for
                writer.close()
        pending = {t for t in self._in_flight if t is not asyncio.current_task()}
        if pending:
            log.info("waiting up to %.1f s for %d in-flight RPC call(s)", grace, len(pending))
            _, still = await asyncio.wait(pending, timeout=grace)
            if still:
                log.warning("aborting %d RPC call(s) still running after %.1f s", len(still), grace)
                await self.abort()
        self._stash.clear()

    async def abort(self) -> None:
        """Ends every in-flight call now: streams are closed under their handlers (which then finish on
        their own; cancelling a p2pd stream task directly makes asyncio log a spurious error), unary calls
        are cancelled."""
        for task in list(self._in_flight):
            if task is asyncio.current_task():
                continue
            if task in self._streams:
                self._streams[task].transport.abort()
                if task in self._stream_work:
                    self._stream_work[task].cancel()
            else:
                task.cancel()
        pending = {t for t in self._in_flight if t is not asyncio.current_task()}
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    @contextlib.contextmanager
    def _track(self) -> Iterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            yield
        finally:
            self._in_flight.discard(task)

    # ---- transports ------------------------------------------------------------------------------
    async def _on_unary(self, request: BytesValue, context: P2PContext) -> BytesValue:
        peer = context.remote_id.to_base58()
        held = 0
        with self._track():
            try:
                self.budget.enter(peer)
            except WireError as e:
                return BytesValue(value=self._refused(e))
            try:
                self.budget.reserve(peer, len(request.value))  # in memory already: counts for the budget
                held = len(request.value)
                return BytesValue(value=await self._dispatch(request.value, peer, unary=True))
            except WireError as e:
                return BytesValue(value=self._refused(e))
            finally:
                self.budget.leave(peer, held)

    def _refused(self, e: WireError) -> bytes:
        now = time.monotonic()
        if now - self._last_refusal_log >= _REFUSAL_LOG_EVERY:
            self._last_refusal_log = now
            log.warning("rpc call refused: %s (%d refused so far)", e, self.budget.refused)
        return encode_error("WireError", str(e))

    async def _on_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._answer(info.peer_id.to_base58(), reader, writer)
            # The caller closes once it has read the answer; closing first (a bounded wait) could reach
            # it as a reset that overtakes the answer: a refusal once arrived as a bare end of stream
            # in tests/test_daemons.py under load.
            await discard_input(reader, linger=min(self.idle_timeout, LINGER_SECONDS))
        finally:
            await close_writer(writer)

    async def _on_kept(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A kept stream (``kept.py``): calls one after another, each answered before the next is read,
        until the caller closes it, leaves it idle for ``kept_idle`` s, or a call on it goes wrong."""
        peer = info.peer_id.to_base58()
        try:
            if self._kept[peer] >= KEPT_PER_PEER or not self._started:
                return  # closed unanswered: the caller goes on with plain streams
            self._kept[peer] += 1
            try:
                while True:
                    self._kept_idle.add(writer)  # ``stop`` closes the idle ones
                    try:
                        header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER_LEN), self.kept_idle)
                    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
                        return  # idle for too long, or closed by the caller: the stream's normal end
                    finally:
                        self._kept_idle.discard(writer)
                    if not self._started or not await self._answer(peer, reader, writer, header):
                        return
            finally:
                self._kept[peer] -= 1
                if self._kept[peer] <= 0:
                    del self._kept[peer]
        finally:
            await close_writer(writer)

    async def _answer(
        self,
        peer: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        header: bytes | None = None,
    ) -> bool:
        """Reads one call's request from the stream (after ``header`` when read already) and writes its
        answer. True when the stream is left between calls, ready for another."""
        task = asyncio.current_task()
        assert task is not None
        held = [0]  # request bytes reserved for this call

        def reserve(nbytes: int) -> None:
            self.budget.reserve(peer, nbytes)
            held[0] = nbytes

        with self._track():
            self._streams[task] = writer
            entered = False
            try:
                try:
                    self.budget.enter(peer)
                    entered = True
                    body = await read_frame(
                        reader,
                        self.max_message_bytes,
                        self.idle_timeout,
                        f"rpc request from {peer}",
                        reserve=reserve,
                        deadline=self.limits.read_deadline,
                        header=header,
                    )
                except WireError as e:
                    await write_frame(writer, self._refused(e))
                    await discard_input(reader, linger=min(self.idle_timeout, LINGER_SECONDS))
                    return False
                # The handler runs in a task of ours, so abort() can cancel it without cancelling this one.
                work = asyncio.create_task(self._dispatch(body, peer, unary=False))
                del body  # ``_dispatch`` lets go of it once decoded
                self._stream_work[task] = work
                try:
                    response = await work
                except asyncio.CancelledError:
                    if task.cancelling():
                        work.cancel()
                        raise
                    return False  # aborted by abort()
                await write_frame(writer, response)
                return True
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                log.info("rpc stream from %s closed early: %s", peer, type(e).__name__)
                return False
            finally:
                if entered:
                    self.budget.leave(peer, held[0])
                self._streams.pop(task, None)
                self._stream_work.pop(task, None)

    # ---- dispatch --------------------------------------------------------------------------------
    async def _dispatch(self, body: bytes | bytearray, peer: str, *, unary: bool) -> bytes:
        try:
            request = decode_request(body)
        except WireError as e:
            log.warning("refused rpc request from %s: %s", peer, e)
            return encode_error("WireError", str(e))
        del body  # decoded: the raw frame goes now, not when the handler is done (big submissions)
        if request.method == FETCH_METHOD:
            return self._fetch(request.payload, peer, unary)
        handler = self._handlers.get(request.method)
        if handler is None:
            return encode_error(
                "WireError",
                f"unknown rpc method {request.method!r}; this peer serves: "
                f"{', '.join(self.methods) or 'nothing'}",
            )
        deadline = asyncio.timeout(self.limits.handler_timeout)
        try:
            async with deadline:
                result = await handler(request.payload, RPCContext(remote_peer=peer, method=request.method))
            if result is None:
                result = {}
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not a dict")
            response = encode_result(result)
        except FusionNetError as e:
            log.info("rpc %s from %s refused: %s", request.method, peer, e)
            return encode_error(_error_kind(e), str(e))
        except asyncio.CancelledError:
            raise
        except TimeoutError as e:
            if not deadline.expired():
                log.exception("rpc %s from %s crashed", request.method, peer)
                return encode_error(type(e).__name__, str(e))
            log.warning(
                "rpc %s from %s: no answer within %.0f s", request.method, peer, self.limits.handler_timeout
            )
            return encode_error(
                "WireError",
                f"rpc {request.method}: no answer within the server's {self.limits.handler_timeout:.0f} s",
            )
        except Exception as e:
            log.exception("rpc %s from %s crashed", request.method, peer)
            return encode_error(type(e).__name__, str(e))
        if len(response) > self.max_message_bytes:
            return encode_error(
                "WireError",
                f"rpc {request.method}: response of {len(response)} bytes exceeds the limit of "
                f"{self.max_message_bytes} bytes",
            )
        if unary and len(response) > self.unary_limit:
            return self._put_stash(response, peer, request.method)
        return response

    def _put_stash(self, response: bytes, peer: str, method: str) -> bytes:
        now = time.monotonic()
        for token in [t for t, (_, _, exp) in self._stash.items() if exp < now]:
            del self._stash[token]
        held = sum(len(body) for _, body, _ in self._stash.values())
        if held + len(response) > self.max_message_bytes:
            return encode_error(
                "WireError",
                f"rpc {method}: {held} bytes of earlier large answers are still waiting to be "
                "fetched; retry later",
            )
        token = secrets.token_bytes(16)
        self._stash[token] = (peer, response, now + self.stash_ttl)
        return encode_stashed(token, len(response))

    def _fetch(self, payload: dict[str, Any], peer: str, unary: bool) -> bytes:
        if unary:
            return encode_error("WireError", f"{FETCH_METHOD} is only served over a stream")
        token = payload.get("token")
        entry = self._stash.get(token) if isinstance(token, bytes) else None
        if entry is None or entry[0] != peer:
            return encode_error("WireError", "no stashed answer under that token for this peer (expired?)")
        del self._stash[token]
        return entry[1]
