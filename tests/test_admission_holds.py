"""The per-submitter and broker-wide caps hold when admissions overlap, and deployments are under the same
quotas as jobs. An admission awaits a lot between its checks and its launch (hashing, decoding, writing
the state); the caps used to count launched work only, so submissions sent at once all got past them,
and ``deploy`` checked none of the per-submitter quotas. One process; the compnodes are fakes
(``test_jobrun_decisions``), the services are real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fusionnet.broker.deployments as deployments_module
import fusionnet.broker.jobs as jobs_module
from fusionnet.broker.admission import Admission, AdmissionConfig
from fusionnet.broker.deployments import DeploymentService
from fusionnet.broker.jobs import JobService
from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.messages.broker_rpc import SubmitJobRequest
from fusionnet.messages.serving_rpc import DeployRequest, deploy_subject
from fusionnet.runtime.submit import signed, submission_payload
from tests.jobfiles import REPO
from tests.test_admission import OTHER, OTHER_PEER
from tests.test_deployment_lifecycle import _deploy, _service, _undeploy
from tests.test_job_service import SIGNER, SUBMITTER, HangingSteps, ctx, job
from tests.test_jobrun_decisions import make_context

pytestmark = pytest.mark.timeout(120)
ME = SIGNER.submitter_id


@pytest.fixture(scope="module")
def submission() -> dict[str, Any]:
    """figure3 for 2 steps, signed by ``SIGNER`` (as ``tests.test_job_service`` submits it)."""
    request = submission_payload(load_job(REPO / "examples" / "figure3" / "job.yaml"))
    spec = request.spec.model_copy(update={"steps": 2})
    return signed(request.model_copy(update={"spec": spec}), SIGNER).model_dump()


def _again(submission: dict[str, Any], request_id: str, signer: Any = SIGNER) -> dict[str, Any]:
    """The submission as another one (its own request id: not a repeat of the first), signed anew."""
    request = SubmitJobRequest.model_validate({**submission, "request_id": request_id})
    return signed(request, signer).model_dump()


def _jobs(tmp_path: Path, **quotas: Any) -> JobService:
    """A job service whose jobs keep running (their first step never ends) until cancelled."""
    context = make_context(tmp_path, HangingSteps(hang_from=0))
    context.settings.admission = AdmissionConfig(**quotas)
    return JobService(context)


def _outcomes(results: list[Any]) -> tuple[list[str], list[str]]:
    """The job ids accepted and the refusals of a ``gather``; anything else fails the test."""
    accepted = [r["job_id"] for r in results if isinstance(r, dict)]
    refused = [str(r) for r in results if isinstance(r, JobError)]
    assert len(accepted) + len(refused) == len(results), results
    return accepted, refused


async def _until_running(service: JobService, job_ids: list[str]) -> None:
    """Until each job is RUNNING (its first step in flight: stopping the service then cancels no call that
    was about to be made), or fails the test after 30 s."""
    async with asyncio.timeout(30):
        while any(service.ctx.store.get_job(j)["state"] != "RUNNING" for j in job_ids):
            await asyncio.sleep(0.01)


def test_submissions_sent_at_once_do_not_get_past_the_submitters_quota(
    tmp_path: Path, submission: dict[str, Any]
) -> None:
    service = _jobs(tmp_path, max_jobs_per_submitter=2)

    async def scenario() -> None:
        await service.start()
        calls = [service.rpc_submit_job(_again(submission, f"r{i}"), ctx("submit_job")) for i in range(5)]
        accepted, refused = _outcomes(await asyncio.gather(*calls, return_exceptions=True))
        assert len(accepted) == 2 and len(refused) == 3, refused
        for said in refused:
            assert "of this submitter live exceeds this broker's limit of 2" in said, said
            assert said.endswith("(--max-jobs-per-submitter)"), said
        assert service.admission.live(ME) == 2 and not service._admitting
        # another submitter's quota is its own
        other = await service.rpc_submit_job(_again(submission, "o", OTHER), ctx("submit_job", OTHER_PEER))
        assert other["job_id"] and service.admission.live(OTHER.submitter_id) == 1
        # a repeat of an accepted submission is answered its job, not refused for the quota
        assert (await service.rpc_submit_job(_again(submission, "r0"), ctx("submit_job")))["job_id"]
        # a job that ends gives its place back
        cancelled = await service.rpc_cancel_job(job(accepted[0], "cancel_job"), ctx("cancel_job"))
        assert cancelled["cancelled"] and service.admission.live(ME) == 1
        assert (await service.rpc_submit_job(_again(submission, "later"), ctx("submit_job")))["job_id"]
        await service.stop()
        assert service.admission.live(ME) == 0 and service.admission.live(OTHER.submitter_id) == 0

    asyncio.run(scenario())


def test_submissions_sent_at_once_do_not_get_past_the_brokers_running_jobs_cap(
    tmp_path: Path, submission: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "MAX_RUNNING_JOBS", 2)
    service = _jobs(tmp_path, max_jobs_per_submitter=10)

    async def scenario() -> None:
        await service.start()
        calls = [service.rpc_submit_job(_again(submission, f"r{i}"), ctx("submit_job")) for i in range(4)]
        accepted, refused = _outcomes(await asyncio.gather(*calls, return_exceptions=True))
        assert len(accepted) == 2 and len(refused) == 2, refused
        assert all("the broker already runs 2 jobs" in said for said in refused), refused
        assert service._running() == 2
        await _until_running(service, accepted)
        await service.stop()

    asyncio.run(scenario())


def test_a_refused_admission_gives_its_place_back(tmp_path: Path, submission: dict[str, Any]) -> None:
    """Refused after its place was counted (here: too many IR nodes, found once the IR is decoded)."""
    service = _jobs(tmp_path, max_jobs_per_submitter=1, max_graph_nodes=5)

    async def scenario() -> None:
        await service.start()
        for attempt in range(2):
            with pytest.raises(JobError, match=r"\(--max-graph-nodes\)"):
                await service.rpc_submit_job(_again(submission, f"big{attempt}"), ctx("submit_job"))
            assert service.admission.live(ME) == 0 and service._running() == 0
        service.admission.config.max_graph_nodes = 10_000
        assert (await service.rpc_submit_job(_again(submission, "fits"), ctx("submit_job")))["job_id"]
        await service.stop()

    asyncio.run(scenario())


# ---- deploy --------------------------------------------------------------------------------------------
BROKER, CALLER = "12D3KooWBroker", "12D3KooWCaller"


@pytest.fixture(scope="module")
def deployment() -> DeployRequest:
    """The MLP infer job as a deployment, signed by ``SIGNER`` for broker ``BROKER`` from ``CALLER``."""
    payload = submission_payload(load_job(REPO / "examples/mlp/infer.yaml", deployment=True), deployment=True)
    request = DeployRequest(name="mlp", kind="infer", submission=payload)
    signer = type(SIGNER)(SIGNER.key, BROKER, CALLER)
    return request.model_copy(update={"auth": signer.auth("deploy", deploy_subject(request))})


def _deployments(tmp_path: Path, **quotas: Any) -> DeploymentService:
    """A deployment service whose ``_deploy`` and ``_accept`` are real, up to the files they write."""
    admission = Admission.create(AdmissionConfig(**quotas), ["/ip4/127.0.0.1/tcp/0"])  # open: loopback
    context = SimpleNamespace(broker_id=lambda: BROKER, jobs_dir=tmp_path / "jobs")
    return DeploymentService(context, serving=None, admission=admission)  # type: ignore[arg-type]


def test_deploy_is_refused_over_the_size_and_graph_quotas(
    tmp_path: Path, deployment: DeployRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    deploy = DeploymentService.rpc_deploy.__wrapped__  # type: ignore[attr-defined]
    context = SimpleNamespace(method="deploy", remote_peer=CALLER)
    sub = deployment.submission
    nbytes = len(sub.ir) + len(sub.state) + len(sub.data)

    async def scenario() -> None:
        service = _deployments(tmp_path, max_submission_bytes=1000)
        hashed: list[int] = []

        def counted(request: DeployRequest) -> str:
            hashed.append(1)
            return deploy_subject(request)

        monkeypatch.setattr(deployments_module, "deploy_subject", counted)
        said = rf"{nbytes} submission bytes exceed this broker's limit of 1000 \(--max-submission-mb\)"
        with pytest.raises(JobError, match=said):
            await deploy(service, deployment, context)
        assert hashed == []  # refused before hashing gigabytes
        service = _deployments(tmp_path, max_graph_nodes=3)
        with pytest.raises(
            JobError, match=r"IR nodes exceeds this broker's limit of 3 \(--max-graph-nodes\)"
        ):
            await deploy(service, deployment, context)
        assert hashed == [1] and service.admission.live(ME) == 0 and not service._holds
        assert not (tmp_path / "deployments").exists()  # refused before anything was written

    asyncio.run(scenario())


def test_live_deployments_count_with_the_submitters_jobs(
    tmp_path: Path, submission: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "j").mkdir(), (tmp_path / "d").mkdir()  # a store each
    jobs = _jobs(tmp_path / "j", max_jobs_per_submitter=2)
    service, _ = _service(tmp_path / "d", monkeypatch)  # placed at once, signed by ``ME``
    service._admission = jobs.admission  # as the broker's command builds them: one policy

    async def signed_by_me(request: Any, context: Any) -> str:
        return ME

    monkeypatch.setattr(service, "_who_deploys", signed_by_me)
    monkeypatch.setattr(service, "_who_undeploys", lambda request, context: ME)

    async def scenario() -> None:
        await jobs.start()
        # two deploys and a submission at once, one place too many: one of the three is refused
        calls = [_deploy(service, "a"), _deploy(service, "b")]
        calls.append(jobs.rpc_submit_job(_again(submission, "r"), ctx("submit_job")))
        results = await asyncio.gather(*calls, return_exceptions=True)
        refused = [str(r) for r in results if isinstance(r, JobError)]
        assert len(refused) == 1 and "(--max-jobs-per-submitter)" in refused[0], results
        assert jobs.admission.live(ME) == 2 and len(service.served) + len(jobs.runs) == 2
        with pytest.raises(JobError, match=r"\(--max-jobs-per-submitter\)"):  # once placed, still counted
            await _deploy(service, "c")
        with pytest.raises(JobError, match=r"\(--max-jobs-per-submitter\)"):
            await jobs.rpc_submit_job(_again(submission, "r2"), ctx("submit_job"))
        await _undeploy(service, next(iter(service.served)))  # gives its place back
        assert jobs.admission.live(ME) == 1
        assert (await _deploy(service, "c")).name == "c"
        await service.stop()
        await jobs.stop()
        assert jobs.admission.live(ME) == 0

    asyncio.run(scenario())


def test_a_submitters_quota_refuses_no_one_else(tmp_path: Path, submission: dict[str, Any]) -> None:
    """A stranger's signature is checked before any place is counted: it holds none."""
    service = _jobs(tmp_path, max_jobs_per_submitter=1)

    async def scenario() -> None:
        await service.start()
        with pytest.raises(JobError, match="bad submitter signature"):  # replayed from another peer
            await service.rpc_submit_job(_again(submission, "x"), ctx("submit_job", OTHER_PEER))
        assert service.admission.live(ME) == 0
        assert (await service.rpc_submit_job(_again(submission, "x"), ctx("submit_job", SUBMITTER)))["job_id"]
        await service.stop()

    asyncio.run(scenario())
