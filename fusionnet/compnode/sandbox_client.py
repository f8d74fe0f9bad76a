"""The daemon's side of the sandbox workers (issue 12, sandboxed execution).

Every assignment forks one worker from the daemon's ``sandbox_pool.SandboxPool`` (``sandbox_worker``).
``SandboxedJob`` is that worker seen from the daemon: the ``job_host.Host`` calls, made over the
worker's socket.

When the worker dies (a segfault in an op, the memory limit, a kill) every pending and later call
of the job fails with an ``ExecutionError`` that names the signal or exit code and says that the
job's own graph or data caused it. The daemon and its other jobs go on; the broker sees a compnode
that still answers its pings, so it fails the job with that message instead of failing the sub-DAG
over to the next compnode, which would crash the same way. Releasing the job stops the worker, which
also ends a runaway op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from fusionnet.compnode.job_host import StepOutcome
from fusionnet.compnode.replicas import Chunk
from fusionnet.compnode.sandbox_ipc import (
    IPCChannel,
    IPCError,
    blob_view,
    error_from,
    frame_message,
    frame_of,
    int_field,
)
from fusionnet.compnode.sandbox_pool import SandboxPool, describe_exit
from fusionnet.compnode.tcp_down import Down
from fusionnet.errors import ComputeError, ExecutionError, FusionNetError
from fusionnet.messages.compnode_rpc import AssignRequest, CollectReply
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import pass_socket

log = logging.getLogger("fusionnet.compnode.sandbox")
STOP_GRACE = 2.0  # seconds a worker has to leave after its socket closes, before SIGKILL
MAX_REPLY_FIELDS = 64


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


class SandboxedJob:
    """``job_host.Host`` over a sandbox worker. ``send(dst, frame)`` carries the worker's values."""

    def __init__(
        self,
        pool: SandboxPool,
        peer_id: str,
        job_id: str,
        subdag: int,
        send: Callable[[int, TensorFrame], Awaitable[None]],
        counted: Callable[[str, int, int], None] | None = None,
        refusals: Callable[[str, int], None] | None = None,
    ) -> None:
        self.pool = pool
        # (direction "sent" | "received", bytes, frames) the worker moved over its own TCP
        self._counted = counted
        self._refusals = refusals  # (reason, frames) the worker refused on connections it read
        self.handoff: socket.socket | None = None  # where peer connections go to the worker
        self.peer_id = peer_id
        self.job_id = job_id
        self.subdag = subdag
        self._send = send
        self.process: Any = None
        self.channel: IPCChannel | None = None
        self._calls: dict[int, asyncio.Future[tuple[dict[str, Any], list[Any]]]] = {}
        self._next = 0
        self._reader: asyncio.Task[None] | None = None
        self._failure: ExecutionError | None = None
        self._refused = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._broker, self._device = "", ""  # of the first ``assign``: the job's later chunks share them
        self.serves_direct = False  # the worker reads a deployment's batches from its broker itself
        # (FP seconds of each batch it served so, batches that failed): for the daemon's metrics
        self.on_served: Callable[[list[float], int], None] | None = None
        self._addresses: list[tuple[str, str | None]] = []  # each sub-DAG's peer and data path address

    # ---- life ------------------------------------------------------------------------------------
    async def assign(self, request: AssignRequest, broker: str, device: str) -> tuple[int, int]:
        """Starts the worker and builds the job there: (IR nodes, parameters) of our sub-DAG."""
        self.process, self.channel, self.handoff = await self.pool.spawn(
            self.peer_id, self.job_id, self.subdag
        )
        self._reader = asyncio.ensure_future(self._read())
        self._broker, self._device = broker, device
        return await self._assign(request)

    async def assign_more(self, request: AssignRequest) -> tuple[int, int]:
        """Another of our sub-DAGs of the job (interleaved chunks), built in the same worker."""
        return await self._assign(request)

    async def _assign(self, request: AssignRequest) -> tuple[int, int]:
        if not self._addresses:  # every chunk of the job names the same peers
            self._addresses = [(p.peer_id, p.data_address) for p in request.peers]
        doc = request.model_dump(exclude={"state", "optim"}) | {"state": b"", "optim": None}
        blobs: list[Any] = [msgpack.packb(doc, use_bin_type=True), request.state]
        if request.optim is not None:
            blobs.append(request.optim)
        header, _ = await self._call("assign", {"broker": self._broker, "device": self._device}, blobs)
        self.serves_direct = header.get("serves") is True
        return int_field(header, "nodes"), int_field(header, "params")

    async def close(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self.channel is not None and self._failure is None:
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(self.channel.send({"op": "close", "why": why[:200]}), STOP_GRACE)
        if self.process is not None:
            if self.pool.look is not None and self.process.pid is not None:
                self.pool.look(self.process.pid)  # its CPU up to now, before it goes
            await asyncio.to_thread(self._stop_process)
        if self.channel is not None:
            self.channel.close()
        if self.handoff is not None:
            self.handoff.close()
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(ExecutionError(f"job {self.job_id}: released ({why})"))

    def _stop_process(self) -> None:
        self.process.join(STOP_GRACE)
        if self.process.exitcode is None:
            self.process.kill()  # a runaway op does not read its socket
            self.process.join(STOP_GRACE)

    # ---- the socket ------------------------------------------------------------------------------
    async def _read(self) -> None:
        assert self.channel is not None
        why = ""
        try:
            while True:
                header, blobs = await self.channel.recv()
                op = header["op"]
                if op == "reply":
                    self._answer(header, blobs)
                elif op == "send":
                    self._spawn(self._carry(header, blobs))
                elif op == "served":
                    self._served(header)
                else:
                    raise IPCError(f"unknown message {op[:40]!r} from the worker")
        except asyncio.CancelledError:
            raise
        except (EOFError, ConnectionError):
            # The worker is gone. A worker that dies with messages of ours unread (a step call sent ahead,
            # a peer's activations) resets the socket instead of closing it: the same death, not a crash of
            # this task, which would leave every pending call of the job waiting forever.
            pass
        except (IPCError, FusionNetError) as e:  # a worker that talks nonsense is ended
            why = f"; it sent a malformed message ({e})"
            log.warning("job %s: sandbox worker sent a malformed message: %s", self.job_id, e)
        if not self._closed:
            await asyncio.to_thread(self._stop_process)
            self._died(describe_exit(self.process.exitcode) + why)

    def _died(self, how: str) -> None:
        budget = self.pool.memory_bytes
        limit = "" if budget is None else f"; it may use {budget / 2**30:.3g} GiB (--sandbox-memory-gb)"
        # ComputeError: the job's inputs are at fault (its submitter exits 2), as when one of its ops raised
        self._failure = ComputeError(
            f"job {self.job_id}: sub-DAG {self.subdag}'s sandbox worker died ({how}{limit}); the job's own "
            "graph or data caused it, so it is not moved to another compnode"
        )
        log.error("%s", self._failure)
        self._fail_all(self._failure)

    def _fail_all(self, error: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer(self, header: dict[str, Any], blobs: list[Any]) -> None:
        if len(header) > MAX_REPLY_FIELDS:
            raise IPCError("reply with too many fields")
        for field, direction in (("direct", "sent"), ("received", "received")):
            tally = header.get(field)
            if tally is None:
                continue
            if not isinstance(tally, list) or len(tally) != 2 or not all(_count(x) for x in tally):
                raise IPCError(f"reply: {field!r} is not [bytes, frames]")
            if self._counted is not None:
                self._counted(direction, *tally)
        refusals = header.get("refusals")
        if refusals is not None:
            if (
                not isinstance(refusals, dict)
                or len(refusals) > MAX_REPLY_FIELDS
                or not all(isinstance(k, str) and len(k) <= 64 and _count(n) for k, n in refusals.items())
            ):
                raise IPCError("reply: 'refusals' is not {reason: frames}")
            if self._refusals is not None:
                for reason, frames in refusals.items():
                    self._refusals(reason, frames)
        future = self._calls.pop(int_field(header, "id"), None)
        if future is None or future.done():
            return
        if "error" in header:
            future.set_exception(error_from(header["error"]))
        else:
            future.set_result((header, blobs))

    def _served(self, header: dict[str, Any]) -> None:
        """What the worker served straight from the broker since it last said (``worker_serves``)."""
        fp, failed = header.get("fp"), int_field(header, "failed", 0, 1 << 30)
        if (
            not isinstance(fp, list)
            or len(fp) > 1 << 16
            or not all(isinstance(x, float | int) and not isinstance(x, bool) and 0 <= x < 1e7 for x in fp)
        ):
            raise IPCError("served: 'fp' is not a list of seconds")
        if self.on_served is not None:
            self.on_served([float(x) for x in fp], failed)

    async def _carry(self, header: dict[str, Any], blobs: list[Any]) -> None:
        """A value the worker sends to a peer: checked like a frame from the network, then sent."""
        send_id = int_field(header, "id")
        reply: dict[str, Any] = {"op": "sent", "id": send_id}
        try:
            dst = int_field(header, "dst", 0, 1 << 16)
            frame = frame_of(header, blobs)
            if frame.job_id != self.job_id:
                raise IPCError(f"the worker sent a frame of job {frame.job_id!r}")
            failed = header.get("tcp_failed")
            if isinstance(failed, str):  # a hint: never a reason to refuse the value itself
                self._tcp_failed(dst, failed[:2000])
            await self._send(dst, frame)
        except Exception as e:
            reply["error"] = [type(e).__name__, str(e)[:2000]]
        if self.channel is not None and not self._closed:
            with contextlib.suppress(OSError):
                await self.channel.send(reply)

    def _tcp_failed(self, dst: int, why: str) -> None:
        """The worker's TCP to sub-DAG ``dst`` failed: the daemon does not dial that address either (only
        a peer of this job can be named: a worker cannot send the daemon's other jobs off TCP)."""
        if self.pool.tcp_down is None or not 0 <= dst < len(self._addresses):
            return
        peer, address = self._addresses[dst]
        if address and self.pool.tcp_down.mark(peer, address, why):
            log.warning("job %s: worker's TCP to %s failed (%s); using P2P streams", self.job_id, peer, why)

    def tell_down(self, down: Down) -> None:
        """A peer of this job the daemon found TCP down to: the worker stops dialling it too."""
        if self.channel is None or self._closed or self._failure is not None:
            return
        if (down.peer_id, down.address) not in self._addresses:
            return
        message = {
            "op": "down",
            "peer": down.peer_id,
            "address": down.address,
            "why": down.why[:2000],
            "seconds": down.seconds_left,
        }
        self._spawn(self._tell(message))

    async def _tell(self, message: dict[str, Any]) -> None:
        if self.channel is not None and not self._closed:
            with contextlib.suppress(OSError):
                await self.channel.send(message)

    async def _call(
        self,
        op: str,
        header: dict[str, Any],
        blobs: list[Any] = (),  # type: ignore[assignment]
    ) -> tuple[dict[str, Any], list[Any]]:
        return await self._queue(op, header, blobs)[1]

    def _queue(
        self,
        op: str,
        header: dict[str, Any],
        blobs: list[Any] = (),  # type: ignore[assignment]
    ) -> tuple[int, asyncio.Future[tuple[dict[str, Any], list[Any]]]]:
        """Sends the call now (in order with every call made after it): its id, and its answer's future."""
        future: asyncio.Future[tuple[dict[str, Any], list[Any]]] = asyncio.get_running_loop().create_future()
        if self._failure is not None or self.channel is None:
            future.set_exception(self._failure or ExecutionError(f"job {self.job_id}: no sandbox worker"))
            return 0, future
        self._next += 1
        call_id = self._next
        self._calls[call_id] = future
        channel = self.channel

        async def send() -> None:
            try:
                await channel.send({"op": op, "id": call_id, **header}, blobs)
            except OSError as e:
                if not future.done():
                    future.set_exception(ExecutionError(f"job {self.job_id}: sandbox worker gone ({e})"))

        self._spawn(send())
        return call_id, future

    # ---- Host ------------------------------------------------------------------------------------
    async def run_step(self, step: int, subdag: int | None = None) -> StepOutcome:
        header, blobs = await self._call("step", {"step": step, "subdag": subdag})
        outputs = bytes(blob_view(blobs[0])) if header.get("outputs") and blobs else None
        loss = header.get("loss")
        if loss is not None and not isinstance(loss, float | int):
            raise IPCError("step reply: loss is not a number")
        seconds = [header.get(k) for k in ("fp_seconds", "bp_seconds", "update_seconds")]
        if not all(isinstance(x, float | int) and not isinstance(x, bool) for x in seconds):
            raise IPCError("step reply: timings are not numbers")
        self._refused = int_field(header, "refused")
        peak, sent = int_field(header, "activation_peak_bytes"), int_field(header, "sent_bytes")
        return StepOutcome(
            loss,
            *map(float, seconds),  # type: ignore[arg-type]
            outputs=outputs,
            refused=self._refused,
            activation_peak_bytes=peak,
            sent_bytes=sent,
        )

    async def drop_inflight(self) -> None:
        await self._call("drop", {})

    async def serve(self, request: ServeStepRequest) -> ServeStepReply:
        packed = msgpack.packb(request.model_dump(), use_bin_type=True)
        _, blobs = await self._call("serve", {}, [packed])
        return ServeStepReply.model_validate(_unpacked(blobs))

    async def collect(self, part: str, chunk: int, subdag: int | None = None) -> CollectReply:
        _, blobs = await self._call("collect", {"part": part, "chunk": chunk, "subdag": subdag})
        return CollectReply.model_validate(_unpacked(blobs))

    def snapshot(self, subdag: int | None = None) -> Awaitable[tuple[list[Chunk], float]]:
        snapshot_id, queued = self._queue("snapshot", {} if subdag is None else {"subdag": subdag})

        async def chunks() -> tuple[list[Chunk], float]:
            header, _ = await queued
            parts = header.get("parts")
            seconds = header.get("seconds")
            if (
                not isinstance(parts, list)
                or len(parts) > 1 << 16
                or not all(p in ("state", "optim") for p in parts)
                or not isinstance(seconds, float | int)
            ):
                raise IPCError("snapshot reply: malformed parts")
            out: list[Chunk] = []
            for i, part in enumerate(parts):  # one at a time: each is freed in the worker once here
                _, blobs = await self._call("snapshot_chunk", {"snapshot": snapshot_id, "chunk": i})
                if len(blobs) != 1:
                    raise IPCError("snapshot chunk reply carries no blob")
                out.append((part, blob_view(blobs.pop())))  # no copy: it leaves as one frame
            return out, float(seconds)

        return chunks()

    def deliver(self, frame: TensorFrame) -> None:
        """A peer's value, checked by the data path already; the worker checks it against the IR."""
        if self.channel is None or self._failure is not None or self._closed:
            return
        header, blobs = frame_message(frame)
        self._spawn(self.channel.send({"op": "frame", **header}, blobs))

    def refused(self) -> int:
        return self._refused

    @property
    def reads_values(self) -> bool:
        """Whether the worker reads its peers' values itself (the daemon hands it their connections)."""
        return self.handoff is not None

    def take_connection(self, connection: Any) -> bool:
        """Passes a peer worker's connection to our worker (``wire.handoff``); False: it cannot take it."""
        if self.handoff is None or self._closed or self._failure is not None:
            return False
        return pass_socket(self.handoff, connection)


def _unpacked(blobs: list[Any]) -> Any:
    if len(blobs) != 1:
        raise IPCError("reply carries no message")
    try:
        return msgpack.unpackb(blob_view(blobs[0]), raw=False, strict_map_key=True)
    except Exception as e:
        raise IPCError(f"reply is not msgpack ({type(e).__name__})") from None
