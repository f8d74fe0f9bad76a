"""What every typed message shares: the base model, the one way a payload is checked, and the client
and server halves of a typed call.

A message is a pydantic model that ignores fields it does not know (a newer peer may send more) and
checks the ones it does strictly (no ``"3"`` for 3, no ``True`` for 1, no ``str`` for bytes). On the
wire it stays what it was: a msgpack map (``model_dump()`` out, ``model_validate()`` in).

Server side: ``@handles(StepRequest)`` turns ``async def rpc_step(self, request: StepRequest,
context) -> StepReply`` into the ``(payload dict, context) -> dict`` handler ``fusionnet.rpc`` serves; a
payload that does not validate is refused with one ``WireError`` naming the method and the field, and
the daemon goes on serving. Client side: ``TypedCaller.call_typed`` sends a request model and checks
the reply against the reply model the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusionnet.errors import WireError

M = TypeVar("M", bound=BaseModel)
Req = TypeVar("Req", bound=BaseModel)
Self_ = TypeVar("Self_")

# A job id as brokers make them (``secrets.token_hex``): alphanumeric, bounded.
JobId = Annotated[str, Field(pattern=r"^[A-Za-z0-9]{1,64}$")]
PeerIdText = Annotated[str, Field(min_length=1, max_length=128)]


class Message(BaseModel):
    """Base of every RPC request and reply: unknown fields ignored, known ones checked strictly."""

    model_config = ConfigDict(extra="ignore", strict=True)


def first_error(e: ValidationError) -> str:
    """``field.path: what is wrong`` for the first problem pydantic found (one clear line)."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return f"{where}: {err.get('msg', 'invalid')}"


def parse_message(model: type[M], payload: object, what: str) -> M:
    """``payload`` as ``model``, or a ``WireError`` saying ``what`` was wrong and where."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        raise WireError(f"{what}: malformed message: {first_error(e)}"[:500]) from None


class HasMethod(Protocol):
    @property
    def method(self) -> str: ...


Handler = Callable[[Any, dict[str, Any], Any], Awaitable[dict[str, Any]]]


def handles(
    request: type[Req],
) -> Callable[[Callable[[Self_, Req, Any], Awaitable[BaseModel]]], Handler]:
    """Decorates a typed ``rpc_<name>(self, request, context) -> reply`` into a plain RPC handler."""

    def wrap(fn: Callable[[Self_, Req, Any], Awaitable[BaseModel]]) -> Handler:
        @functools.wraps(fn)
        async def handler(self: Self_, payload: dict[str, Any], context: HasMethod) -> dict[str, Any]:
            typed = parse_message(request, payload, f"rpc {context.method}")
            reply = await fn(self, typed, context)
            return reply.model_dump()

        handler.request_model = request  # type: ignore[attr-defined]  # for tests and docs
        return handler

    return wrap


class Caller(Protocol):
    """The untyped call the typed clients wrap: ``RPCClient.call``, ``Daemon.call``,
    ``SwarmObserver.call`` all fit."""

    def __call__(
        self, peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any
    ) -> Awaitable[dict[str, Any]]: ...


class TypedCaller:
    """Sends request models and checks replies: the common half of ``BrokerClient``/``CompnodeClient``."""

    def __init__(self, call: Caller) -> None:
        self._call = call

    async def call_typed(self, peer: str, method: str, request: BaseModel, reply: type[M], **kw: Any) -> M:
        raw = await self._call(peer, method, request.model_dump(), **kw)
        return parse_message(reply, raw, f"rpc {method} reply from {peer}")
