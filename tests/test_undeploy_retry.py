"""``undeploy`` is safe to repeat: the RPC client tries a call again when p2pd closes its stream before the
answer, and the repeat must get the first call's answer, not "no deployment" (seen under load)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.broker.deployments import DeploymentService
from fusionnet.errors import JobError


class _Batcher:
    closed = 0

    async def close(self) -> None:
        _Batcher.closed += 1


def _context(peer: str) -> Any:
    return SimpleNamespace(method="undeploy", remote_peer=peer)


@pytest.mark.timeout(30)
def test_a_repeated_undeploy_gets_the_same_answer_and_only_from_the_same_peer() -> None:
    deployments = DeploymentService(SimpleNamespace(refresh_job_metrics=lambda: None), serving=None)  # type: ignore[arg-type]
    deployments.served["tiny"] = SimpleNamespace(batcher=_Batcher())  # type: ignore[assignment]

    async def scenario() -> None:
        first = await deployments.rpc_undeploy({"name": "tiny"}, _context("P"))
        assert first == {"name": "tiny", "undeployed": True, "message": "tiny undeployed"}
        assert await deployments.rpc_undeploy({"name": "tiny"}, _context("P")) == first  # the retry
        assert _Batcher.closed == 1  # undeployed once
        with pytest.raises(JobError, match="no deployment named 'tiny'"):
            await deployments.rpc_undeploy({"name": "tiny"}, _context("Q"))  # someone else: as before
        with pytest.raises(JobError, match="no deployment named 'other'"):
            await deployments.rpc_undeploy({"name": "other"}, _context("P"))

    asyncio.run(scenario())
