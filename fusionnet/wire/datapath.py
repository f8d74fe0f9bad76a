"""The direct data path: tensor frames over plain TCP between compnodes that can reach each other.

Measured on loopback here, plain TCP moves 1-2 GB/s where a hivemind P2P stream moves 0.1-0.3
GB/s, so bulk activations and gradients take this path whenever the receiver's address is
reachable, and ``p2p_path.P2PDataPath`` otherwise. Peers are authenticated per job: every frame
carries a MAC under the job's key (``mac.py``), and the server only delivers frames of registered
jobs from that job's allowed senders.

``DataPathServer`` receives through ``sources.BufferedSource`` (payloads land straight in their
frame's buffer); ``DataPathClient`` keeps one pooled connection per address (``pool.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from fusionnet.errors import WireError
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import MAX_ID_LEN, check_text
from fusionnet.wire.pool import StreamPool
from fusionnet.wire.receiver import FrameHandler, FrameReceiver, JobStats
from fusionnet.wire.sources import BufferedSource

log = logging.getLogger("fusionnet.wire")

Address = tuple[str, int]


def parse_address(address: tuple[str, int] | str) -> Address:
    """``("host", port)`` from a tuple or a ``"host:port"`` / ``"[v6 host]:port"`` string."""
    if isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise WireError(f"data path address {address!r} is not HOST:PORT")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        address = (host, int(port_text))
    if (
        not isinstance(address, tuple)
        or len(address) != 2
        or not isinstance(address[0], str)
        or not address[0]
        or isinstance(address[1], bool)
        or not isinstance(address[1], int)
        or not 0 < address[1] < 65536
    ):
        raise WireError(f"data path address {address!r} must be (host, port) with port in 1..65535")
    return address


class DataPathServer:
    """Accepts frame streams on a TCP port and delivers each job's frames to its callback."""

    def __init__(self, *, peer_id: str, max_payload: int = 1 << 30) -> None:
        self.receiver = FrameReceiver(peer_id=peer_id, max_payload=max_payload)
        self.peer_id = peer_id
        self.address: Address | None = None
        self._server: asyncio.Server | None = None
        self._sources: set[BufferedSource] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def stats(self) -> dict[str, JobStats]:
        """Per job id (and ``receiver.NO_JOB`` for frames no registered job can be charged with)."""
        return self.receiver.stats

    def register_job(
        self, job_id: str, key: bytes, allowed_senders: Iterable[str], on_frame: FrameHandler
    ) -> None:
        self.receiver.register_job(job_id, key, allowed_senders, on_frame)

    def unregister_job(self, job_id: str) -> None:
        self.receiver.unregister_job(job_id)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Address:
        """Listens; returns the bound ``(host, port)`` (port 0 picks a free one)."""
        if self._server is not None or self._stopping:
            raise RuntimeError("DataPathServer.start called twice")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: BufferedSource(self._on_connect), host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        log.info("%s: data path listening on %s:%d", self.peer_id, *self.address)
        return self.address

    def _on_connect(self, source: BufferedSource) -> None:
        if self._stopping:
            source.close()
            return
        self._sources.add(source)
        task = asyncio.get_running_loop().create_task(
            self._serve(source), name=f"wire-conn-{source.peername}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, source: BufferedSource) -> None:
        try:
            await self.receiver.serve(source, source.peername)
        except asyncio.CancelledError:
            raise
        except Exception:  # serve() handles peers' errors; this only guards against our own bugs
            log.exception("%s: connection task for %s failed", self.peer_id, source.peername)
        finally:
            source.close()
            self._sources.discard(source)

    async def stop(self) -> None:
        """Stops listening, closes every connection and waits for their tasks."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for source in list(self._sources):
            source.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DataPathServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class DataPathClient:
    """Sends frames to data path servers over pooled TCP connections (one per address)."""

    def __init__(self, *, peer_id: str, connect_timeout: float = 10.0) -> None:
        self.peer_id = check_text(peer_id, "peer_id", MAX_ID_LEN)
        self.connect_timeout = connect_timeout
        self._pool = StreamPool(self._open, describe=lambda dest: "%s:%d" % dest)  # noqa: UP031

    async def _open(self, dest: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(asyncio.open_connection(*dest), self.connect_timeout)

    async def send(self, address: tuple[str, int] | str, frame: TensorFrame, key: bytes) -> None:
        """Sends one frame; returns once all of it is in the kernel. ``PeerUnreachable`` if it cannot."""
        if not isinstance(frame, TensorFrame):
            raise WireError(f"expected a TensorFrame, got {type(frame).__name__}")
        if frame.sender != self.peer_id:
            raise WireError(f"frame claims sender {frame.sender!r} but this client is {self.peer_id!r}")
        await self._pool.send(parse_address(address), frame, key)

    async def close(self) -> None:
        await self._pool.close()

    async def __aenter__(self) -> DataPathClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
