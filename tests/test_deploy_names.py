"""A deployment's name is taken from the moment its ``deploy`` call arrives: a second ``deploy`` of the
name while the first still waits for its submission to be accepted (a retried call, two users) is
refused, instead of overwriting the first, whose compnodes and batcher nothing would ever stop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.broker.deployments import MAX_DEPLOYMENTS, DeploymentService
from fusionnet.errors import JobError

deploy = DeploymentService.rpc_deploy.__wrapped__  # type: ignore[attr-defined]  # the typed handler


@pytest.mark.timeout(30)
def test_a_name_being_deployed_is_taken_until_its_deploy_ends() -> None:
    service = DeploymentService(SimpleNamespace(), serving=None)  # type: ignore[arg-type]
    context = SimpleNamespace(method="deploy", remote_peer="P")

    async def scenario() -> None:
        release = asyncio.Event()
        waiting: list[str] = []  # names whose acceptance is under way

        async def accept(request: Any, submitter: str) -> Any:
            waiting.append(request.name)
            await release.wait()
            raise JobError("the submission was refused")

        async def until_waiting(count: int) -> None:
            async with asyncio.timeout(10):
                while len(waiting) < count:
                    await asyncio.sleep(0)

        async def anyone(request: Any, context: Any) -> str:  # signatures: tests/test_deploy_auth.py
            return "submitter"

        service._accept = accept  # type: ignore[method-assign]
        service._who_deploys = anyone  # type: ignore[method-assign]
        # Quotas are tests/test_admission_holds.py's: here every deploy gets its place.
        service._admission = SimpleNamespace(hold=lambda submitter: SimpleNamespace(release=lambda: None))
        first = asyncio.ensure_future(deploy(service, SimpleNamespace(name="tiny"), context))
        await until_waiting(1)  # the first call now waits in its submission's acceptance
        with pytest.raises(JobError, match="named 'tiny' exists already"):
            await deploy(service, SimpleNamespace(name="tiny"), context)
        others = [asyncio.ensure_future(deploy(service, SimpleNamespace(name=f"d{i}"), context))
                  for i in range(MAX_DEPLOYMENTS - 1)]  # fmt: skip
        await until_waiting(MAX_DEPLOYMENTS)
        with pytest.raises(JobError, match=f"already serves {MAX_DEPLOYMENTS}"):
            await deploy(service, SimpleNamespace(name="one-too-many"), context)
        release.set()
        for call in (first, *others):
            with pytest.raises(JobError, match="refused"):
                await call
        with pytest.raises(JobError, match="refused"):  # the name is free again: this one got as far
            await deploy(service, SimpleNamespace(name="tiny"), context)

    asyncio.run(scenario())
