"""A deployment's batches as frames on the direct data path: the broker's ``serve_step`` to a compnode's
sandbox worker and the worker's answer, without the RPC layer (issue 14, the serving path).

Why: a batch's ``serve_step`` went broker -> its p2pd -> the compnode's p2pd -> the daemon -> the
worker, and its answer back the same way: ten process hops per decode pass on a three-stage
pipeline, about 2.7 ms of an 18 ms pass at the serving benchmark's small size, beside 12 ms of compute.
On the data path the broker writes the request straight into the worker's connection and the worker
writes its answer back on it (``broker.serve_links``, ``compnode.worker_serves``).

Both are ``ctrl`` frames of the deployment's job: ``serve`` (broker -> worker) and ``served`` (worker ->
broker), the step in the frame's ``step``, the message as msgpack bytes in a uint8 payload. They are
authenticated like every frame (the key of the broker's link to that sub-DAG, ``AssignRequest.
serve_key``; the receiver named; a fresh sequence number) and validated here into the same pydantic
models the RPC carries: nothing is unpickled or evaluated. An answer is the ``ServeStepReply`` or an
error as ``[class name, message]``, mapped back to the same FusionNet class the RPC layer would raise.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from fusionnet.errors import ExecutionError, FusionNetError, WireError
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest
from fusionnet.rpc.protocol import REMOTE_ERROR_CLASSES
from fusionnet.wire.frames import TensorFrame

SERVE = "serve"
SERVED = "served"
MAX_ERROR_CHARS = 4000


def _payload(doc: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(msgpack.packb(doc, use_bin_type=True)), dtype=torch.uint8)


def _doc(frame: TensorFrame, what: str) -> Any:
    t = frame.tensor
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise WireError(f"{what}: the payload must be a flat uint8 tensor, got {t.dtype} {list(t.shape)}")
    try:
        return msgpack.unpackb(t.numpy().tobytes(), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:
        raise WireError(f"{what}: the payload is not msgpack ({type(e).__name__})") from None


def request_frame(broker: str, request: ServeStepRequest) -> TensorFrame:
    """The broker's ``serve_step`` as a frame."""
    doc = request.model_dump()
    return TensorFrame(request.job_id, broker, "ctrl", request.step, 0, SERVE, _payload(doc))


def request_of(frame: TensorFrame) -> ServeStepRequest:
    """The ``ServeStepRequest`` a ``serve`` frame carries (``WireError`` if it is not one, or names
    another job or step than its frame)."""
    where = f"serve frame of job {frame.job_id} step {frame.step}"
    doc = _doc(frame, where)
    try:
        request = ServeStepRequest.model_validate(doc)
    except Exception as e:
        raise WireError(f"{where}: not a serve_step request ({str(e)[:200]})") from None
    if request.job_id != frame.job_id or request.step != frame.step:
        raise WireError(f"{where}: it names job {request.job_id} step {request.step}")
    return request


def answer_frame(
    job_id: str, sender: str, step: int, reply: ServeStepReply | None, error: BaseException | None = None
) -> TensorFrame:
    """A worker's answer to the ``serve`` frame of ``step``: its reply, or the error it raised."""
    if reply is not None:
        doc: dict[str, Any] = {"reply": reply.model_dump()}
    else:
        assert error is not None
        if isinstance(error, FusionNetError):
            kind, message = type(error).__name__, str(error)
        else:
            kind, message = ExecutionError.__name__, f"{type(error).__name__}: {error}"
        doc = {"error": [kind, message[:MAX_ERROR_CHARS]]}
    return TensorFrame(job_id, sender, "ctrl", step, 0, SERVED, _payload(doc))


def answer_of(frame: TensorFrame) -> ServeStepReply:
    """The reply a ``served`` frame carries; the error it carries raised as the RPC layer would (the same
    FusionNet class, looked up by name: nothing is evaluated), ``WireError`` when it is neither."""
    where = f"served frame of job {frame.job_id} step {frame.step}"
    doc = _doc(frame, where)
    if isinstance(doc, dict) and set(doc) == {"error"}:
        error = doc["error"]
        if not isinstance(error, list) or len(error) != 2 or not all(isinstance(x, str) for x in error):
            raise WireError(f"{where}: a malformed error")
        raise REMOTE_ERROR_CLASSES.get(error[0], ExecutionError)(error[1][:MAX_ERROR_CHARS])
    if not isinstance(doc, dict) or set(doc) != {"reply"}:
        raise WireError(f"{where}: neither a reply nor an error")
    try:
        reply = ServeStepReply.model_validate(doc["reply"])
    except Exception as e:
        raise WireError(f"{where}: not a serve_step reply ({str(e)[:200]})") from None
    if reply.step != frame.step:
        raise WireError(f"{where}: the reply is for step {reply.step}")
    return reply
