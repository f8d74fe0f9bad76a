"""A job's sandbox worker: the process where one assignment's IR is decoded, rebuilt and executed.

Forked from the compnode's fork server (``sandbox_pool.SandboxPool``, torch already imported), it
serves the daemon's calls over its socket (``sandbox_ipc``) with a ``job_host.JobHost``: ``assign``
builds the job, then ``step``, ``serve``, ``collect``, ``snapshot`` and ``drop`` run it, and
``frame`` hands it a value a peer sent. Values it sends go to the daemon as ``send`` calls, which the
daemon's data path carries.

Limits (``worker_process``), set before any of the job runs: private writable memory (``RLIMIT_DATA``,
CPU devices; the budget is ``--sandbox-memory-gb``), a lower CPU priority than the daemon, inherited
from the fork server (``sandbox_preload``: its heartbeats and RPCs win a contended core), and death with
the fork server (``PR_SET_PDEATHSIG``), which dies with the daemon: a compnode killed hard leaves no
worker behind, even one stuck in an op. No core dump: a job that crashes its worker would otherwise
write hundreds of MB of the worker's memory into the compnode's folder, and the kernel keeps the dying
worker's socket open until the dump is written, so the daemon would learn of the crash minutes late on a
slow disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import sys
from typing import Any

import msgpack
import torch

from fusionnet.compnode.assignment_intake import build_assignment
from fusionnet.compnode.compute import compute_pool
from fusionnet.compnode.faults import fault_hooks
from fusionnet.compnode.job_host import JobHost
from fusionnet.compnode.sandbox_ipc import (
    Blob,
    IPCChannel,
    blob_view,
    error_from,
    error_of,
    frame_message,
    frame_of,
    int_field,
    str_field,
)
from fusionnet.compnode.tcp_down import Down
from fusionnet.compnode.throttle import throttle_hooks
from fusionnet.compnode.worker_process import EXIT_NO_ANSWER, WorkerConfig, apply_limits, die_with_parent
from fusionnet.compnode.worker_receives import DirectReceiver
from fusionnet.compnode.worker_sends import DirectSender
from fusionnet.compnode.worker_serves import WorkerServes
from fusionnet.core_dumps import forbid_core_dumps
from fusionnet.daemon.memory import keep_freed_memory
from fusionnet.dag.short_stretches import ShortStretches, TrackedPool
from fusionnet.errors import ExecutionError, FusionNetError
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.messages.serving_rpc import ServeStepRequest
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.replay import set_seq_lane

log = logging.getLogger("fusionnet.compnode.sandbox")
# What torch and its backends say when an allocation fails (the memory budget is one cause).
# A thread's stack is private memory too: under the budget, starting one fails.
ALLOCATION_FAILED = re.compile(
    r"alloc|memory|could not create a primitive|MemoryError|start new thread", re.IGNORECASE
)


def main(sock: socket.socket, config: WorkerConfig, handoff: socket.socket | None = None) -> None:
    """The worker process (``multiprocessing`` target). ``handoff``: where the daemon passes the peer
    connections this worker reads itself (``worker_receives``)."""
    die_with_parent()
    forbid_core_dumps()
    logging.basicConfig(
        level=config.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [worker {config.job_id}/{config.subdag}] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    keep_freed_memory()  # a step's tensors reuse the last step's memory, no page faults (``daemon.memory``)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    set_seq_lane(1)  # our frames go out under the daemon's peer id, numbered apart from its own
    asyncio.run(Worker(sock, config, handoff).serve())


class Worker:
    def __init__(
        self, sock: socket.socket, config: WorkerConfig, handoff: socket.socket | None = None
    ) -> None:
        self.channel = IPCChannel(sock)
        self.config = config
        self.compute = TrackedPool(compute_pool(config.threads))
        self.host: JobHost | None = None
        self._sends: dict[int, asyncio.Future[None]] = {}
        self._next_send = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._snapshots: dict[int, list[bytes | None]] = {}  # packed chunks by snapshot call, until fetched
        self.relayed_refused = 0  # relayed frames that were not frames (``_deliver``)
        self.direct = (
            DirectSender(config.peer_id, config.job_id, config.tcp_down) if config.direct_sends else None
        )
        self.receives = None if handoff is None else DirectReceiver(config.peer_id, handoff)
        if self.receives is not None:  # a value lost to the memory budget fails the step, never hangs it
            self.receives.receiver.on_local_failure = self._lost_value
        self.serves: WorkerServes | None = None  # a deployment's batches from its broker (``worker_serves``)

    async def serve(self) -> None:
        try:
            while True:
                try:
                    header, blobs = await self.channel.recv()
                except (EOFError, ConnectionError):
                    # The daemon closed our socket (a reset when it closed with our messages unread): the
                    # job is over.
                    return
                op = header["op"]
                if op == "close":
                    if self.host is not None:
                        self._log_routes()
                        await self.host.close(str(header.get("why", ""))[:200])
                    return
                if op == "frame":  # a value from a peer: into the mailbox at once, in arrival order
                    if self.host is not None:
                        self._deliver(header, blobs)
                elif op == "sent":
                    self._sent(header)
                elif op == "down":  # a peer the daemon found TCP down to: no connect of ours waits on it
                    self._learn_down(header)
                elif op == "snapshot":  # queued on the compute thread now, before any later step
                    self._spawn(self._reply_snapshot(header))
                else:
                    self._spawn(self._call(op, header, blobs))
        finally:
            self.compute.shutdown(wait=False, cancel_futures=True)
            self.channel.close()
            if self.direct is not None:
                await self.direct.close()
            if self.serves is not None:
                await self.serves.close()
            if self.receives is not None:
                await self.receives.close()

    def _lost_value(self, job_id: str | None, sender: str | None, error: BaseException) -> None:
        """A peer's frame was lost to a failure here (out of memory reading it: --sandbox-memory-gb): its
        value never comes, so every receive of our job fails now and the step ends with that error."""
        if self.host is not None:
            for job in self.host.jobs.values():  # every sub-DAG held here: which one it was for is unknown
                job.channel.fail_receives(sender, error)

    def _learn_down(self, header: dict[str, Any]) -> None:
        if self.direct is None:
            return
        seconds = header.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            log.warning("ignored a 'down' message without its seconds")  # a hint only: the job goes on
            return
        peer, address = str_field(header, "peer", 256), str_field(header, "address", 300)
        self.direct.learn(Down(peer, address, str_field(header, "why", 2000), float(seconds)))

    def _deliver(self, header: dict[str, Any], blobs: list[Any]) -> None:
        """A peer's frame the daemon relayed. One that cannot be made a frame is refused and logged: it
        came from a member of the job, whose bytes must not end this worker (and fail the job as if its
        own graph had); the channel refuses the rest (``NetChannel.on_frame``)."""
        try:
            frame = frame_of(header, blobs)
        except Exception as e:
            self.relayed_refused += 1
            why = f"{type(e).__name__}: {str(e)[:160]}"
            log.warning("refused a relayed frame from %s: %s", str(header.get("sender"))[:80], why)
            return
        assert self.host is not None
        self.host.deliver(frame)

    def _log_routes(self) -> None:
        """How many stretches ran on the loop and on the compute thread (``dag.short_stretches``)."""
        assert self.host is not None
        for index, job in sorted(self.host.jobs.items()):
            short = job.executor.short_stretches
            if short is not None:
                routes = (index, short.inline, short.threaded)
                log.info("sub-DAG %d: %d stretches inline, %d on the compute thread", *routes)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, call_id: int, header: dict[str, Any], blobs: list[Blob] = ()) -> None:  # type: ignore[assignment]
        tally = None if self.direct is None else self.direct.take_tally()
        if tally is not None:  # what we sent ourselves since the last answer, for the daemon's metrics
            header = {**header, "direct": tally}
        if self.receives is not None:  # and what we received (and refused) ourselves
            header = {**header, **self.receives.take_tally()}
        await self.channel.send({"op": "reply", "id": call_id, **header}, blobs)

    async def _call(self, op: str, header: dict[str, Any], blobs: list[torch.Tensor]) -> None:
        call_id = int_field(header, "id")
        try:
            try:
                result, out = await self._run(op, header, blobs)
                await self._reply(call_id, result, out)
            except Exception as e:
                await self._reply(call_id, {"error": self._error(e)})
        except Exception:
            # No answer can be sent (out of memory even for that): leave, so that the daemon sees a
            # dead worker instead of waiting for an answer forever.
            os._exit(EXIT_NO_ANSWER)

    def _error(self, e: BaseException) -> list[str]:
        """``error_of``, with the memory budget named when an allocation failed under it."""
        kind, message = error_of(e)
        budget = self.config.memory_bytes
        allocation = isinstance(e, MemoryError | RuntimeError | FusionNetError) and ALLOCATION_FAILED.search(
            message
        )
        if budget is not None and allocation:
            message += (
                f" [this job's sandbox worker may use {budget / 2**30:.3g} GiB beyond its start "
                "(--sandbox-memory-gb)]"
            )
        return [kind, message]

    async def _run(
        self, op: str, header: dict[str, Any], blobs: list[torch.Tensor]
    ) -> tuple[dict[str, Any], list[Blob]]:
        if op == "assign":
            return await self._assign(header, blobs), []
        host = self.host
        if host is None:
            raise ExecutionError(f"sandbox worker: {op!r} before the job was assigned")
        if op == "step":
            outcome = await host.run_step(int_field(header, "step"), _subdag_field(header))
            fields = {k: getattr(outcome, k) for k in ("loss", "fp_seconds", "bp_seconds", "update_seconds")}
            outputs = outcome.outputs
            refused = outcome.refused + self.relayed_refused
            refused += 0 if self.receives is None else self.receives.refused()
            fields |= {"refused": refused, "outputs": outputs is not None}
            fields["activation_peak_bytes"] = outcome.activation_peak_bytes
            fields["sent_bytes"] = outcome.sent_bytes
            return fields, [outputs] if outputs is not None else []
        if op == "drop":
            await host.drop_inflight()
            return {}, []
        if op == "serve":
            doc = msgpack.unpackb(blob_view(blobs[0]), raw=False)
            reply = await host.serve(ServeStepRequest.model_validate(doc))
            return {}, [msgpack.packb(reply.model_dump(), use_bin_type=True)]
        if op == "collect":
            part, chunk = str_field(header, "part", 16), int_field(header, "chunk")
            reply = await host.collect(part, chunk, _subdag_field(header))
            return {}, [msgpack.packb(reply.model_dump(), use_bin_type=True)]
        if op == "snapshot_chunk":
            return {}, [self._snapshot_chunk(header)]
        raise ExecutionError(f"sandbox worker: unknown call {op!r}")

    async def _assign(self, header: dict[str, Any], blobs: list[torch.Tensor]) -> dict[str, Any]:
        if self.host is not None and self.host.job.spec.chunks < 2:
            raise ExecutionError("sandbox worker: a job is assigned already")
        doc = msgpack.unpackb(blob_view(blobs[0]), raw=False)
        request = AssignRequest.model_validate(doc)
        # The slices travel as blobs of their own; the model checked everything else.
        update: dict[str, Any] = {"state": blob_view(blobs[1])}
        if len(blobs) > 2:
            update["optim"] = blob_view(blobs[2])
        request = request.model_copy(update=update)
        if self.direct is not None:
            self.direct.use(request)
        device = str_field(header, "device", 64)
        if self.host is None:  # once: a later chunk of the job lives under the same limits
            apply_limits(self.config, device)

        def build() -> Any:
            return build_assignment(
                request,
                own_peer_id=self.config.peer_id,
                broker=str_field(header, "broker", 256),
                send=self._send,
                device=torch.device(device),
            )

        job = await asyncio.get_running_loop().run_in_executor(self.compute, build)
        if self.config.inline_seconds > 0 and job.executor.device.type == "cpu":
            # Not on accelerators: there a stretch's time on the host says little about its work.
            job.executor.short_stretches = ShortStretches(self.config.inline_seconds)
        for hook in (*fault_hooks(self.config.fault), *throttle_hooks(self.config.slowdown)):
            job.executor.hooks.add(hook)
        if self.host is not None:  # another chunk of the job (interleaved): the same loop runs both
            self.host.add(job)
        else:
            self.host = JobHost(job, self.compute)
        if self.receives is not None:
            broker = str_field(header, "broker", 256)
            if request.serve_key is not None and self.serves is None:  # a deployment: batches come here
                serve, tell = self.host.serve, self.channel.send
                key, policy = request.serve_key, request.spec.wire_encryption
                self.serves = WorkerServes(
                    self.config.peer_id, broker, request.job_id, key, policy, serve, tell
                )
            on_serve = None if self.serves is None else self.serves.on_frame
            self.receives.use(request, self.host.deliver, broker, on_serve)
        # Where the state went is the first thing to check when a --device cuda node seems slow.
        log.info("%d nodes, %d parameters on %s", len(job.subdag.nodes), len(job.subdag.params), device)
        serves = self.serves is not None
        return {"nodes": len(job.subdag.nodes), "params": len(job.subdag.params), "serves": serves}

    async def _reply_snapshot(self, header: dict[str, Any]) -> None:
        try:
            await self._snapshot_reply(header)
        except Exception:
            os._exit(EXIT_NO_ANSWER)

    async def _snapshot_reply(self, header: dict[str, Any]) -> None:
        """Packs the snapshot and answers with its parts; the daemon then fetches the chunks one by one
        (``snapshot_chunk``), each freed here once sent: the two processes hold one copy between them."""
        call_id = int_field(header, "id")
        if self.host is None:
            await self._reply(call_id, {"error": error_of(ExecutionError("no job to snapshot"))})
            return
        try:
            pending = self.host.snapshot(_subdag_field(header))
            chunks, seconds = await pending
        except Exception as e:
            await self._reply(call_id, {"error": error_of(e)})
            return
        if chunks:
            self._snapshots[call_id] = [b for _, b in chunks]
        await self._reply(call_id, {"parts": [p for p, _ in chunks], "seconds": seconds})

    def _snapshot_chunk(self, header: dict[str, Any]) -> bytes:
        snapshot = self._snapshots.get(int_field(header, "snapshot"))
        if snapshot is None:
            raise ExecutionError("no such snapshot (fetched already)")
        i = int_field(header, "chunk", 0, len(snapshot) - 1)
        blob = snapshot[i]
        if blob is None:
            raise ExecutionError(f"snapshot chunk {i} was fetched already")
        snapshot[i] = None
        if all(b is None for b in snapshot):
            del self._snapshots[int_field(header, "snapshot")]
        return blob

    # ---- values to peers: over our own TCP, or carried by the daemon ------------------------------
    async def _send(self, dst: int, frame: TensorFrame) -> None:
        if self.host is not None and self.host.local(dst):  # another chunk of ours: no daemon, no network
            self.host.deliver(frame)
            return
        if self.direct is not None and await self.direct.send(dst, frame):
            return
        self._next_send += 1
        send_id = self._next_send
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sends[send_id] = done
        header, blobs = frame_message(frame)
        failed = None if self.direct is None else self.direct.take_failure(dst)
        if failed is not None:  # the daemon marks that peer down too: it does not dial it again
            header["tcp_failed"] = failed[:2000]
        try:
            await self.channel.send({"op": "send", "id": send_id, "dst": dst, **header}, blobs)
            await done
        finally:
            self._sends.pop(send_id, None)

    def _sent(self, header: dict[str, Any]) -> None:
        done = self._sends.get(int_field(header, "id"))
        if done is None or done.done():
            return
        error = header.get("error")
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error_from(error))


def _subdag_field(header: dict[str, Any]) -> int | None:
    """A call's ``subdag`` (which of the job's sub-DAGs here; None: the only one)."""
    return None if header.get("subdag") is None else int_field(header, "subdag", 0, 1 << 16)
