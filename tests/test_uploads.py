"""A submission's state in chunks (``broker.uploads``, ``upload_state``): the broker holds one chunk at a
time, the submitter's signature covers the uploaded bytes, and a bad upload is refused by name."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest

from fusionnet.broker.jobs import JobService
from fusionnet.broker.uploads import MAX_SPANS, MAX_UPLOADS_PER_SUBMITTER, StateUploads
from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.messages.broker_rpc import BrokerClient, SubmitJobRequest, UploadStateRequest
from fusionnet.runtime import submit as submit_module
from fusionnet.runtime.submit import signed, submission_payload, upload_state
from tests.jobfiles import REPO
from tests.test_admission import OTHER, OTHER_PEER
from tests.test_job_service import SIGNER, ctx
from tests.test_jobrun_decisions import FakeCompnodes, make_context

UID = "0" * 32


def test_chunks_in_any_order_after_the_first_repeats_are_harmless_and_the_rest_is_refused(
    tmp_path: Path,
) -> None:
    uploads = StateUploads(tmp_path / "uploads")
    assert uploads.append("s", UID, 0, 10, b"012", 100) == 3
    assert uploads.append("s", UID, 0, 10, b"012", 100) == 3  # a retried call
    assert uploads.append("s", UID, 7, 10, b"789", 100) == 6  # ahead of the gap: the calls overlap
    assert uploads.append("s", UID, 8, 10, b"89", 100) == 6  # within what is held: a repeat
    with pytest.raises(JobError, match=f"upload {UID}: a chunk at bytes 2-5 overlaps bytes the broker"):
        uploads.append("s", UID, 2, 10, b"234", 100)
    with pytest.raises(JobError, match="a chunk at bytes 5-8 overlaps"):
        uploads.append("s", UID, 5, 10, b"567", 100)
    with pytest.raises(JobError, match="no such upload"):  # another submitter cannot add to it
        uploads.append("t", UID, 3, 10, b"3456", 100)
    with pytest.raises(JobError, match="11 bytes announced, 10 at its start"):
        uploads.append("s", UID, 3, 11, b"3456", 100)
    with pytest.raises(JobError, match="a chunk ending at byte 11 of 10"):
        uploads.append("s", UID, 7, 10, b"7890", 100)
    with pytest.raises(JobError, match=r"incomplete \(6 of 10 bytes\)"):
        uploads.sha256(UID)
    assert uploads.append("s", UID, 3, 10, b"3456", 100) == 10  # the gap filled: one span
    # hashed as the prefix grew (the chunk ahead of the gap read back once it joined): the submission
    # does not read the whole upload again
    assert uploads._uploads[UID].hashed == 10
    submitter, size, digest = uploads.sha256(UID)
    assert (submitter, size) == ("s", 10) and digest == __import__("hashlib").sha256(b"0123456789").digest()
    with pytest.raises(JobError, match="no such upload"):
        uploads.take(UID, "t", tmp_path / "job" / "state")
    uploads.take(UID, "s", tmp_path / "job" / "state")
    assert (tmp_path / "job" / "state").read_bytes() == b"0123456789"
    # taken: gone, but what a repeated submission needs of it is kept (submitter, size, hash)
    assert uploads.sha256(UID) == (submitter, size, digest)
    with pytest.raises(JobError, match="no such upload"):
        uploads.take(UID, "s", tmp_path / "job2" / "state")
    with pytest.raises(
        JobError, match=r"101 bytes of state exceed this broker's limit of 100 \(--max-submission-mb\)"
    ):
        uploads.append("s", "1" * 32, 0, 101, b"x", 100)
    with pytest.raises(JobError, match="no such upload"):  # a first chunk must start at 0
        uploads.append("s", "1" * 32, 5, 10, b"x", 100)
    for i in range(MAX_UPLOADS_PER_SUBMITTER):
        uploads.append("s", f"{i + 2}" * 32, 0, 10, b"x", 100)
    with pytest.raises(JobError, match="uploads under way already"):
        uploads.append("s", "9" * 32, 0, 10, b"x", 100)
    uploads.ttl = 0.0
    uploads.expire()  # untouched uploads go, with their files
    assert not list((tmp_path / "uploads").iterdir())
    uploads.ttl = 3600.0
    wide = 2 * MAX_SPANS + 2
    uploads.append("s", "8" * 32, 0, wide, b"x", wide)
    for offset in range(2, 2 * MAX_SPANS, 2):  # every other byte: a gap before each
        uploads.append("s", "8" * 32, offset, wide, b"x", wide)
    with pytest.raises(JobError, match=f"would leave more than {MAX_SPANS} gaps"):
        uploads.append("s", "8" * 32, 2 * MAX_SPANS, wide, b"x", wide)
    assert uploads.append("s", "8" * 32, 1, wide, b"x", wide) == MAX_SPANS + 1  # a gap filled: one fewer
    uploads.ttl = 0.0
    uploads.expire()
    assert not list((tmp_path / "uploads").iterdir())
    assert uploads.append("s", "9" * 32, 0, 10, b"x", 100) == 1


@pytest.fixture(scope="module")
def request_() -> SubmitJobRequest:
    request = submission_payload(load_job(REPO / "examples" / "figure3" / "job.yaml"))
    spec = request.spec.model_copy(update={"steps": 2})
    return signed(request.model_copy(update={"spec": spec}), SIGNER)


@pytest.mark.timeout(120)
def test_a_job_submitted_on_an_uploaded_state_runs_and_bad_uploads_are_refused(
    tmp_path: Path, request_: SubmitJobRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = JobService(make_context(tmp_path, FakeCompnodes()))
    monkeypatch.setattr(submit_module, "UPLOAD_CHUNK_BYTES", 256)  # the figure3 state in several chunks
    state = request_.state
    assert len(state) > 3 * 256

    flying = [0, 0]  # upload calls in flight now, the most at once

    def client(peer: str) -> BrokerClient:
        async def call(_: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
            flying[0] += 1
            flying[1] = max(flying)
            try:
                return await getattr(service, f"rpc_{method}")(payload, ctx(method, peer))
            finally:
                flying[0] -= 1

        return BrokerClient(call)

    async def scenario() -> None:
        await service.start()
        log = io.StringIO()
        upload = await upload_state(client(SIGNER.caller), "broker", SIGNER, state, log)
        assert "state uploaded" in log.getvalue()
        assert flying[1] == submit_module.UPLOAD_WINDOW  # the chunks after the first overlap
        other = await upload_state(client(OTHER_PEER), "broker", OTHER, state, log)
        with pytest.raises(JobError, match="not this submitter's upload"):  # someone else's bytes
            await service.rpc_submit_job(
                request_.model_copy(update={"state": b"", "state_upload": other}), ctx("submit_job")
            )
        with pytest.raises(JobError, match="both an inline state and a state upload"):
            await service.rpc_submit_job(
                request_.model_copy(update={"state_upload": upload}), ctx("submit_job")
            )
        # bytes that differ from what was signed: the signature covers the upload's hash
        tampered = state[:-1] + bytes([state[-1] ^ 1])
        bad = await upload_state(client(SIGNER.caller), "broker", SIGNER, tampered, log)
        with pytest.raises(JobError, match="bad submitter signature"):
            await service.rpc_submit_job(
                request_.model_copy(update={"state": b"", "state_upload": bad}), ctx("submit_job")
            )
        reply = await service.rpc_submit_job(
            request_.model_copy(update={"state": b"", "state_upload": upload}), ctx("submit_job")
        )
        job_id = reply["job_id"]
        folder = tmp_path / "jobs" / job_id
        assert (folder / "submission" / "state.safetensors").read_bytes() == state  # as it started
        await asyncio.gather(*service._tasks.values())
        assert service.ctx.store.get_job(job_id)["state"] == "SUCCEEDED"
        # ended: its submission and checkpoints are gone, its results stay
        assert not (folder / "submission").exists() and not list(folder.glob("ckpt*"))
        assert (folder / "plan.json").is_file() and (folder / "metrics.jsonl").is_file()
        # The same call again (its answer was lost, the RPC client repeats it): the same job, not an error
        again = await service.rpc_submit_job(
            request_.model_copy(update={"state": b"", "state_upload": upload}), ctx("submit_job")
        )
        assert again["job_id"] == job_id and len(service.runs) == 1
        # Another submission naming the upload: it was taken by the job
        other_request = signed(request_.model_copy(update={"request_id": "f" * 32, "auth": None}), SIGNER)
        with pytest.raises(JobError, match="no such upload"):
            await service.rpc_submit_job(
                other_request.model_copy(update={"state": b"", "state_upload": upload}), ctx("submit_job")
            )
        unsigned = UploadStateRequest(upload_id=UID, offset=0, total=10, data=b"x")
        with pytest.raises(JobError, match="not signed by a submitter key"):
            await service.rpc_upload_state(unsigned, ctx("upload_state"))
        await service.stop()

    asyncio.run(scenario())


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_submit_uploads_a_big_state_in_chunks_and_the_job_equals_plain_pytorch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end on a real swarm: ``submit_and_wait`` sends the state in chunks (made small here so
    that a small model needs several) and the job's weights equal plain PyTorch's."""
    from safetensors.torch import load_file

    from fusionnet.reference import run_reference
    from fusionnet.runtime.process_swarm import running_swarm
    from fusionnet.runtime.submit import submit_and_wait
    from tests.jobfiles import example_job

    monkeypatch.setattr(submit_module, "UPLOAD_CHUNK_BYTES", 2048)
    job_path = example_job("mlp", tmp_path, steps=3)
    out = tmp_path / "out"
    log = io.StringIO()
    try:
        assert len(submission_payload(load_job(job_path)).state) > 3 * 2048
        with running_swarm(tmp_path / "swarm", [{}, {}]) as sw:
            asyncio.run(submit_and_wait(job_path, sw.initial_peers, out, stream=log, timeout=240))
        ref = run_reference(load_job(job_path))
    finally:
        job_path.unlink()
    assert "state uploaded" in log.getvalue()
    got = load_file(out / "weights.safetensors")
    assert sorted(got) == sorted(ref.weights)
    assert max((got[k] - ref.weights[k]).abs().max().item() for k in got) <= 1e-6
