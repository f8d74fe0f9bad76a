"""``schedule_loop.together``: a device's sub-DAGs' step phases awaited together, a single one in place."""

from __future__ import annotations

import asyncio

import pytest

from fusionnet.dag.schedule_loop import together


def test_one_call_runs_in_the_callers_task_several_concurrently_in_order() -> None:
    async def main() -> None:
        caller = asyncio.current_task()

        async def whose() -> asyncio.Task[object] | None:
            return asyncio.current_task()

        assert await together([whose()]) == [caller]  # no task of its own: no turns of the loop

        started: list[int] = []
        all_started, release = asyncio.Event(), asyncio.Event()

        async def wait_then(i: int) -> int:
            started.append(i)
            if len(started) == 3:
                all_started.set()
            await release.wait()  # every call must have started before any can finish
            return i * 10

        gathered = asyncio.ensure_future(together([wait_then(i) for i in range(3)]))
        await asyncio.wait_for(all_started.wait(), 5)  # one at a time would never start the second
        assert not gathered.done()
        release.set()
        assert await gathered == [0, 10, 20]

    asyncio.run(main())


@pytest.mark.parametrize("count", [1, 3])
def test_a_failure_is_raised(count: int) -> None:
    async def fails(i: int) -> int:
        if i == count - 1:
            raise RuntimeError(f"call {i} failed")
        return i

    async def main() -> None:
        with pytest.raises(RuntimeError, match=f"call {count - 1} failed"):
            await together([fails(i) for i in range(count)])

    asyncio.run(main())
