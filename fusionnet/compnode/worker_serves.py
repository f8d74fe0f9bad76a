"""A deployment's batches at its sandbox worker, straight from the broker over the data path: each
``serve`` frame run as the daemon's ``serve_step`` RPC would run it, its answer written back on the
connection the frame came on (``messages.serve_frames``).

The broker's connection reaches the worker as any peer's does (a job hello, handed over by the daemon,
``wire.handoff``); ``worker_receives`` reads it and gives each ``serve`` frame of the job's broker here
(authenticated with the broker's link key, ``AssignRequest.serve_key``; from anyone else it is refused
there). Batches run through the same ``JobHost.serve`` as the RPC's, in step order and answered once per
step (``compnode.serve_steps.StepOrder``), so a batch the broker asks again over RPC, after its
connection broke, gets the first run's answer, never a second run.

The daemon no longer sees these batches, so the worker tells it what it served (``tally``): the FP
seconds of each batch and the count of failed ones, for its metrics, at most once per ``TELL_EVERY``
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fusionnet.errors import WireError
from fusionnet.messages.serve_frames import answer_frame, request_of
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.wire.crypt import bare_ok, encrypt_to
from fusionnet.wire.frames import TensorFrame, encode_frame
from fusionnet.wire.sources import BufferedSource

log = logging.getLogger("fusionnet.compnode.sandbox")
TELL_EVERY = 1.0  # seconds between two tallies to the daemon
MAX_TALLY = 4096  # FP times kept between two tallies (more are summed into the last)


class WorkerServes:
    def __init__(
        self,
        peer_id: str,
        broker: str,
        job_id: str,
        key: bytes,
        encryption: str,
        serve: Callable[[ServeStepRequest], Awaitable[ServeStepReply]],
        tell: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        self.peer_id, self.broker, self.job_id = peer_id, broker, job_id
        self._key, self._encryption = key, encryption
        self._serve, self._tell = serve, tell
        self._tasks: set[asyncio.Task[None]] = set()
        self._fp: list[float] = []
        self._failed = 0
        self._told = 0.0
        self._telling: asyncio.Task[None] | None = None

    def on_frame(self, frame: TensorFrame, source: BufferedSource) -> None:
        """A ``serve`` frame of our broker (checked by the receiver), read from ``source``."""
        task = asyncio.get_running_loop().create_task(self._answer(frame, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, frame: TensorFrame, source: BufferedSource) -> None:
        reply: ServeStepReply | None = None
        error: BaseException | None = None
        try:
            reply = await self._serve(request_of(frame))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the batch's error goes to the broker, as the RPC would carry it
            error = e
        # Counted only once its answer is out: an answer that cannot be written is asked for again over
        # RPC, and the daemon counts the batch then (it would be counted twice).
        if not self._write(answer_frame(self.job_id, self.peer_id, frame.step, reply, error), source):
            return
        if reply is not None:
            self._fp.append(reply.fp_seconds)
            if len(self._fp) > MAX_TALLY:
                self._fp[-2:] = [sum(self._fp[-2:])]
        elif not isinstance(error, WireError):
            self._failed += 1
        self._maybe_tell()

    def _write(self, frame: TensorFrame, source: BufferedSource) -> bool:
        transport = source.transport
        if transport is None or transport.is_closing():
            log.info(
                "job %s: step %d's answer not sent: the broker's connection closed", self.job_id, frame.step
            )
            return False  # the broker asks again over RPC and gets the kept answer
        host = source.peername.rpartition(":")[0]
        buffers = encode_frame(
            frame,
            self._key,
            receiver=self.broker,
            encrypt=encrypt_to(self._encryption, host),
            bare=bare_ok(self._encryption, host),
        )
        transport.writelines(buffers)
        return True

    def _maybe_tell(self) -> None:
        """The tally within ``TELL_EVERY`` seconds, one message for all the batches until then."""
        if (self._fp or self._failed) and self._telling is None:
            wait = max(0.0, TELL_EVERY - (time.monotonic() - self._told))
            self._telling = asyncio.get_running_loop().create_task(self._tell_after(wait))

    async def _tell_after(self, wait: float) -> None:
        try:
            await asyncio.sleep(wait)  # at least a turn: after this turn's answers are written
            fp, failed = self._fp, self._failed
            self._fp, self._failed, self._told = [], 0, time.monotonic()
            await self._tell({"op": "served", "fp": fp, "failed": failed})
        except (OSError, ConnectionError):
            pass  # the daemon is gone: so are we, soon
        finally:
            self._telling = None

    async def close(self) -> None:
        if self._telling is not None:
            self._telling.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._fp or self._failed:
            with contextlib.suppress(OSError, ConnectionError):
                await self._tell({"op": "served", "fp": self._fp, "failed": self._failed})
        self._fp, self._failed = [], 0
