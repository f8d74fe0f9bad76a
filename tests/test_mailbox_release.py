"""A released job's mailbox fails every value, also those asked for after the release (``fail_all`` is
sticky): with ``--sandbox off``, a step still computing a stretch when its job was cancelled asked for
its next value afterwards and waited for ever, keeping the job's tensors (GBs) in the daemon."""

from __future__ import annotations

import asyncio

import pytest

from fusionnet.dag.channel import Mailbox
from fusionnet.errors import JobError

pytestmark = pytest.mark.timeout(10)


def test_values_asked_for_after_the_release_fail_at_once() -> None:
    async def scenario() -> None:
        box = Mailbox()
        waiting = asyncio.ensure_future(box.take(0, ("act", 1, 0, "x")))
        await asyncio.sleep(0)  # (lets it reach its slot: no timing involved)
        box.fail_all(JobError("job j was released: the job was cancelled"))
        with pytest.raises(JobError, match="released"):
            await waiting
        with pytest.raises(JobError, match="released"):  # asked for later: at once, not for ever
            await asyncio.wait_for(box.take(1, ("grad", 1, 0, "y")), 5)
        assert not box.deliver(0, ("act", 1, 1, "z"), 1)  # a late value parks nothing
        assert box.duplicates_dropped == 1

    asyncio.run(scenario())
