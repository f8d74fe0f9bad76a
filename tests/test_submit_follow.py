"""``submit`` following its job through a broker it cannot reach for a while (``runtime.submit._poll``):
a restart on its state dir is waited out; contact lost for good ends in one line that names the job
and what to do next, never a raw transport error a few seconds in."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.broker_rpc import BrokerClient, JobStatusRequest
from fusionnet.rpc.protocol import RPCError
from fusionnet.runtime import submit
from fusionnet.runtime.submitter import Signer

pytestmark = pytest.mark.timeout(30)
REFUSED = "Connect failed: dial tcp 127.0.0.1:4001: connect: connection refused"


def _client(answers: list[Any]) -> tuple[BrokerClient, list[str]]:
    """A broker client whose calls take the next of ``answers``: an exception is raised, a dict answered."""
    calls: list[str] = []

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        calls.append(method)
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return BrokerClient(call), calls


def _poll(client: BrokerClient) -> Any:
    return asyncio.run(submit._poll(client, "broker", JobStatusRequest(job_id="0123456789ab")))


def test_a_broker_restarting_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(submit, "POLL_INTERVAL", 0.001)
    down = RPCError(REFUSED, kind="ControlFailure")
    job = {"job_id": "0123456789ab", "name": "j", "state": "RUNNING", "step": 3}
    client, calls = _client([down] * 8 + [{"job": job}])  # more failures than the old 5 retries
    assert _poll(client).job["step"] == 3 and len(calls) == 9


def test_contact_lost_for_good_names_the_job_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(submit, "POLL_INTERVAL", 0.001)
    monkeypatch.setattr(submit, "LOST_CONTACT", 0.05)
    client, calls = _client([RPCError(REFUSED, kind="ControlFailure")])
    with pytest.raises(ExecutionError) as lost:
        _poll(client)
    said = str(lost.value)
    assert said.startswith("lost contact with the broker for 0.05 s while following job 0123456789ab")
    assert "fusionnet results 0123456789ab --output DIR" in said and "fusionnet cancel 0123456789ab" in said
    assert len(calls) > 1


def test_a_refusal_is_not_retried() -> None:
    client, calls = _client([JobError("no job with id '0123456789ab'")])
    with pytest.raises(JobError, match="no job with id"):
        _poll(client)
    assert calls == ["job_status"]


def test_an_interrupted_submission_is_looked_up_and_cancelled(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the broker takes the job in: the same request again names the job (the broker answers
    a request id it knows with its job), which is cancelled, and the user is told; before, the job ran on
    with nobody waiting for it and the user never learnt its id."""
    import sys

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fusionnet.messages.broker_rpc import SubmitJobRequest

    calls: list[tuple[str, dict[str, Any]]] = []

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        calls.append((method, payload or {}))
        if method == "submit_job":
            return {"job_id": "0123456789ab", "steps": 5}
        return {"state": "CANCELLED", "cancelled": True, "message": "job 0123456789ab cancelled"}

    signer = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))), broker="broker", caller="me")
    request = SubmitJobRequest.model_construct(request_id="r1")
    asyncio.run(submit._withdraw(BrokerClient(call), "broker", request, signer, sys.stderr))
    assert [m for m, _ in calls] == ["submit_job", "cancel_job"] and calls[1][1]["job_id"] == "0123456789ab"
    said = "job 0123456789ab cancelled on the broker (the submitter was interrupted)"
    assert said in capsys.readouterr().err
