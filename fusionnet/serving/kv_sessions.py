"""Generation with KV caches on the compnodes (issue 14): cache slots and the per-session decode loop.

A deployment traced as ``job.kv_decode.SlotDecoder`` takes rows ``(token, position, slot)`` and answers
each with the logits of that token, after writing its keys and values at ``(slot, position)`` of the
caches held by the compnodes of the layers. A session (one choice of a request) holds one slot from
``SlotPool`` for its lifetime. Its prompt goes in at once, a row per token in one request (prefill: in
each layer every row's keys and values are written before any row reads its slot, and each row sees
positions up to its own, so this is the causal forward pass of the whole prompt; a prompt longer than a
batch is cut into batches that run in order); then it feeds one row per token it samples. The rows of
all live sessions share the batcher, so every batch carries the sessions' next tokens wherever each one
is (continuous batching at iteration level). Each row is asked for before the token that made it is
handed on (``generation.ask_ahead``), and taken back if the session stops there.

Placements and caches. Caches live only on the compnodes of the placement that filled them. Every row
is sent with the placement number ("epoch") its session's cache was built on; a batch carrying a row of
another placement is refused with ``StaleRows`` before it runs, and a batch whose placement fails (the
deployment places itself again) with ``CacheLost``. A session that gets ``CacheLost``, or ``StaleRows``
for its own rows, replays its tokens from position 0 on the current placement (without sampling again:
the tokens are known), then goes on; the computation is the same, so the output is the same as without
the failure. A session whose rows were current and only rode with another's stale row asks them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch

from fusionnet.errors import ExecutionError
from fusionnet.serving.answers import Answer, Overloaded, Submit
from fusionnet.serving.generation import ask_ahead, needs_logits, next_of, withdraw
from fusionnet.serving.sampling import SamplingParams, generator_for

REPLAYS = 3  # placements a session may lose its cache on before it fails


class CacheLost(ExecutionError):
    """The session's cache is not on the current placement (a compnode was lost): replay."""


class StaleRows(CacheLost):
    """The batch was refused before it ran: a row in it was asked on an older placement. A session whose
    own rows were asked on the current one lost nothing and asks them again, without a replay; counted as
    one, the rows another session left queued across a failover could use up a session's replays."""


class SlotPool:
    """``slots`` cache slots; a session waits for a free one, at most ``waiting`` sessions wait."""

    def __init__(self, slots: int, waiting: int, on_change: Callable[[int], None] | None = None) -> None:
        """``on_change(in_use)`` after every slot taken or given back (the metrics' gauge: a batch's
        report alone would leave it at its last batch's count once the sessions ended)."""
        self.slots = slots
        self.waiting_limit = waiting
        self.on_change = on_change
        self._free = list(range(slots))
        self._changed = asyncio.Condition()
        self.waiting = 0

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def _changed_use(self) -> None:
        if self.on_change is not None:
            self.on_change(self.in_use)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[int]:
        async with self._changed:
            if not self._free and self.waiting >= self.waiting_limit:
                raise Overloaded(f"all {self.slots} KV-cache slots are busy and {self.waiting} sessions wait")
            self.waiting += 1
            try:
                await self._changed.wait_for(lambda: bool(self._free))
            finally:
                self.waiting -= 1
            slot = self._free.pop(0)
        self._changed_use()
        try:
            yield slot
        finally:
            async with self._changed:
                self._free.append(slot)
                self._changed_use()
                # every waiter, not one: on Python 3.11 a waiter notified and cancelled in the same turn
                # (its client left) swallows the notification, and the next waiter would sleep on
                # beside a free slot; each re-checks ``_free`` and at most one takes it
                self._changed.notify_all()


async def score_cached(
    submit: Submit, slots: SlotPool, epoch: Callable[[], int], tokens: list[int]
) -> torch.Tensor:
    """The logits at every position of ``tokens`` (``/v1/infer`` on a KV-cached deployment): one prefill
    in a slot of its own, run again from scratch if the placement changes meanwhile."""
    async with slots.session() as slot:
        rows = torch.tensor([[t, p, slot] for p, t in enumerate(tokens)], dtype=torch.long)
        for attempt in range(REPLAYS + 1):
            try:
                return await submit(rows, [epoch()] * len(rows))
            except CacheLost:
                if attempt == REPLAYS:
                    raise
    raise AssertionError("unreachable")


async def generate_cached(
    submit: Submit,
    slots: SlotPool,
    epoch: Callable[[], int],
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    seed: int | None,
    choice: int,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> AsyncIterator[int]:
    """The generated token ids, one at a time (``generation.check_prompt`` must have passed);
    ``on_logits`` sees the logits each one was sampled from, just before it comes."""
    generator = generator_for(seed, choice)
    tokens = list(prompt)
    produced = 0
    need = needs_logits(params, on_logits)
    async with slots.session() as slot:
        position, built_on, replays = 0, epoch(), 0

        def ask() -> asyncio.Future[Answer]:
            # the tokens the cache lacks: the whole prompt (or everything, after a lost cache), then one
            rows = torch.tensor(
                [[tokens[p], p, slot] for p in range(position, len(tokens))], dtype=torch.long
            )
            # only the last row's answer is read: the others' outputs are not sent (``keep``)
            keep = [False] * (len(rows) - 1) + [need]
            return ask_ahead(submit, rows, [built_on] * len(rows), keep)

        pending = ask() if max_tokens > 0 else None
        try:
            while pending is not None:
                try:
                    answer = await pending
                except CacheLost as e:
                    # refused unrun for another session's stale row: nothing of ours ran, and our rows
                    # stand on this placement; ask them again. Otherwise our cache is gone: replay.
                    if not (isinstance(e, StaleRows) and built_on == epoch()):
                        replays += 1
                        if replays > REPLAYS:
                            raise
                        position, built_on = 0, epoch()  # fill the cache again on this placement
                    pending = ask()
                    continue
                position = len(tokens)
                token = next_of(answer, need, params, generator, tokens, len(prompt), on_logits)
                tokens.append(token)
                produced += 1
                # the next row goes to the batcher before the token is handed on (``ask_ahead``)
                pending = ask() if produced < max_tokens else None
                yield token
        finally:
            # a row asked ahead and not read: withdrawn before the slot is free. One a batch already
            # took writes its keys at a position past the session's tokens, which a later holder of
            # the slot writes again before any row of it reads that far (rows read their own
            # positions and earlier ones only).
            withdraw(pending)
