"""The message-passing interface between sub-DAG executors (FusionAI section 3.6, "Message passing").

An executor only ever calls ``send(dst, key, value)`` (or ``send_values`` for several values to one
sub-DAG) and ``await recv(src, key)``. The key names
the message completely, ``(kind, step, microbatch, node)`` with kind ``act`` (FP data) or ``grad``
(BP data), so delivery is idempotent: a duplicate (a retry, a late message from a replaced node)
for a key that was already delivered is dropped instead of corrupting a step.

``LocalHub`` connects executors living in one process (``fusionnet run --local``); the network
implementation used by compnodes lives in ``fusionnet.compnode`` and has the same interface.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

MessageKey = tuple[str, int, int, str]  # (kind, step, microbatch, node name)


class Channel(ABC):
    """One executor's end of the message fabric."""

    @abstractmethod
    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        """Delivers ``value`` to sub-DAG ``dst``. Returns once it is handed to the transport."""

    @abstractmethod
    async def recv(self, src: int, key: MessageKey) -> Any:
        """Waits for the message ``key`` from sub-DAG ``src``."""

    def arrived(self, src: int, key: MessageKey) -> bool:
        """Whether ``recv(src, key)`` would return at once. A channel that cannot tell says False: the
        schedule loop then runs a deferred weight-gradient half before waiting (``run_device_step``)."""
        return False

    async def send_values(self, dst: int, items: Sequence[tuple[MessageKey, Any]]) -> None:
        """Several values to ``dst`` at once (an FP's outputs that ``dst`` reads). One send each here; a
        network channel carries them in one frame (``compnode.netchannel``)."""
        for key, value in items:
            await self.send(dst, key, value)


# How many steps beyond the current one a message may be for. A job's executors advance step by step, so
# a peer is at most one step ahead; a deployment keeps up to ``MAX_IN_FLIGHT`` batches (its steps) in the
# pipeline, so the first stage may be that many ahead of the last. Anything further is a replay or a
# forgery that would otherwise park a value nobody takes (parked bytes are bounded besides).
MAX_IN_FLIGHT = 4
MAX_STEPS_AHEAD = MAX_IN_FLIGHT


class Mailbox:
    """Futures keyed by (src, key); the first value for a key wins, later duplicates are dropped.

    Once ``forget_step(s)`` has been called, messages of steps before ``s`` (stale) and after
    ``s + MAX_STEPS_AHEAD`` are dropped too, so no message can park a slot that nobody will take.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[int, MessageKey], asyncio.Future[Any]] = {}
        self._taken: set[tuple[int, MessageKey]] = set()
        self.duplicates_dropped = 0
        self.unexpected_dropped = 0
        self.floor: int | None = None  # the current step, once the executor has said it
        self.failed: BaseException | None = None  # ``fail_all``'s error: every later take gets it too

    def expects(self, key: MessageKey) -> bool:
        """Whether a message with this key could still be taken (its step is current or near)."""
        step = key[1]
        return self.floor is None or self.floor <= step <= self.floor + MAX_STEPS_AHEAD

    def _slot(self, src: int, key: MessageKey) -> asyncio.Future[Any]:
        slot = self._slots.get((src, key))
        if slot is None:
            slot = asyncio.get_running_loop().create_future()
            if self.failed is not None:  # the job was released: a value asked for now never comes
                slot.set_exception(self.failed)
                slot.add_done_callback(lambda f: f.exception())  # retrieved even if nobody takes it
            self._slots[(src, key)] = slot
        return slot

    def deliver(self, src: int, key: MessageKey, value: Any) -> bool:
        """Stores a message; returns False (and drops it) when that key was already delivered."""
        if (src, key) in self._taken:
            self.duplicates_dropped += 1
            return False
        if not self.expects(key):
            self.unexpected_dropped += 1
            return False
        slot = self._slot(src, key)
        if slot.done():
            self.duplicates_dropped += 1
            return False
        slot.set_result(value)
        return True

    def arrived(self, src: int, key: MessageKey) -> bool:
        """Whether the message is here (or has failed): ``take`` would not wait."""
        slot = self._slots.get((src, key))
        return slot is not None and slot.done()

    async def take(self, src: int, key: MessageKey) -> Any:
        slot = self._slot(src, key)
        try:
            return await slot
        finally:
            # Remember the key so a late duplicate is recognised, and free the value's memory.
            self._slots.pop((src, key), None)
            self._taken.add((src, key))

    def forget_step(self, step: int) -> None:
        """Drops bookkeeping of a finished step (keys of older steps can no longer be confused)."""
        self._taken = {k for k in self._taken if k[1][1] >= step}
        self.floor = step if self.floor is None else max(self.floor, step)
        # values delivered for older steps that nobody took (and nobody waits for) are freed
        for slot_key in [k for k, f in self._slots.items() if k[1][1] < self.floor and f.done()]:
            del self._slots[slot_key]

    def refuse(self, src: int, key: MessageKey, error: BaseException) -> None:
        """The value for ``key`` will never come (its frame was refused): whoever takes it gets ``error``."""
        if (src, key) in self._taken or not self.expects(key):
            return
        slot = self._slot(src, key)
        if not slot.done():
            slot.set_exception(error)
            slot.add_done_callback(lambda f: f.exception())  # retrieved even if nobody takes it

    def fail_all(self, error: BaseException) -> None:
        """Every value waited for, and every one asked for later, fails with ``error``: a step still
        computing a stretch when its job is released asks for its next value after this, and would
        otherwise wait for ever, holding the job's tensors (hundreds of MB) in the daemon."""
        self.failed = error
        for slot in self._slots.values():
            if not slot.done():
                slot.set_exception(error)
                slot.add_done_callback(lambda f: f.exception())


class LocalHub:
    """In-process fabric for N executors: ``hub.channel(i)`` is executor i's end."""

    def __init__(self, size: int) -> None:
        self.mailboxes = [Mailbox() for _ in range(size)]

    def channel(self, index: int) -> Channel:
        return _LocalChannel(self, index)


class _LocalChannel(Channel):
    def __init__(self, hub: LocalHub, index: int) -> None:
        self.hub = hub
        self.index = index

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        self.hub.mailboxes[dst].deliver(self.index, key, value)

    async def recv(self, src: int, key: MessageKey) -> Any:
        return await self.hub.mailboxes[self.index].take(src, key)

    def arrived(self, src: int, key: MessageKey) -> bool:
        return self.hub.mailboxes[self.index].arrived(src, key)
