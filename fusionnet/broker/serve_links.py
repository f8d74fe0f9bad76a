"""A deployment's batches sent by the broker straight to its compnodes' sandbox workers over the direct
data path, each answered on the same connection (issue 14; the frames: ``messages.serve_frames``; the
worker's side: ``compnode.worker_serves``).

One ``ServeLink`` per sub-DAG whose compnode said its worker serves so (``AssignReply.serves_direct``):
a TCP connection to the compnode's data path address that opens with the job's hello, so the daemon
hands it to the job's worker (``wire.handoff``). The broker writes a ``serve`` frame per batch and reads
``served`` frames back with a ``FrameReceiver`` of its own: authenticated with the key of the broker's
link to that sub-DAG (``AssignRequest.serve_key``, fresh per placement), addressed to the broker, fresh
sequence numbers. Its frames are numbered in the lane the workers read (``handoff.WORKER_LANE``).

The RPC stays the fallback, batch by batch: a link that cannot connect, or breaks, is given up for the
placement, and that batch and the later ones go as ``serve_step`` calls. A batch whose frame the worker
had read already is not run twice: the compnode answers a repeated step with its first answer
(``compnode.serve_steps.StepOrder``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fusionnet.errors import FusionNetError, WireError
from fusionnet.messages.serve_frames import SERVED, answer_of, request_frame
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.wire.crypt import bare_ok, encrypt_to
from fusionnet.wire.datapath import MAX_PAYLOAD, parse_address, read_hello
from fusionnet.wire.frames import TensorFrame, encode_frame
from fusionnet.wire.handoff import GO, WORKER_LANE, worker_hello
from fusionnet.wire.job_routes import Timeouts
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.replay import next_seq_in
from fusionnet.wire.sources import BufferedSource

log = logging.getLogger("fusionnet.broker.deployments")
CONNECT_TIMEOUT = 5.0
GIVE_UP_AFTER = 3  # connections lost in a row without an answer: the link is given up for the placement
# A deployment may wait hours between batches, and its first may take minutes: the link's reader waits
# as long as the placement lasts (the worker's side closes an idle connection after its own idle
# timeout; the next batch then opens a new one).
LINK_TIMEOUTS = Timeouts(handshake=24 * 3600.0, idle=365 * 24 * 3600.0)


class LinkLost(FusionNetError):
    """The link broke (or never opened): the batch goes over RPC."""


class ServeLink:
    """The broker's connection to one sub-DAG's worker."""

    def __init__(
        self, broker: str, job_id: str, peer_id: str, address: str, key: bytes, encryption: str
    ) -> None:
        self.broker, self.job_id, self.peer_id = broker, job_id, peer_id
        self.host, self.port = parse_address(address)
        self._key, self._encryption = key, encryption
        self._source: BufferedSource | None = None
        self._reader: asyncio.Task[None] | None = None
        self._opening: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[TensorFrame]] = {}
        self.lost: str | None = None  # why the link is given up
        self._peer_host = self.host  # the address the connection reached (``_open``)
        self._losses = 0  # connections lost in a row without an answer

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT):
            _, source = await loop.create_connection(BufferedSource, self.host, self.port)
            try:
                hello = await read_hello(source)  # type: ignore[arg-type]  # readexactly is all it needs
                if hello != self.peer_id:
                    raise WireError(
                        f"the data path at {self.host}:{self.port} is {hello}, not {self.peer_id}"
                    )
                assert source.transport is not None
                source.transport.write(worker_hello(self.job_id))
                if await source.readexactly(len(GO)) != GO:
                    raise WireError("the data path answered the job's hello with something else")
            except BaseException:
                source.close()
                raise
        # The host the connection reached, not the announced name: the worker decides encryption by the
        # address it sees us at, and both ends must agree (a name that resolves to loopback, say).
        self._peer_host = source.peername.rpartition(":")[0]
        receiver = FrameReceiver(peer_id=self.broker, max_payload=MAX_PAYLOAD, timeouts=LINK_TIMEOUTS)
        # Any answer refused (its MAC, its encryption, its kind): the connection closes, so the batches
        # waiting on it go to the RPC at once instead of waiting for one that will never pass.
        receiver.on_refusal = lambda reason: source.close()
        receiver.register_job(
            self.job_id, {self.peer_id: self._key}, {self.peer_id}, self._on_frame, self._encryption
        )
        self._source = source
        self._reader = loop.create_task(self._read(receiver, source))

    async def _read(self, receiver: FrameReceiver, source: BufferedSource) -> None:
        try:
            await receiver.serve(source, source.peername, remote_host=self._peer_host)
        finally:
            self._closed(source)

    def _closed(self, source: BufferedSource) -> None:
        """The connection ended: its batches in flight go over RPC; the next batch opens a new one,
        unless ``GIVE_UP_AFTER`` ended in a row without an answer."""
        if self._source is not source:
            return
        self._source, self._opening = None, None
        self._losses += 1
        if self._losses >= GIVE_UP_AFTER:
            self._lose(f"{self._losses} connections ended without an answer")
        else:
            self._fail_pending("the connection closed")

    def _on_frame(self, frame: TensorFrame) -> None:
        if frame.kind != "ctrl" or frame.name != SERVED:
            raise WireError(
                f"a {frame.kind!r} frame {frame.name[:40]!r} from a worker: it answers batches only"
            )
        future = self._pending.pop(frame.step, None)
        if future is not None and not future.done():
            future.set_result(frame)

    def _fail_pending(self, why: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LinkLost(why))
        self._pending.clear()

    def _lose(self, why: str, quiet: bool = False) -> None:
        if self.lost is None and not quiet:
            self.lost = why
            log.warning(
                "deployment job %s: the direct serving link to %s lost (%s); its batches go as RPC calls",
                self.job_id,
                self.peer_id,
                why,
            )
        self._fail_pending(why)
        if self._source is not None:
            self._source.close()

    async def call(self, request: ServeStepRequest) -> ServeStepReply:
        """The batch's answer over the link; ``LinkLost`` when it cannot give one (the caller goes to
        the RPC), the batch's own error (``ComputeError``, ...) as the RPC would raise it."""
        if self.lost is not None:
            raise LinkLost(self.lost)
        if self._source is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open())
            try:
                await asyncio.shield(self._opening)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this batch itself is cancelled
                # the opening was (the link closed for a new placement): the batch goes to the RPC
                raise LinkLost(self.lost or "the link closed while it opened") from None
            except Exception as e:
                self._lose(f"cannot connect: {type(e).__name__}: {e}"[:300])
                raise LinkLost(self.lost or "cannot connect") from None
        source = self._source
        # closed meanwhile (the worker stopping right after its go), or given up
        transport = None if source is None else source.transport
        if self.lost is not None or transport is None or transport.is_closing():
            raise LinkLost(self.lost or "the connection closed")
        future: asyncio.Future[TensorFrame] = asyncio.get_running_loop().create_future()
        self._pending[request.step] = future
        buffers = encode_frame(
            request_frame(self.broker, request),
            self._key,
            receiver=self.peer_id,
            seq=next_seq_in(WORKER_LANE),
            encrypt=encrypt_to(self._encryption, self._peer_host),
            bare=bare_ok(self._encryption, self._peer_host),
        )
        transport.writelines(buffers)
        try:
            frame = await future
        finally:
            self._pending.pop(request.step, None)
        self._losses = 0
        return answer_of(frame)

    async def close(self) -> None:
        self._lose("the placement ended", quiet=True)
        self.lost = self.lost or "the placement ended"
        for task in (self._opening, self._reader):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (self._opening, self._reader) if t is not None), return_exceptions=True
        )


class ServeLinks:
    """A placement's links, by sub-DAG, and how many calls went each way (``status``)."""

    def __init__(self) -> None:
        self.links: dict[int, ServeLink] = {}
        self.calls = {"direct": 0, "rpc": 0}

    async def call(
        self, subdag: int, request: ServeStepRequest, rpc: Callable[[], Awaitable[ServeStepReply]]
    ) -> ServeStepReply:
        link = self.links.get(subdag)
        if link is not None and link.lost is None:
            try:
                reply = await link.call(request)
            except LinkLost:
                pass
            else:
                self.calls["direct"] += 1
                return reply
        reply = await rpc()
        self.calls["rpc"] += 1
        return reply

    async def replace(self, links: dict[int, ServeLink]) -> None:
        """A new placement's links (the old ones closed)."""
        old, self.links = self.links, links
        await asyncio.gather(*(link.close() for link in old.values()), return_exceptions=True)

    @property
    def direct(self) -> int:
        """Sub-DAGs whose batches go over a link now."""
        return sum(1 for link in self.links.values() if link.lost is None)
