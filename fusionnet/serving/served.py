"""A deployment as the HTTP API sees it: ``ServedModel`` (name, kind, input row, batcher, tokenizer), the
``Deployments`` it looks them up in, and ``ApiError`` (an OpenAI-style error with its HTTP status)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fusionnet.errors import FusionNetError
from fusionnet.serving.answers import Closed, Overloaded, Oversized, RowsFailed
from fusionnet.serving.batching import DynamicBatcher
from fusionnet.serving.generation import Window
from fusionnet.serving.kv_sessions import SlotPool


class ApiError(Exception):
    """Answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def api_error(e: Exception) -> ApiError:
    """The answer to a request that failed with ``e``: its status, type and message (the HTTP layer's
    error responses, and a stream's error chunk after its 200 went out)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Overloaded):
        return ApiError(503, f"the deployment is overloaded: {e}; retry later", "server_overloaded")
    if isinstance(e, Oversized):  # more than it ever queues: a retry fails the same
        return ApiError(400, str(e)[:500])
    if isinstance(e, Closed):
        return ApiError(503, str(e)[:500], "server_error")
    if isinstance(e, RowsFailed):  # the model raised on this request's own rows, alone
        return ApiError(400, str(e)[:500])
    if isinstance(e, FusionNetError):  # the swarm failed the batch (after the failover's retries)
        return ApiError(503, f"the swarm could not run the request: {e}"[:500], "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")


@dataclass
class ServedModel:
    name: str
    kind: str  # "infer" | "generate"
    job_id: str
    row_shape: tuple[int, ...]  # one sample's input shape (the IR's, without the batch dimension)
    row_dtype: torch.dtype
    batcher: DynamicBatcher
    window: Window | None = None  # generate: the context window and vocabulary
    tokenizer: Any = None  # generate: a transformers tokenizer from the model folder, if it had one
    eos_token_ids: tuple[int, ...] = ()  # generate: the ids that end a text (the model's and tokenizer's)
    compnodes: int = 0
    created: float = field(default_factory=time.time)
    kv: SlotPool | None = None  # generate with KV caches on the compnodes: the sessions' cache slots
    epoch: Callable[[], int] = lambda: 0  # the placement the caches are on now (``kv_sessions``)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.created),
            "owned_by": "fusionnet",
            "kind": self.kind,
            "job_id": self.job_id,
            "compnodes": self.compnodes,
            "input_shape": list(self.row_shape),
            "input_dtype": str(self.row_dtype).removeprefix("torch."),
            "context": None if self.window is None else self.window.context,
            "tokenizer": self.tokenizer is not None,
            "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
            "queued_rows": self.batcher.queued_rows,
            "kv_cache_slots": None if self.kv is None else self.kv.slots,
        }


class Deployments(Protocol):
    def get(self, name: str) -> ServedModel | None: ...

    def all(self) -> list[ServedModel]: ...


class ServingObserver(Protocol):
    """What the HTTP layer reports (``fusionnet.metrics.ServingMetrics`` implements it)."""

    def observe_request(self, deployment: str, endpoint: str, status: int) -> None: ...

    def observe_tokens(self, deployment: str, prompt: int, completion: int) -> None: ...

    def observe_first_token(self, deployment: str, seconds: float) -> None: ...

    def observe_inter_token(self, deployment: str, seconds: float) -> None: ...

    def observe_batch(
        self,
        deployment: str,
        rows: int,
        seconds: float,
        queued_rows: int,
        kv_slots: int | None = None,
        missed_sessions: int = 0,
        *,
        failed: bool = False,
    ) -> None: ...

    def forget_deployment(self, deployment: str) -> None: ...

    def serve_deployment(self, deployment: str) -> None: ...

    def observe_kv_slots(self, deployment: str, in_use: int) -> None: ...

    def observe_deployments(self, count: int) -> None: ...
