"""A sandbox worker's values from its peers, read by the worker itself from the connections its daemon
hands over (``wire.handoff``).

Why: every activation or gradient that reached a compnode was read and authenticated by the daemon,
then relayed to the job's worker over their socket pair: a copy through the kernel and a wake-up of
one more process on every value's critical path, on cores the stages share. The sending side stopped
relaying already (``worker_sends``); with this, a value goes from one worker's memory to the other's
with no daemon in between.

The worker reads those connections as its daemon would: a ``FrameReceiver`` with the job's link keys
(``AssignRequest.key_of_link``), its allowed senders, its encryption policy, the same timeouts and
bounds, and a replay window of its own over the one sequence lane sending workers number in
(``handoff.WORKER_LANE``; its daemon refuses that lane for this job). A connection carries values
only: a probe or a snapshot chunk on it is refused (those are the daemon's). At most
``MAX_CONNECTIONS`` connections at a time; more are closed, and their senders leave their values to
their daemons. What it received, and what it refused, ride on the worker's next answer to its daemon
(``take_tally``), which counts them in its metrics and step replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
from collections.abc import Callable

from fusionnet.errors import WireError
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.messages.serve_frames import SERVE
from fusionnet.wire.datapath import MAX_PAYLOAD, close_connections
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import GO, WORKER_LANE, take_sockets
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.sources import BufferedSource

log = logging.getLogger("fusionnet.compnode.sandbox")
MAX_CONNECTIONS = 64
VALUE_KINDS = frozenset({"act", "grad"})
# The connection the frame being delivered came on (each connection is read by a task of its own): where
# the answer to a broker's ``serve`` frame goes.
_SOURCE: contextvars.ContextVar[BufferedSource] = contextvars.ContextVar("source")
ServeHandler = Callable[[TensorFrame, BufferedSource], None]


class DirectReceiver:
    def __init__(self, peer_id: str, channel: socket.socket) -> None:
        channel.setblocking(False)
        self.channel = channel
        self.receiver = FrameReceiver(peer_id=peer_id, max_payload=MAX_PAYLOAD)
        self.receiver.on_refusal = self._refused
        self._refusals: dict[str, int] = {}  # reason -> frames refused since the last tally
        self._job_id: str | None = None
        self._deliver: Callable[[TensorFrame], None] | None = None
        self._broker: str | None = None  # a deployment's broker, whose ``serve`` frames go to ``_serve``
        self._on_serve: ServeHandler | None = None
        self._sources: set[BufferedSource] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._bytes = self._frames = 0
        self._reading = False

    def use(
        self,
        request: AssignRequest,
        deliver: Callable[[TensorFrame], None],
        broker: str | None = None,
        serve: ServeHandler | None = None,
    ) -> None:
        """Reads the job's values from now on, into ``deliver`` (once: later chunks share the peers); with
        ``broker`` and ``serve`` (a deployment whose assignment carries ``serve_key``), also the broker's
        ``serve`` frames, into ``serve`` with the connection each came on."""
        if self._job_id is not None:
            return
        keys = request.keys_by_sender()
        if broker is not None and serve is not None and request.serve_key is not None:
            keys[broker] = request.serve_key
            self._broker, self._on_serve = broker, serve
        self.receiver.register_job(
            request.job_id, keys, keys, self._on_frame, request.spec.wire_encryption, lanes={WORKER_LANE}
        )
        self._job_id, self._deliver = request.job_id, deliver
        asyncio.get_running_loop().add_reader(self.channel.fileno(), self._take)
        self._reading = True

    def _take(self) -> None:
        taken = take_sockets(self.channel)
        if taken is None:  # the daemon's end closed: it is stopping us
            self._stop_reading()
            return
        for sock in taken:
            if len(self._tasks) >= MAX_CONNECTIONS:
                log.warning("more than %d peer connections: one closed", MAX_CONNECTIONS)
                sock.close()
                continue
            task = asyncio.get_running_loop().create_task(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, source = await loop.connect_accepted_socket(BufferedSource, sock=sock)
        except OSError as e:
            log.warning("a peer connection handed over could not be read (%s)", e)
            sock.close()
            return
        self._sources.add(source)
        try:
            assert source.transport is not None
            source.transport.write(GO)
            host = source.peername.rpartition(":")[0]
            log.info("values from %s: read here, not relayed by the daemon", source.peername)
            _SOURCE.set(source)  # this task's: ``_on_frame`` runs inside ``serve`` below
            await self.receiver.serve(source, source.peername, remote_host=host)
        finally:
            source.close()
            self._sources.discard(source)

    def _on_frame(self, frame: TensorFrame) -> None:
        if frame.sender == self._broker:  # the broker sends batches, never values
            if frame.kind != "ctrl" or frame.name != SERVE or self._on_serve is None:
                raise WireError(
                    f"a {frame.kind!r} frame {frame.name[:40]!r} from the broker: it sends batches only"
                )
            self._on_serve(frame, _SOURCE.get())
            return
        if frame.kind not in VALUE_KINDS:
            raise WireError(f"a {frame.kind!r} frame on a worker's connection: those go to the daemon")
        assert self._deliver is not None
        self._deliver(frame)
        self._bytes += frame.tensor.numel() * frame.tensor.element_size()
        self._frames += 1

    def _refused(self, reason: str) -> None:
        self._refusals[reason] = self._refusals.get(reason, 0) + 1

    def take_tally(self) -> dict[str, object]:
        """What to tell the daemon since the last call: ``received`` ``[bytes, frames]`` and
        ``refusals`` ``{reason: frames}``, each only when there is something."""
        tally: dict[str, object] = {}
        if self._frames:
            tally["received"] = [self._bytes, self._frames]
            self._bytes = self._frames = 0
        if self._refusals:
            tally["refusals"], self._refusals = self._refusals, {}
        return tally

    def refused(self) -> int:
        """Frames refused on our connections so far (bad MAC, wrong sender, a replay, ...)."""
        return sum(stats.refused_total for stats in self.receiver.stats.values())

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.channel.fileno())

    async def close(self) -> None:
        self._stop_reading()
        await close_connections(self._sources, self._tasks)
        self.channel.close()
