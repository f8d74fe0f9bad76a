"""The submitter's job control without a swarm: which compnodes count as ready, the bounded wait for
them (message, fewer after the deadline, none refused), and the commands' JOB_ID check."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest

from fusionnet.cli.main import main
from fusionnet.errors import ExecutionError
from fusionnet.messages.broker_rpc import StatusReply
from fusionnet.runtime.jobcontrol import ready_compnodes, wait_for_compnodes


def node(state: str = "ONLINE", data: str | None = "127.0.0.1:1", backup: bool = False) -> dict[str, Any]:
    return {"state": state, "data_path_address": data, "backup": backup}


def test_ready_means_online_with_a_data_path_backups_apart() -> None:
    nodes = [node(), node(data=None), node("UNREACHABLE"), node("OFFLINE"), node(backup=True), node()]
    assert ready_compnodes(nodes) == (2, 1)


class Broker:
    """``call_status`` answers with the next list of compnodes each time (the last one from then on)."""

    def __init__(self, *views: list[dict[str, Any]]) -> None:
        self.views = list(views)
        self.calls = 0

    async def call_status(self, peer: str, request: Any, **kw: Any) -> StatusReply:
        view = self.views[min(self.calls, len(self.views) - 1)]
        self.calls += 1
        return StatusReply(broker={}, compnodes=view, jobs=[])


def wait(broker: Broker, wanted: int, timeout: float) -> tuple[int, str]:
    stream = io.StringIO()
    got = asyncio.run(wait_for_compnodes(broker, "b", wanted, timeout, stream))  # type: ignore[arg-type]
    return got, stream.getvalue()


@pytest.mark.timeout(30)
def test_submit_waits_for_the_compnodes_its_placement_needs() -> None:
    got, said = wait(Broker([], [node()], [node(), node()]), 2, 30)
    assert got == 2
    assert "waiting up to 30 s for 2 compnodes to be ready at the broker (0 now)" in said
    assert said.endswith("2 compnodes ready at the broker\n")
    got, said = wait(Broker([node(), node()]), 2, 30)
    assert (got, said) == (2, "")  # ready at once: not a word


@pytest.mark.timeout(30)
def test_the_wait_is_bounded_fewer_go_ahead_none_is_refused() -> None:
    got, said = wait(Broker([node()]), 3, 0.3)
    assert got == 1 and "only 1 of 3 compnodes ready at the broker after 0.3 s; submitting anyway" in said
    got, _ = wait(Broker([node(backup=True)]), 2, 0.0)
    assert got == 1  # backups take a job when there is nobody else
    with pytest.raises(ExecutionError, match=r"no compnode is ready at the broker after 0.2 s"):
        wait(Broker([node(data=None)]), 1, 0.2)


@pytest.mark.parametrize("command", ["cancel", "results"])
def test_a_malformed_job_id_is_bad_input(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "../etc", "--initial-peers", "/ip4/127.0.0.1/tcp/1"]
    argv += ["--output", "out"] if command == "results" else []
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "'../etc' is not a job id" in capsys.readouterr().err
