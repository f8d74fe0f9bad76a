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
def test_a_repeated_undeploy_gets_the_same_answer_and_only_its_deployer_undeploys() -> None:
    store = SimpleNamespace(get_job=lambda job_id: {"submitter": "P"})  # P deployed it
    context = SimpleNamespace(refresh_job_metrics=lambda: None, store=store)
    deployments = DeploymentService(context, serving=None)  # type: ignore[arg-type]
    deployments.served["tiny"] = SimpleNamespace(batcher=_Batcher(), job_id="j1")  # type: ignore[assignment]
    # the caller's peer stands for its submitter key here (signatures: tests/test_deploy_auth.py)
    deployments._who_undeploys = lambda request, context: context.remote_peer  # type: ignore[method-assign]

    async def scenario() -> None:
        with pytest.raises(JobError, match="no deployment named 'tiny' deployed with this key"):
            await deployments.rpc_undeploy({"name": "tiny"}, _context("Q"))  # not its deployer
        first = await deployments.rpc_undeploy({"name": "tiny"}, _context("P"))
        assert first == {"name": "tiny", "undeployed": True, "message": "tiny undeployed"}
        assert await deployments.rpc_undeploy({"name": "tiny"}, _context("P")) == first  # the retry
        assert _Batcher.closed == 1  # undeployed once
        with pytest.raises(JobError, match="no deployment named 'tiny'"):
            await deployments.rpc_undeploy({"name": "tiny"}, _context("Q"))  # someone else: as before
        with pytest.raises(JobError, match="no deployment named 'other'"):
            await deployments.rpc_undeploy({"name": "other"}, _context("P"))

    asyncio.run(scenario())
