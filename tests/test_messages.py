"""The typed RPC messages (``fusionnet.messages``): unknown fields ignored, bad ones refused with one
clear error naming the method and the field, replies checked on the client side, handlers that take
and return models. In-process: no daemon, no network."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from fusionnet.errors import WireError
from fusionnet.messages.base import handles, parse_message
from fusionnet.messages.broker_rpc import (
    BrokerClient,
    JobStatusRequest,
    PingReply,
    PingRequest,
    StatusRequest,
    SubmitJobRequest,
)
from fusionnet.messages.compnode_rpc import AssignRequest, CompnodeClient, StepReply, StepRequest
from fusionnet.messages.jobwire import RunSpec
from fusionnet.rpc.server import RPCContext

SPEC = {
    "name": "j",
    "task": "grad",
    "batch_size": 4,
    "microbatches": 2,
    "steps": 3,
    "n_samples": 8,
    "compnodes": 2,
}
PEER = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"


def assign_doc(**changes: Any) -> dict[str, Any]:
    doc = {
        "job_id": "abc123",
        "attempt": 1,
        "spec": SPEC,
        "ir": b"ir",
        "assignment": {"x": 0, "y": 1},
        "subdag": 1,
        "peers": [{"peer_id": "a" * 30}, {"peer_id": PEER, "data_address": "127.0.0.1:9"}],
        "key": b"k" * 32,
        "state": b"",
        "data": b"",
    }
    doc.update(changes)
    return doc


def test_unknown_fields_are_ignored_everywhere() -> None:
    """A newer peer may add fields, at any depth (the run spec included)."""
    doc = assign_doc(newer=1, spec={**SPEC, "newer": {"a": 1}})
    doc["peers"][0]["newer"] = True
    request = AssignRequest.model_validate(doc)
    assert request.spec.n_samples == 8 and request.peers[1].data_address == "127.0.0.1:9"
    assert "newer" not in request.model_dump()
    assert RunSpec.parse({**SPEC, "from_the_future": 3}).steps == 3


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"job_id": "no spaces"}, "job_id"),
        ({"job_id": 7}, "job_id"),
        ({"attempt": -1}, "attempt"),
        ({"attempt": True}, "attempt"),  # strict: a bool is no integer
        ({"ir": "text"}, "ir"),  # strict: a str is no bytes
        ({"assignment": {"x": "0"}}, "assignment.x"),
        ({"subdag": 2}, "(root)"),  # more sub-DAGs than peers
        ({"peers": []}, "peers"),
        ({"peers": [{"data_address": None}]}, "peers.0.peer_id"),
        ({"key": b"short"}, "key"),
        ({"spec": {**SPEC, "task": "dance"}}, "spec.task"),
        ({"spec": {**SPEC, "task": "train"}}, "spec"),  # train without an optimizer
    ],
)
def test_malformed_assign_requests_are_refused_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(WireError, match=rf"^rpc assign: malformed message: {re.escape(field)}: "):
        parse_message(AssignRequest, assign_doc(**change), "rpc assign")


def test_requests_check_their_ranges() -> None:
    with pytest.raises(WireError, match="since"):
        parse_message(JobStatusRequest, {"job_id": "a1", "since": -1}, "rpc job_status")
    with pytest.raises(WireError, match="job_limit"):
        parse_message(StatusRequest, {"job_limit": 10**9}, "rpc status")
    with pytest.raises(WireError, match="request_id"):
        parse_message(
            SubmitJobRequest,
            {"request_id": "x" * 65, "spec": SPEC, "ir": b"", "state": b"", "data": b""},
            "rpc submit_job",
        )
    assert StepRequest.model_validate({"job_id": "a1", "step": 0}).step == 0
    assert StepReply.model_validate({"step": 1, "fp_seconds": 1, "bp_seconds": 0.5}).busy_seconds == 1.5


class _Service:
    @handles(StepRequest)
    async def rpc_step(self, request: StepRequest, context: RPCContext) -> StepReply:
        return StepReply(step=request.step, loss=0.5)


def test_typed_handlers_refuse_bad_payloads_and_dump_their_replies() -> None:
    service = _Service()
    context = RPCContext(remote_peer=PEER, method="step")
    reply = asyncio.run(service.rpc_step({"job_id": "a1", "step": 3, "more": 1}, context))
    assert reply == StepReply(step=3, loss=0.5).model_dump()
    with pytest.raises(WireError, match=r"^rpc step: malformed message: step: "):
        asyncio.run(service.rpc_step({"job_id": "a1", "step": "3"}, context))
    assert asyncio.iscoroutinefunction(service.rpc_step)  # what RPCServer.add_handler requires


def test_typed_clients_send_dicts_and_check_replies() -> None:
    sent: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
    answers: dict[str, dict[str, Any]] = {
        "ping": {"nonce": "n", "peer_id": PEER, "state": "ONLINE", "extra": 1},
        "step": {"step": "not a number"},
    }

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        sent.append((peer, method, payload or {}, kw))
        return answers[method]

    reply = asyncio.run(BrokerClient(call).call_ping(PEER, PingRequest(nonce="n"), timeout=2.0))
    assert reply == PingReply(nonce="n", peer_id=PEER, state="ONLINE")
    assert sent[-1] == (PEER, "ping", {"nonce": "n", "jobs": None}, {"timeout": 2.0})
    with pytest.raises(WireError, match=rf"^rpc step reply from {PEER}: malformed message: step: "):
        asyncio.run(CompnodeClient(call).call_step(PEER, StepRequest(job_id="a1", step=0)))


def test_a_step_reply_with_timings_that_are_not_finite_seconds_is_refused() -> None:
    """A compnode's timings feed the broker's speed book, replica pacing, metrics.jsonl and the step's
    compute path: infinite, NaN or negative seconds are a garbled reply, refused saying which field."""
    from pydantic import ValidationError

    for bad in (float("inf"), float("nan"), -0.5):
        with pytest.raises(ValidationError, match="fp_seconds"):
            StepReply(step=1, fp_seconds=bad)
    assert StepReply(step=1, fp_seconds=0.25, bp_seconds=1e9).bp_seconds == 1e9
