"""Dynamic batching with a bounded wait, a bounded queue and several batches in flight.

Requests bring rows (samples); the batcher packs the rows of whatever requests are waiting into a batch
of at most ``max_batch`` rows, waiting at most ``max_wait`` seconds after the first row for more (only
while another batch is in the pipeline: an idle one takes what is there at once), and
keeps up to ``in_flight`` batches in the pipeline at once: while batch ``k`` is in the last sub-DAG,
batch ``k + 1`` already runs in the first one, so throughput approaches the bottleneck stage (FusionAI
eq. (4)) rather than the whole pipeline's latency (eq. (3)).

A caller that asks again right after each answer (a generating session: its next token's row) takes its
``submit`` from ``caller()``. Between an answer and its next rows such a caller is "away", and a
pipeline with nothing in it waits for the away callers instead of running the first row that comes back
alone: the sessions of one batch come back a few event-loop turns apart (each samples its token first),
and without the wait they would split into batches of one or two rows, each paying a batch's whole fixed
cost. A session queues its next row (``enqueue``) before it hands its token to its stream, so the next
batch starts before the streams write their chunks. The wait lasts at most a batch's time (measured), or
``max_wait`` if longer; a caller that once does not come back in that time (a stalled stream) is not
waited for again. And while batches run, another goes beside them only when the live sessions cannot all
ride in the running ones (more sessions than ``max_batch`` per running batch): 16 sessions and
``max_batch`` 16 make one full batch at a time, not two half ones.

Overload is answered, never queued without bound: when more than ``queue_limit`` rows wait,
``submit`` raises ``Overloaded`` at once (the HTTP layer answers 503). The limit admits new work; a
session already admitted (a caller whose rows got in once) keeps going: its next token's row is queued
beyond the limit, since refusing it would end a generation half-way. Such rows stay bounded, one per
live session at a time (a session's replay after a lost cache: its tokens so far). The sessions of one
request (several prompts, ``n`` choices) are admitted as one (``caller(group)``): were each admitted
alone, the first one's prompt would count as waiting rows against its sibling's, and a request whose
prompts together exceed the limit would get a 503 on an idle deployment, every time. A request larger than
the limit itself could never get in, and is refused as ``Oversized`` (HTTP 400), not as a busy queue that
a retry might find free. A request larger than ``max_batch`` rows is cut into several batches and joined
again.

A request may say which of its rows' outputs it needs (``keep``): the others are answered with the
argmax of their output only (``RowAnswers``), computed where the output is. A greedy session needs its
next token, not a row of logits (200 kB for GPT-2's vocabulary), and a prompt's prefill needs nothing
of its rows but the last; the bytes not sent were most of what crossed the last hop per batch.

One request's bad rows fail only that request: a batch that fails with ``RowsFailed`` (the model
itself raised on its rows: an index out of range, say) is run again one request at a time, so the
requests batched with the culprit get their outputs and the culprit gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial

import torch

from fusionnet.serving.answers import (
    Answer,
    Closed,
    Overloaded,
    Oversized,
    RowsFailed,
    RunBatch,
    Submit,
    joined,
    part_of,
)

log = logging.getLogger("fusionnet.serving")


@dataclass
class _Item:
    rows: torch.Tensor
    pick: list[int] | None
    future: asyncio.Future[Answer]
    keep: list[bool] | None = None  # None: every row's output (the answer is a tensor)
    caller: object | None = None  # a ``caller()`` handle: it will ask again once answered
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class BatchStats:
    """What the metrics read after each batch (``on_batch``): rows, seconds queued, seconds run."""

    rows: int
    waited: float
    seconds: float
    missed: int = 0  # sessions the collector waited for in vain before this batch (never waited again)
    failed: bool = False  # its requests got an error (or were run again one by one): no served batch


class DynamicBatcher:
    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch: int,
        max_wait: float,
        queue_limit: int,
        in_flight: int = 2,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        if max_batch < 1 or queue_limit < 1 or in_flight < 1 or max_wait < 0:
            raise ValueError("max_batch, queue_limit and in_flight must be >= 1 and max_wait >= 0")
        self.run_batch = run_batch
        self.max_batch, self.max_wait, self.queue_limit = max_batch, max_wait, queue_limit
        self.in_flight = in_flight
        self.on_batch = on_batch
        self._queue: list[_Item] = []
        self._queued_rows = 0
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(in_flight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0  # batches in the pipeline (a task stays in ``_tasks`` a little longer)
        self._away: set[object] = set()  # callers answered whose next rows are not in yet
        self._slow: set[object] = set()  # callers once waited for in vain: never waited for again
        self.away_timeouts = 0  # batches that waited for callers that did not come back in time
        self._missed = 0  # callers given up on since the last batch's stats
        self._callers = 0  # ``caller()`` blocks open: the live sessions
        self._admitted: set[object] = set()  # callers whose rows got in once: queued past the limit
        # A request's sessions (its prompts, its ``n`` choices) are admitted as one: once the first is
        # in, its siblings' rows get in too, so they never refuse each other (``caller(group)``).
        self._group_of: dict[object, object] = {}  # caller -> its request
        self._group_callers: dict[object, int] = {}  # request -> its callers open
        self._admitted_groups: set[object] = set()
        # a moving average of a batch's wall time: how long the away callers are waited for
        self._batch_seconds = 0.0
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def queued_rows(self) -> int:
        self._purge()
        return self._queued_rows

    def _purge(self) -> None:
        """Drops the queued requests whose clients went away (their futures cancelled): their rows no
        longer count against the limit, nor in the queue depth the metrics show."""
        if any(i.future.done() for i in self._queue):
            self._queue[:] = [i for i in self._queue if not i.future.done()]
            self._queued_rows = sum(int(i.rows.shape[0]) for i in self._queue)

    @property
    def running(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._collect(), name="batcher")

    async def close(self) -> None:
        """Fails whatever waits with ``Closed`` and stops the batches in flight."""
        self._closed = True
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(Closed("the deployment was undeployed"))
        self._queue.clear()
        self._queued_rows = 0
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @asynccontextmanager
    async def caller(self, group: object | None = None) -> AsyncIterator[Submit]:
        """A ``submit`` for one caller that submits again as soon as it has each answer, until the block
        ends; an idle pipeline waits for it meanwhile (see the module's text). Callers of one ``group``
        (the sessions of one request) are admitted together: the first one's rows face the queue's
        limit, its siblings' then get in whatever waits (a request's rows are bounded by its own size)."""
        handle = object()
        self._callers += 1
        if group is not None:
            self._group_of[handle] = group
            self._group_callers[group] = self._group_callers.get(group, 0) + 1
        try:
            yield partial(self.enqueue, caller=handle)
        finally:
            self._callers -= 1
            self._admitted.discard(handle)
            if group is not None:
                del self._group_of[handle]
                self._group_callers[group] -= 1
                if not self._group_callers[group]:
                    del self._group_callers[group]
                    self._admitted_groups.discard(group)
            self._arrived.set()  # fewer sessions: a held batch may now go
            self._slow.discard(handle)
            if handle in self._away:
                self._away.discard(handle)
                self._arrived.set()  # the collector may be waiting for it

    async def submit(
        self,
        rows: torch.Tensor,
        pick: list[int] | None = None,
        keep: list[bool] | None = None,
        *,
        caller: object | None = None,
    ) -> Answer:
        """The outputs for ``rows`` (one per row, in order), or with ``keep`` (one flag per row) their
        ``RowAnswers``; ``Overloaded`` when the queue is full."""
        return await self.enqueue(rows, pick, keep, caller=caller)

    def enqueue(
        self,
        rows: torch.Tensor,
        pick: list[int] | None = None,
        keep: list[bool] | None = None,
        *,
        caller: object | None = None,
    ) -> asyncio.Future[Answer]:
        """``submit``, with the rows queued now, before this returns: the future of their answer.
        Cancelling it withdraws rows no batch has taken yet (a batch running them drops the answer).

        Why: a session asks for its next token's row this way before it hands the last token on, so
        the batch that row completes can start before the streams write their chunks
        (``generation.ask_ahead``)."""
        self._away.discard(caller)
        if self._closed:
            raise Closed("the deployment was undeployed")
        n = int(rows.shape[0])
        if keep is not None and len(keep) != n:
            raise ValueError(f"keep: {len(keep)} flags for {n} rows")
        if caller not in self._admitted:  # new work; an admitted session's next rows always get in
            if n > self.queue_limit:
                raise Oversized(
                    f"the request needs {n} rows at once (a prompt's tokens, or samples), more than this "
                    f"deployment queues (deploy --queue-limit {self.queue_limit})"
                )
            group = self._group_of.get(caller)
            if group is None or group not in self._admitted_groups:  # a sibling admitted: it is in
                if self._queued_rows + n > self.queue_limit:
                    self._purge()  # the rows of clients that went away leave only when a batch is taken
                if self._queued_rows + n > self.queue_limit:
                    raise Overloaded(f"{self._queued_rows} rows already wait (limit {self.queue_limit})")
                if group is not None:
                    self._admitted_groups.add(group)
            if caller is not None:
                self._admitted.add(caller)
        loop = asyncio.get_running_loop()
        futures = []
        for start in range(0, n, self.max_batch):  # a big request: several batches, joined again
            stop = min(n, start + self.max_batch)
            picked = None if pick is None else pick[start:stop]
            kept = None if keep is None else keep[start:stop]
            item = _Item(rows[start:stop], picked, loop.create_future(), kept, caller if stop == n else None)
            self._queue.append(item)
            self._queued_rows += stop - start
            futures.append(item.future)
        self._arrived.set()
        if len(futures) == 1:
            return futures[0]
        return asyncio.ensure_future(joined(futures, keep is not None))

    # ---- the collector -------------------------------------------------------------------------
    async def _collect(self) -> None:
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._slots.acquire()  # a free pipeline slot first: rows keep gathering meanwhile
            if not self._queue:  # emptied while we waited (``_purge``: its clients went away)
                self._slots.release()
                continue
            # A busy pipeline waits up to ``max_wait`` after the oldest row for the batch to fill. Callers
            # coming back from the last batch are waited for up to a batch's time: a batch run without them
            # would cost them a whole batch more. An idle pipeline with nobody away runs what is there.
            # While batches run, another goes beside them only if the live sessions cannot all ride in the
            # running ones; otherwise its rows wait for them to come back and go together (compnodes run
            # batches in order, so the wait costs the overlap only, and one full batch costs less than
            # two half ones wherever a batch has a fixed cost).
            fill_until = self._queue[0].queued_at + self.max_wait
            away_until = 0.0  # set when callers are first seen away (after a held batch came back)
            while self._rows_waiting() < self.max_batch:
                if not self._away and self._running and 0 < self._callers <= self.max_batch * self._running:
                    self._arrived.clear()
                    await self._arrived.wait()  # a batch ends, a session ends, or rows come
                    continue
                if self._away and not away_until:
                    away_until = time.monotonic() + max(self.max_wait, self._batch_seconds)
                until = away_until if self._away else fill_until if self._running else 0.0
                if time.monotonic() >= until:
                    if self._away:  # a stalled stream must not hold every batch back: not again
                        self.away_timeouts += 1
                        self._missed += len(self._away)
                        self._slow |= self._away
                        self._away.clear()
                    break
                self._arrived.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), until - time.monotonic())
            batch = self._take()
            if not batch:
                self._slots.release()
                continue
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._run(batch), name="batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _rows_waiting(self) -> int:
        return sum(int(i.rows.shape[0]) for i in self._queue if not i.future.done())

    def _take(self) -> list[_Item]:
        """Whole requests (never split here) up to ``max_batch`` rows, oldest first, all of one kind:
        rows that pick one position each, or rows that want every position (``pick`` None: ``/v1/infer``,
        an echoed prompt). Those of the other kind keep their place for the next batch: a batch's output
        has one shape, and a whole-row request in a picked batch would get one position's output."""
        batch: list[_Item] = []
        rest: list[_Item] = []
        rows, full = 0, False
        for item in self._queue:
            n = int(item.rows.shape[0])
            if item.future.done():  # its client went away
                self._queued_rows -= n
                continue
            full = full or bool(batch and rows + n > self.max_batch)
            if full or (batch and (item.pick is None) != (batch[0].pick is None)):
                rest.append(item)
                continue
            batch.append(item)
            rows += n
            self._queued_rows -= n
        self._queue[:] = rest
        return batch

    async def _run(self, batch: list[_Item]) -> None:
        started = time.monotonic()
        n_rows = sum(int(i.rows.shape[0]) for i in batch)
        failed = True
        try:
            rows = torch.cat([i.rows for i in batch])
            picks = None if batch[0].pick is None else [p for i in batch for p in i.pick or ()]
            keep = _keep_of(batch)
            out = await self._run_rows(rows, picks, keep)
            failed = False
            took = time.monotonic() - started
            self._batch_seconds = took if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * took
            offset = 0
            for item in batch:
                n = int(item.rows.shape[0])
                if not item.future.done():
                    item.future.set_result(part_of(out, offset, offset + n, keep, item.keep is not None))
                    if item.caller is not None and item.caller not in self._slow:
                        self._away.add(item.caller)
                offset += n
        except asyncio.CancelledError:
            _fail(batch, Closed("the deployment was undeployed"))
            raise
        except RowsFailed as e:
            if len(batch) == 1:
                _fail(batch, e)
            else:
                log.info("batch of %d requests failed on its rows (%s): each runs alone", len(batch), e)
                await self._run_apart(batch)
        except Exception as e:
            log.warning("batch of %d requests failed: %s", len(batch), e)
            _fail(batch, e)
        finally:
            self._running -= 1
            self._slots.release()
            self._arrived.set()  # a collector waiting on this batch's callers looks again
        if self.on_batch is not None:
            waited = started - min(i.queued_at for i in batch)
            missed, self._missed = self._missed, 0
            self.on_batch(BatchStats(n_rows, waited, time.monotonic() - started, missed, failed))

    def _run_rows(
        self, rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None
    ) -> Awaitable[Answer]:
        """``run_batch``, given ``keep`` only when some request asked (a ``run_batch`` may not take it)."""
        return self.run_batch(rows, pick) if keep is None else self.run_batch(rows, pick, keep)

    async def _run_apart(self, batch: list[_Item]) -> None:
        """Each request of a batch that failed on its rows, alone (in this batch's pipeline slot)."""
        for item in batch:
            if item.future.done():
                continue
            try:
                out = await self._run_rows(item.rows, item.pick, item.keep)
            except asyncio.CancelledError:
                _fail(batch, Closed("the deployment was undeployed"))
                raise
            except Exception as e:
                if not item.future.done():  # its client may have gone while it ran
                    item.future.set_exception(e)
            else:
                if not item.future.done():
                    item.future.set_result(out)


def _keep_of(batch: list[_Item]) -> list[bool] | None:
    """The batch's ``keep`` flags: None when no request gave any (every output is sent, as before)."""
    if all(i.keep is None for i in batch):
        return None
    return [k for i in batch for k in (i.keep if i.keep is not None else [True] * int(i.rows.shape[0]))]


def _fail(batch: list[_Item], error: BaseException) -> None:
    """``error`` to every request of ``batch`` still waiting for its answer."""
    for item in batch:
        if not item.future.done():
            item.future.set_exception(error)
