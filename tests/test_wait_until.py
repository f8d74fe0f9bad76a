"""``runtime.processes.wait_until``: the tests' readiness wait (pure, no processes)."""

from __future__ import annotations

import pytest

from fusionnet.rpc.protocol import RPCError
from fusionnet.runtime.processes import wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_poll_whose_call_fails_is_a_not_yet_and_other_errors_still_raise() -> None:
    polls = iter([RPCError("stream closed early"), RPCError("again"), None, "ready"])

    def condition() -> str | None:
        item = next(polls)
        if isinstance(item, BaseException):
            raise item
        return item

    assert wait_until(condition, 10, "ready", interval=0.0) == "ready"

    def broken() -> None:
        raise ValueError("a bug, not a busy machine")

    with pytest.raises(ValueError, match="a bug"):
        wait_until(broken, 10, "never")

    def failing() -> None:
        raise RPCError("no answer")

    with pytest.raises(TimeoutError, match=r"waiting for status \(last poll: RPCError: no answer\)"):
        wait_until(failing, 0.05, "status", interval=0.01)
