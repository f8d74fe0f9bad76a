"""``fusionnet cancel`` on a deployment's job id (its row is "deploy:NAME"): refused, pointing at
``undeploy``, instead of marking the row CANCELLED while the deployment kept serving (and ``undeploy``
then failing on that row after it had removed the deployment). One process, fake compnodes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fusionnet.broker.jobs import JobService
from fusionnet.errors import JobError
from tests.test_deployment_lifecycle import _deploy, _Run, _service, _undeploy
from tests.test_job_service import SIGNER, ctx, job
from tests.test_jobrun_decisions import FakeCompnodes, make_context

pytestmark = pytest.mark.timeout(60)


def test_cancel_refuses_a_live_deployments_job_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    service = JobService(make_context(tmp_path, FakeCompnodes()))
    store = service.ctx.store
    store.create_job("dep1", "deploy:mlp", steps=0, submitter=SIGNER.submitter_id)
    store.update_job("dep1", state="RUNNING")

    async def scenario() -> None:
        with pytest.raises(JobError, match=r"^job dep1 is deployment mlp: use fusionnet undeploy mlp$"):
            await service.rpc_cancel_job(job("dep1", "cancel_job"), ctx("cancel_job"))
        assert store.get_job("dep1")["state"] == "RUNNING"
        assert not [e for e in store.job_events("dep1") if e["kind"] == "cancel"]
        # one that has ended is answered as any ended job is: nothing to undeploy any more
        store.update_job("dep1", state="SUCCEEDED")
        reply = await service.rpc_cancel_job(job("dep1", "cancel_job"), ctx("cancel_job"))
        assert not reply["cancelled"] and reply["message"] == "job dep1 already SUCCEEDED"

    asyncio.run(scenario())


def test_undeploy_keeps_a_row_that_something_else_ended_and_does_not_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployment's end wrote SUCCEEDED over the row, which raised "already CANCELLED; cannot move it
    to FAILED" out of ``undeploy`` once the deployment was gone."""
    service, ctx_ = _service(tmp_path, monkeypatch)

    async def scenario() -> None:
        await _deploy(service, "m")
        ctx_.store.update_job("job1", state="CANCELLED", error="ended elsewhere")
        reply = await asyncio.wait_for(_undeploy(service, "m"), 20)
        assert reply.undeployed and _Run.released == ["job1"] and not service.served
        row = ctx_.store.get_job("job1")
        assert (row["state"], row["error"]) == ("CANCELLED", "ended elsewhere")

    asyncio.run(scenario())
