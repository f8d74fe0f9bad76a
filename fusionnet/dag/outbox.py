"""The executor's sends in flight: started on the event loop without being awaited (the next micro-batch
computes while the last one's outputs travel), awaited together at the end of the step; a send that
fails ends the step at its next receive."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Outbox:
    """Sends in flight for one step: started on the loop, awaited together at the end of the step."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Future[None] | None = None
        self._fresh = False  # a send started and not yet let go (``let_go``)

    def reset(self) -> None:
        self.cancel()
        self._failed = asyncio.get_running_loop().create_future()

    def start(self, send: Awaitable[None]) -> None:
        task = asyncio.ensure_future(send)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        self._fresh = True

    async def let_go(self) -> None:
        """Lets sends started since the last call run on the loop up to their first real wait, which is
        after their bytes went into the socket (a non-blocking write of a frame returns at once when it
        fits the socket's buffer). Called before each compute stretch: on a machine whose cores the
        compute threads fill, a send left for later would otherwise wait for a core (and the GIL) until
        the next stretch ends, and the peer that waits for it would idle that long."""
        if self._fresh:
            self._fresh = False
            await asyncio.sleep(0)

    def idle(self) -> bool:
        """Whether every send started is done (its bytes in the kernel, or failed)."""
        return all(task.done() for task in self._tasks)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def guard(self, receive: Awaitable[T]) -> T:
        """Awaits ``receive``, or raises the error of a send that failed meanwhile (no peer would
        answer a step whose data never left)."""
        failed = self._failed
        if failed is None:
            return await receive
        if failed.done():
            failed.result()
        waiting = asyncio.ensure_future(receive)
        try:
            await asyncio.wait({waiting, failed}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the step was cancelled: the receive goes with it
            waiting.cancel()
            raise
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            failed.result()
        return waiting.result()

    async def drain(self) -> None:
        """Waits for every send; raises the first failure."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
        if self._failed is not None and self._failed.done():
            self._failed.result()

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._tasks.clear()
        failed = self._failed
        if failed is not None and not failed.done():
            failed.cancel()
        elif failed is not None and not failed.cancelled():
            failed.exception()  # retrieved: no "exception was never retrieved" warning
