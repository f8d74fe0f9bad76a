"""Calls kept a few at a time in flight: the chunks of one transfer, the sub-DAGs of one collection.

One call after the other leaves the link idle while each side prepares its next part (a chunk's trip
through p2pd, its decoding and its write); all at once would hold every part in memory. A window of a
few overlaps the trips and bounds the memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def gather(calls: list[Awaitable[T]]) -> list[T]:
    """All calls, or the first failure (the rest are cancelled: a compnode whose call is cancelled gets
    a release, a transfer's other chunks stop)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def in_window(work: Callable[[T], Awaitable[R]], items: Iterable[T], window: int) -> list[R]:
    """``work(item)`` for every item, at most ``window`` at once, results in order; ``gather``'s way
    with a failure."""
    gate = asyncio.Semaphore(window)

    async def one(item: T) -> R:
        async with gate:
            return await work(item)

    return await gather([one(item) for item in items])
