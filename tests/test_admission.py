"""Who may submit to a broker and look at a job, in one process: signatures bound to the broker, the
caller and the request; the allowlist, the closed default off loopback, the quotas; results, status
details and cancel for the job's submitter only."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fusionnet.broker.admission import Admission, AdmissionConfig, loopback_only, read_submitters
from fusionnet.broker.jobs import JobService
from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.messages.auth import sign_auth, verify_auth
from fusionnet.messages.broker_rpc import SubmitJobRequest
from fusionnet.runtime.submit import signed, submission_payload
from fusionnet.runtime.submitter import Signer, load_or_create_key
from tests.jobfiles import REPO
from tests.test_job_service import SIGNER, SUBMITTER, HangingSteps, ctx, job
from tests.test_jobrun_decisions import FakeCompnodes, make_context


@pytest.fixture(scope="module")
def submission() -> dict[str, Any]:
    """figure3 for 2 steps, signed by ``SIGNER`` (as ``tests.test_job_service`` submits it)."""
    request = submission_payload(load_job(REPO / "examples" / "figure3" / "job.yaml"))
    spec = request.spec.model_copy(update={"steps": 2})
    return signed(request.model_copy(update={"spec": spec}), SIGNER).model_dump()


OTHER_PEER = f"12D3KooW{'O' * 44}"
OTHER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(32)), broker="", caller=OTHER_PEER)


def test_a_signature_is_good_for_one_broker_caller_scope_and_subject() -> None:
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    auth = sign_auth(key, broker="B", caller="C", scope="job_status", subject="j1")
    assert verify_auth(auth, broker="B", caller="C", scope="job_status", subject="j1") == SIGNER.submitter_id
    for changed in ({"broker": "X"}, {"caller": "X"}, {"scope": "job_results"}, {"subject": "j2"}):
        where = {"broker": "B", "caller": "C", "scope": "job_status", "subject": "j1"} | changed
        with pytest.raises(JobError, match="bad submitter signature"):
            verify_auth(auth, **where)
    stale = auth.model_copy(update={"expires": auth.expires - 3600})
    with pytest.raises(JobError, match="expired"):
        verify_auth(stale, broker="B", caller="C", scope="job_status", subject="j1")
    with pytest.raises(JobError, match="not signed"):
        verify_auth(None, broker="B", caller="C", scope="job_status", subject="j1")


def test_the_submitter_key_is_private_and_made_once(tmp_path: Path) -> None:
    path = tmp_path / "home" / "submitter.key"
    key = load_or_create_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    again = load_or_create_key(path)
    assert Signer(again, "", "").submitter_id == Signer(key, "", "").submitter_id
    assert (tmp_path / "home" / "submitter.pub").read_text().strip() == Signer(key, "", "").submitter_id


def test_the_allowlist_file_and_the_default_policy(tmp_path: Path) -> None:
    good = tmp_path / "submitters"
    good.write_text(f"# team\n{SIGNER.submitter_id}  # alice\n\n")
    assert read_submitters(good) == {SIGNER.submitter_id}
    (tmp_path / "bad").write_text("alice\n")
    with pytest.raises(ValueError, match=r"bad:1: not a submitter id"):
        AdmissionConfig(submitters_file=tmp_path / "bad")
    with pytest.raises(ValueError, match="exclude each other"):
        AdmissionConfig(submitters_file=good, open_submissions=True)
    assert loopback_only(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert not loopback_only(["/ip4/0.0.0.0/tcp/31337"]) and not loopback_only([])
    assert Admission.create(AdmissionConfig(), ["/ip4/127.0.0.1/tcp/0"]).open
    closed = Admission.create(AdmissionConfig(), ["/ip4/0.0.0.0/tcp/31337"])
    with pytest.raises(JobError, match="takes no submissions"):
        closed.authorise_submit(SIGNER.auth("submit_job", "d"), broker="", caller=SUBMITTER, digest="d")
    listed = Admission.create(AdmissionConfig(submitters_file=good), ["/ip4/0.0.0.0/tcp/31337"])
    assert listed.authorise_submit(SIGNER.auth("submit_job", "d"), broker="", caller=SUBMITTER, digest="d")
    with pytest.raises(JobError, match=f"submitter {OTHER.submitter_id} may not submit"):
        listed.authorise_submit(OTHER.auth("submit_job", "d"), broker="", caller=OTHER_PEER, digest="d")
    with pytest.raises(JobError, match="bad submitter signature"):  # signed for another submission
        listed.authorise_submit(SIGNER.auth("submit_job", "d"), broker="", caller=SUBMITTER, digest="e")


@pytest.mark.timeout(120)
def test_only_the_submitter_sees_results_status_and_may_cancel(
    tmp_path: Path, submission: dict[str, Any]
) -> None:
    service = JobService(make_context(tmp_path, FakeCompnodes()))

    async def scenario() -> None:
        await service.start()
        unsigned = {**submission, "auth": None}
        with pytest.raises(JobError, match="not signed by a submitter key"):
            await service.rpc_submit_job(unsigned, ctx("submit_job"))
        tampered = {**submission, "data": submission["data"][:-1] + b"\x00"}
        with pytest.raises(JobError, match="bad submitter signature"):
            await service.rpc_submit_job(tampered, ctx("submit_job"))
        with pytest.raises(JobError, match="bad submitter signature"):  # replayed from another peer
            await service.rpc_submit_job(submission, ctx("submit_job", OTHER_PEER))
        job_id = (await service.rpc_submit_job(submission, ctx("submit_job")))["job_id"]
        assert service.ctx.store.get_job(job_id)["submitter"] == SIGNER.submitter_id
        await asyncio.gather(*service._tasks.values())
        for method, call in (
            ("job_status", service.rpc_job_status),
            ("job_results", service.rpc_job_results),
            ("cancel_job", service.rpc_cancel_job),
        ):
            with pytest.raises(JobError, match=f"no job '{job_id}' submitted with this key"):
                await call(job(job_id, method, OTHER), ctx(method, OTHER_PEER))
            with pytest.raises(JobError, match="not signed"):
                await call({"job_id": job_id}, ctx(method, OTHER_PEER))
            with pytest.raises(JobError, match="bad submitter signature"):  # the owner's, replayed
                await call(job(job_id, method), ctx(method, OTHER_PEER))
        assert (await service.rpc_job_status(job(job_id, "job_status"), ctx("job_status")))["job"][
            "state"
        ] == ("SUCCEEDED")
        await service.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_quotas_per_submitter(tmp_path: Path, submission: dict[str, Any]) -> None:
    fake = HangingSteps(hang_from=0)  # the first job keeps running
    context = make_context(tmp_path, fake)
    context.settings.admission = AdmissionConfig(max_steps=1, max_graph_nodes=5, max_submission_bytes=1 << 30)
    service = JobService(context)

    async def scenario() -> None:
        with pytest.raises(JobError, match=r"2 steps exceeds this broker's limit of 1 \(--max-steps\)"):
            await service.rpc_submit_job(submission, ctx("submit_job"))
        service.admission.config.max_steps = 10
        with pytest.raises(
            JobError, match=r"IR nodes exceeds this broker's limit of 5 \(--max-graph-nodes\)"
        ):
            await service.rpc_submit_job(submission, ctx("submit_job"))
        service.admission.config.max_graph_nodes = 10_000
        service.admission.config.max_submission_bytes = 1000
        with pytest.raises(JobError, match="submission bytes exceed this broker's limit of 1000"):
            await service.rpc_submit_job(submission, ctx("submit_job"))
        service.admission.config.max_submission_bytes = 1 << 30
        service.admission.config.max_jobs_per_submitter = 1
        await service.start()
        await service.rpc_submit_job(submission, ctx("submit_job"))
        await asyncio.wait_for(fake.in_flight.wait(), 60)
        second = signed(SubmitJobRequest.model_validate({**submission, "request_id": "other"}), SIGNER)
        with pytest.raises(JobError, match=r"2 jobs and deployments of this submitter live exceeds .* of 1"):
            await service.rpc_submit_job(second.model_dump(), ctx("submit_job"))
        other = signed(SubmitJobRequest.model_validate({**submission, "request_id": "o"}), OTHER)
        assert (await service.rpc_submit_job(other.model_dump(), ctx("submit_job", OTHER_PEER)))["job_id"]
        await service.stop()

    asyncio.run(scenario())


def test_fusionnet_key_prints_the_submitter_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fusionnet.cli.main import main

    monkeypatch.setenv("FUSIONNET_HOME", str(tmp_path / "home"))
    assert main(["key"]) == 0
    printed = capsys.readouterr().out.strip()
    assert len(printed) == 64 and printed == (tmp_path / "home" / "submitter.pub").read_text().strip()
    assert main(["key"]) == 0 and capsys.readouterr().out.strip() == printed  # the same key next time
