"""``JobCalls.stage_and_assign``: each compnode sets its sub-DAG up while the next slice is staged to
another; bounded, in order per compnode, and the first failure stops it and cancels the rest."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.broker.assignment_payloads import PreparedAssignment
from fusionnet.broker.job_calls import JobCalls
from fusionnet.errors import FusionNetError

pytestmark = pytest.mark.timeout(30)


class _Stream:
    """A slice of ``total`` bytes in parts (``results.slice_stream.SliceStream``'s interface)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def parts(self, size: int) -> Any:
        for offset in range(0, self.total, size):
            yield b"x" * min(size, self.total - offset)


class _Client:
    """Records every call; an assign waits until the test lets it finish (or fail)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.release: dict[int, asyncio.Future[None]] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.cancelled: list[int] = []

    def finish(self, subdag: int, error: Exception | None = None) -> None:
        future = self.release.setdefault(subdag, asyncio.get_running_loop().create_future())
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    async def call_stage_state(self, peer: str, part: Any, timeout: float) -> None:
        self.events.append(("stage", part.subdag))

    async def call_assign(self, peer: str, request: Any, timeout: float) -> None:
        self.events.append(("assign", request.subdag))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        future = self.release.setdefault(request.subdag, asyncio.get_running_loop().create_future())
        try:
            await future
        except asyncio.CancelledError:
            self.cancelled.append(request.subdag)
            raise
        finally:
            self.in_flight -= 1
        self.events.append(("assigned", request.subdag))


def _preparer(count: int, staged_bytes: int = 10) -> Any:
    made = iter(range(count))

    async def prepare() -> PreparedAssignment:
        subdag = next(made)
        request = SimpleNamespace(attempt=1, subdag=subdag)
        return PreparedAssignment(request=request, staged={"state": _Stream(staged_bytes)})  # type: ignore[arg-type]

    return prepare


def _start(peers: list[str], part_bytes: int, **window: int) -> tuple[_Client, asyncio.Task[None]]:
    """``stage_and_assign`` of one sub-DAG per entry of ``peers`` against a fake client, running."""
    client = _Client()
    calls = JobCalls(client, "job")  # type: ignore[arg-type]
    prepare = _preparer(len(peers))
    return client, asyncio.create_task(calls.stage_and_assign(peers, prepare, part_bytes, **window))


async def _quiet() -> None:
    """Lets every runnable task run until it waits (the fake calls never wait on time)."""
    for _ in range(100):
        await asyncio.sleep(0)


async def _until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


def test_the_next_slices_are_staged_while_a_compnode_sets_up() -> None:
    async def main() -> None:
        client, run = _start(["a", "b", "c"], part_bytes=4)
        # Every slice is staged (3 parts each) and every assign sent before the first one has ended.
        await _until(lambda: client.in_flight == 3)
        assert [e for e in client.events if e[0] == "stage"] == [
            ("stage", s) for s in (0, 0, 0, 1, 1, 1, 2, 2, 2)
        ]
        assert not run.done()
        for subdag in (2, 0, 1):
            client.finish(subdag)
        await run
        assert sorted(e for e in client.events if e[0] == "assigned") == [("assigned", s) for s in (0, 1, 2)]

    asyncio.run(main())


def test_at_most_a_window_of_assigns_is_in_flight() -> None:
    async def main() -> None:
        client, run = _start([f"p{i}" for i in range(6)], part_bytes=100, window=2)
        await _until(lambda: client.in_flight == 2)
        await _quiet()  # nothing more may start while the window is full
        assert client.events[-1] == ("assign", 1) and ("stage", 2) not in client.events
        for subdag in range(6):
            client.finish(subdag)
            await _until(lambda s=subdag: ("assigned", s) in client.events)
        await run
        assert client.most_in_flight == 2

    asyncio.run(main())


def test_a_compnode_with_several_sub_dags_gets_them_one_after_the_other() -> None:
    async def main() -> None:
        client, run = _start(["a", "b", "a"], part_bytes=100)
        await _until(lambda: client.in_flight == 2)
        await _quiet()
        assert ("stage", 2) not in client.events  # sub-DAG 2 is a's too: it waits for a's first assign
        client.finish(0)
        await _until(lambda: ("assign", 2) in client.events)
        assert client.events.index(("assigned", 0)) < client.events.index(("stage", 2))
        client.finish(1)
        client.finish(2)
        await run

    asyncio.run(main())


def test_a_failed_assign_stops_the_staging_and_cancels_the_rest() -> None:
    async def main() -> None:
        client, run = _start([f"p{i}" for i in range(5)], part_bytes=100, window=2)
        await _until(lambda: client.in_flight == 2)
        client.finish(0, FusionNetError("the worker could not start"))
        with pytest.raises(FusionNetError, match=r"compnode p0 \(assign\): the worker could not start"):
            await run
        assert client.cancelled == [1]  # the assign in flight beside it is called off
        assert ("stage", 2) not in client.events  # and nothing more was sent

    asyncio.run(main())
