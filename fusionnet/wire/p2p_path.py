"""The fallback data path: the same tensor frames over hivemind (libp2p) streams.

Used when the receiver's TCP address cannot be reached (NAT, firewall): libp2p gets through with
hole punching or relays, at 0.1-0.3 GB/s instead of 1-2 GB/s. It uses hivemind's binary stream
handlers, which give a raw byte stream (not messages), so hivemind's 4 MiB message limit does not
apply; frames are still written in 1 MiB chunks, each drained before the next, which bounds the
memory held in the daemon's buffers and gives backpressure.

Authentication is the same per-job MAC as on TCP, plus one check TCP cannot make: libp2p has
already authenticated the remote peer id, so a frame whose ``sender`` differs from the stream's
peer is refused (``bind_sender``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from fusionnet.errors import WireError
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.pool import StreamPool
from fusionnet.wire.receiver import FrameReceiver, ReceivesFrames
from fusionnet.wire.sources import StreamReaderSource

log = logging.getLogger("fusionnet.wire")

PROTOCOL = "fusionnet.wire.v1"


def parse_peer_id(peer_id: str) -> PeerID:
    if not isinstance(peer_id, str):
        raise WireError(f"peer id must be a base58 string, got {type(peer_id).__name__}")
    try:
        return _decoded(peer_id)
    except Exception as e:  # base58/multihash libraries raise assorted types
        raise WireError(f"{peer_id[:80]!r} is not a libp2p peer id ({type(e).__name__})") from None


@functools.lru_cache(maxsize=1024)
def _decoded(text: str) -> PeerID:
    # Every frame on the fallback path names its peer in base58 (20 us to decode); a job has few peers.
    # A text that does not decode raises, and lru_cache keeps nothing for it.
    return PeerID.from_base58(text)


class P2PDataPath(ReceivesFrames):
    """Sends and receives frames over hivemind P2P streams of one ``P2P`` instance. libp2p encrypts
    its connections: frames on this path are never refused as plaintext."""

    def __init__(
        self,
        p2p: P2P,
        peer_id: str | None = None,
        *,
        max_payload: int = 1 << 30,
        bind_sender: bool = True,
        protocol: str = PROTOCOL,
    ) -> None:
        own = str(p2p.peer_id)
        if peer_id is not None and peer_id != own:
            raise WireError(f"peer_id {peer_id!r} is not this P2P instance's id {own!r}")
        self.p2p = p2p
        self.peer_id = own
        self.protocol = protocol
        self.bind_sender = bind_sender
        self.receiver = FrameReceiver(peer_id=own, max_payload=max_payload)
        self._pool = StreamPool(self._open, describe=lambda dest: f"p2p:{dest}")
        self._tasks: set[asyncio.Task[object]] = set()
        self._started = False

    async def start(self) -> None:
        """Registers the stream handler with the daemon; frames are accepted from then on."""
        if self._started:
            raise RuntimeError("P2PDataPath.start called twice")
        await self.p2p.add_binary_stream_handler(self.protocol, self._handle_stream)
        self._started = True

    async def _handle_stream(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        remote = str(info.peer_id)
        try:
            await self.receiver.serve(
                StreamReaderSource(reader), f"p2p:{remote}", bound_sender=remote if self.bind_sender else None
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # serve() handles peers' errors; this only guards against our own bugs
            log.exception("%s: P2P stream from %s failed", self.peer_id, remote)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _open(self, dest: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(parse_peer_id(dest), self.protocol)
        except (OSError, WireError):
            raise
        except Exception as e:  # the daemon reports an unreachable peer with its own exception types
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        return reader, writer, dest  # libp2p authenticated the peer: frames are bound to its id

    async def send(self, peer_id: str, frame: TensorFrame, key: bytes) -> None:
        """Sends one frame to ``peer_id`` over a pooled P2P stream. ``PeerUnreachable`` if it cannot."""
        if not isinstance(frame, TensorFrame):
            raise WireError(f"expected a TensorFrame, got {type(frame).__name__}")
        if frame.sender != self.peer_id:
            raise WireError(f"frame claims sender {frame.sender!r} but this peer is {self.peer_id!r}")
        parse_peer_id(peer_id)
        await self._pool.send(peer_id, frame, key)

    async def stop(self) -> None:
        """Removes the handler, closes outgoing streams and ends every incoming one."""
        if self._started and self.p2p.is_alive:
            with contextlib.suppress(Exception):  # the daemon may already be gone at shutdown
                await self.p2p.remove_binary_stream_handler(self.protocol)
        self._started = False
        await self._pool.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
