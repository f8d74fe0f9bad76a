"""The broker's job service in one process: a submission runs to its result files over fake
compnodes, and what must be refused is (malformed requests, unknown jobs, results of an unfinished
job, a leave from a compnode that runs nothing of the job)."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fusionnet.broker.jobs import JobService
from fusionnet.errors import ExecutionError, JobError, WireError
from fusionnet.job.loader import load_job
from fusionnet.messages.broker_rpc import SubmitJobRequest
from fusionnet.rpc.server import RPCContext
from fusionnet.runtime.submit import signed, submission_payload
from fusionnet.runtime.submitter import Signer
from tests.jobfiles import REPO
from tests.test_jobrun_decisions import PEERS, FakeCompnodes, make_context

SUBMITTER = f"12D3KooW{'S' * 44}"
LATER_PEER = f"12D3KooW{'L' * 44}"
SIGNER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))), broker="", caller=SUBMITTER)


def job(job_id: str, method: str, signer: Signer = SIGNER, **more: Any) -> dict[str, Any]:
    """A request about one job, signed by ``signer`` for ``method``."""
    return {"job_id": job_id, "auth": signer.auth(method, job_id).model_dump(), **more}


def ctx(method: str, sender: str = SUBMITTER) -> RPCContext:
    return RPCContext(remote_peer=sender, method=method)


@pytest.fixture(scope="module")
def submission() -> dict[str, Any]:
    request = submission_payload(load_job(REPO / "examples" / "figure3" / "job.yaml"))
    spec = request.spec.model_copy(update={"steps": 2})
    return signed(request.model_copy(update={"spec": spec}), SIGNER).model_dump()


async def _download_in_chunks(service: JobService, job_id: str, whole: dict[str, bytes], out: Path) -> None:
    """``download_results`` over chunks of 100 bytes gives the files one answer gives; a file the job does
    not have is refused."""
    from fusionnet.broker import jobs
    from fusionnet.messages.broker_rpc import BrokerClient
    from fusionnet.runtime import jobcontrol
    from fusionnet.runtime.jobcontrol import download_results

    calls: list[dict[str, Any]] = []
    flying = [0, 0]  # calls in flight now, the most at once

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        calls.append(payload or {})
        flying[0] += 1
        flying[1] = max(flying)
        try:
            return await getattr(service, f"rpc_{method}")(payload, ctx(method))
        finally:
            flying[0] -= 1

    out.mkdir()
    (out / "outputs.safetensors").write_bytes(b"an earlier infer job's")  # a reused --output
    saved = jobs.RESULTS_CHUNK_BYTES
    jobs.RESULTS_CHUNK_BYTES = jobcontrol.RESULTS_CHUNK_BYTES = 100  # type: ignore[misc]
    try:
        names = await download_results(BrokerClient(call), "broker", job_id, out, SIGNER)
        # a broker whose chunks are not the ones asked for: refused by name, no file left behind (chunks
        # are fetched several at once: whichever answers first is the one named)
        jobcontrol.RESULTS_CHUNK_BYTES = 200  # type: ignore[misc]
        with pytest.raises(JobError, match=r"the broker sent 100 bytes at byte \d+ of \d+, not 200"):
            await download_results(BrokerClient(call), "broker", job_id, tmp := out / "again", SIGNER)
        assert not list(tmp.glob(".*.part"))
    finally:
        jobs.RESULTS_CHUNK_BYTES = jobcontrol.RESULTS_CHUNK_BYTES = saved  # type: ignore[misc]
    assert names == sorted(whole)
    assert {n: (out / n).read_bytes() for n in names} == whole
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == names  # this job's results only
    blocked = out.parent / "blocked"  # a file where the folder should go (a full disk fails alike)
    blocked.write_text("not a folder")
    said = rf"job {job_id}'s results could not be written to .*blocked .*fusionnet results {job_id} --output"
    with pytest.raises(ExecutionError, match=said):  # not "internal error FileExistsError"
        await download_results(BrokerClient(call), "broker", job_id, blocked, SIGNER)
    biggest = max(len(b) for b in whole.values())
    assert len(calls) >= 1 + biggest // 100  # the big files came in chunks
    assert biggest > 300 and flying[1] == jobcontrol.RESULTS_WINDOW  # ... several at once
    assert not list(out.glob(".*.part"))
    with pytest.raises(JobError, match=r"has no result file 'outputs\.safetensors'"):
        await service.rpc_job_results(
            job(job_id, "job_results", file="outputs.safetensors"), ctx("job_results")
        )


@pytest.mark.timeout(120)
def test_a_submission_runs_to_its_results_and_refusals_are_clear(
    tmp_path: Path, submission: dict[str, Any]
) -> None:
    service = JobService(make_context(tmp_path, FakeCompnodes()))

    async def scenario() -> None:
        await service.start()
        with pytest.raises(WireError, match=r"^rpc submit_job: malformed message: spec.task: "):
            bad = {**submission, "spec": {**submission["spec"], "task": "x"}}
            await service.rpc_submit_job(bad, ctx("submit_job"))
        with pytest.raises(JobError, match="the IR was traced for task 'train', the spec says 'grad'"):
            grad = signed(SubmitJobRequest.model_validate(submission), SIGNER)
            grad.spec, grad.request_id = grad.spec.model_copy(update={"task": "grad"}), "r2"
            await service.rpc_submit_job(signed(grad, SIGNER).model_dump(), ctx("submit_job"))
        reply = await service.rpc_submit_job(submission, ctx("submit_job"))
        job_id = reply["job_id"]
        assert service.ctx.live_jobs == {job_id}  # what the broker's heartbeats tell the compnodes
        again = await service.rpc_submit_job(submission, ctx("submit_job"))  # same request id: same job
        assert again == reply and len(service.runs) == 1
        submitted = service.ctx.metrics.registry.get_sample_value("fusionnet_jobs_submitted_total")
        assert submitted == 1  # the repeat is the same job, not another one
        with pytest.raises(JobError, match="results exist only for SUCCEEDED jobs"):
            await service.rpc_job_results(job(job_id, "job_results"), ctx("job_results"))
        with pytest.raises(JobError, match=f"{PEERS[4]} runs no sub-DAG of job {job_id}"):
            await service.rpc_leaving({"job_id": job_id}, ctx("leaving", PEERS[4]))
        await asyncio.gather(*service._tasks.values())
        assert service.ctx.live_jobs == set()  # over: a compnode that still holds it may drop it
        status = await service.rpc_job_status(job(job_id, "job_status", since=1), ctx("job_status"))
        assert status["job"]["state"] == "SUCCEEDED", status["job"]["error"]
        assert [r["step"] for r in status["metrics"]] == [1]  # rows from ``since`` on
        results = await service.rpc_job_results(job(job_id, "job_results"), ctx("job_results"))
        assert {"weights.safetensors", "metrics.jsonl", "plan.json"} <= set(results["files"])
        await _download_in_chunks(service, job_id, results["files"], tmp_path / "out")
        with pytest.raises(JobError, match="no job with id 'nope'"):
            await service.rpc_job_results(job("nope", "job_results"), ctx("job_results"))
        # results expire with the job's folder: then the answer says so, never an empty set of files
        (service.jobs_dir / job_id / "weights.safetensors").unlink()
        with pytest.raises(
            ExecutionError, match=r"results are no longer kept on this broker \(.* lacks weights"
        ):
            await service.rpc_job_results(job(job_id, "job_results"), ctx("job_results"))
        shutil.rmtree(service.jobs_dir / job_id)
        with pytest.raises(ExecutionError, match=r"lacks metrics.jsonl, plan.json, weights"):
            await service.rpc_job_results(job(job_id, "job_results"), ctx("job_results"))
        with pytest.raises(WireError, match=r"^rpc job_status: malformed message: job_id: "):
            await service.rpc_job_status({"job_id": "../x"}, ctx("job_status"))
        await service.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_repeat_that_comes_while_the_first_is_taken_in_gets_its_job(
    tmp_path: Path, submission: dict[str, Any]
) -> None:
    """The same submission twice at once (an RPC retry, or an interrupted ``submit`` asking which job it
    made so as to cancel it): one job, both answered with it; the broker used to start two."""
    service = JobService(make_context(tmp_path, FakeCompnodes()))

    async def scenario() -> None:
        await service.start()
        first, again = await asyncio.gather(
            service.rpc_submit_job(submission, ctx("submit_job")),
            service.rpc_submit_job(submission, ctx("submit_job")),
        )
        assert first == again and len(service.runs) == 1 and not service._submitting
        await asyncio.gather(*service._tasks.values())
        later = await service.rpc_submit_job(submission, ctx("submit_job"))  # its run is over: still known
        assert later == first and len(service.ctx.store.list_jobs()) == 1
        await service.stop()

    asyncio.run(scenario())


class HangingSteps(FakeCompnodes):
    """Compnodes whose step ``hang_from`` never finishes (a long job), so a cancel finds a step in flight."""

    def __init__(self, hang_from: int) -> None:
        super().__init__()
        self.hang_from = hang_from
        self.in_flight = asyncio.Event()

    async def call(self, peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "step" and (payload or {})["step"] >= self.hang_from:
            self.calls.append((peer, method))
            self.in_flight.set()
            await asyncio.Event().wait()  # until cancelled
        return await super().call(peer, method, payload, **kw)


@pytest.mark.timeout(120)
def test_cancel_stops_a_step_in_flight_releases_the_compnodes_and_is_kept(
    tmp_path: Path, submission: dict[str, Any]
) -> None:
    fake = HangingSteps(hang_from=1)
    service = JobService(make_context(tmp_path, fake))

    async def scenario() -> None:
        await service.start()
        with pytest.raises(JobError, match="no job with id 'nope'"):
            await service.rpc_cancel_job(job("nope", "cancel_job"), ctx("cancel_job"))
        job_id = (await service.rpc_submit_job(submission, ctx("submit_job")))["job_id"]
        await asyncio.wait_for(fake.in_flight.wait(), 60)
        peers = list(service.runs[job_id].peers)
        started = time.monotonic()
        reply = await service.rpc_cancel_job(job(job_id, "cancel_job"), ctx("cancel_job"))
        assert time.monotonic() - started < 5.0
        assert reply["cancelled"] and reply["state"] == "CANCELLED", reply
        assert service._tasks.get(job_id) is None  # the run task is over, not orphaned
        released = {p for p, m in fake.calls if m == "release"}
        assert released == set(peers)
        steps_before = sum(1 for _, m in fake.calls if m == "step")
        await asyncio.sleep(0.3)
        assert sum(1 for _, m in fake.calls if m == "step") == steps_before  # nothing drives it any more
        row = service.ctx.store.get_job(job_id)
        assert row["state"] == "CANCELLED" and "cancelled by the user" in row["error"]
        # The RPC layer repeats a call whose stream p2pd dropped: the repeat gets the first answer ...
        again = await service.rpc_cancel_job(job(job_id, "cancel_job"), ctx("cancel_job"))
        assert again == reply
        # ... while a later cancel (another process: another peer id, the same key) learns it was done.
        later = Signer(SIGNER.key, broker="", caller=LATER_PEER)
        again = await service.rpc_cancel_job(job(job_id, "cancel_job", later), ctx("cancel_job", LATER_PEER))
        assert not again["cancelled"] and again["state"] == "CANCELLED"
        assert again["message"] == f"job {job_id} already CANCELLED"
        with pytest.raises(JobError, match="results exist only for SUCCEEDED jobs"):
            await service.rpc_job_results(job(job_id, "job_results"), ctx("job_results"))
        # A compnode that still holds a sub-DAG of it (a release it missed) and leaves is told the job is
        # over: no step will come to move its sub-DAG, so it must not wait for one.
        with pytest.raises(JobError, match=f"job {job_id} is over \\(CANCELLED\\): nothing to hand over"):
            await service.rpc_leaving({"job_id": job_id}, ctx("leaving", peers[0]))
        await service.stop()
        # A broker restart does not resume a cancelled job.
        restarted = JobService(service.ctx)
        await restarted.start()
        assert job_id not in restarted.runs
        await restarted.stop()

    asyncio.run(scenario())
