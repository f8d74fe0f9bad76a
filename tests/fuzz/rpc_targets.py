"""Fuzz targets for the RPC layer: request and reply envelopes, then every typed message model.

A peer's RPC bytes meet two decoders in turn: ``rpc.protocol`` (the msgpack envelope) and the method's
pydantic model (``messages.base.parse_message``). The targets below chain them as the server and the
client do. Seeds are one valid envelope per model in ``messages.broker_rpc`` and
``messages.compnode_rpc``, built from field values that the models accept (``_VALUES``, by field name,
then by type), so that mutations start from messages that reach deep into the models.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from fusionnet.errors import WireError
from fusionnet.messages import broker_rpc, compnode_rpc
from fusionnet.messages.base import Message, parse_message
from fusionnet.rpc.protocol import decode_request, decode_response, encode_request, encode_result
from tests.fuzz.targets import PEER, Target

_SPEC = {
    "name": "j",
    "task": "grad",
    "batch_size": 4,
    "microbatches": 2,
    "steps": 3,
    "n_samples": 8,
    "compnodes": 2,
}
# Values the models accept for fields whose type alone does not say enough (patterns, lengths).
_VALUES: dict[str, Any] = {
    "job_id": "abc123",
    "peer_id": PEER,
    "spec": _SPEC,
    "key": b"k" * 32,
    "peers": [{"peer_id": "a" * 30}, {"peer_id": PEER, "data_address": "127.0.0.1:9"}],
    "subdag": 1,
    "assignment": {"x": 0, "y": 1},
    "state": b"",
    "data": b"",
    "ir": b"ir",
    "nonce": "n1",
}


def _models() -> dict[str, type[Message]]:
    out: dict[str, type[Message]] = {}
    for module in (broker_rpc, compnode_rpc):
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, Message) and value is not Message:
                out[name] = value
    return out


MODELS = _models()


def _example(annotation: Any) -> Any:
    """A plain value of ``annotation``'s type (the first choice of a union, None last)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _example(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        choices = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _example(choices[0]) if choices else None
    if origin in (list, tuple, set):
        return []
    if origin is dict:
        return {}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _payload(annotation)
    return {str: "abc", int: 1, float: 0.5, bool: True, bytes: b"x"}.get(annotation)


def _payload(model: type[BaseModel], named: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if named and name in _VALUES:
            doc[name] = _VALUES[name]
        elif field.is_required():
            doc[name] = _example(field.annotation)
    return doc


def _valid_payloads() -> dict[str, dict[str, Any]]:
    """Per model name, a payload it accepts (models whose synthetic payload it refuses are left out)."""
    out = {}
    for name, model in MODELS.items():
        for doc in (_payload(model), _payload(model, named=False)):  # a name may mean another thing
            try:
                model.model_validate(doc)
            except ValidationError:
                continue
            out[name] = doc
            break
    return out


def _check(method: str, payload: object) -> object:
    model = MODELS.get(method)
    if model is None:
        raise WireError(f"unknown method {method[:64]!r}")
    return parse_message(model, payload, f"fuzz {method}")


def rpc_request_target() -> Target:
    seeds = [encode_request(name, doc) for name, doc in _valid_payloads().items()]

    def call(data: bytes) -> object:
        request = decode_request(data)
        return _check(request.method, request.payload)

    return Target("rpc_request", call, seeds, (WireError,))


def rpc_reply_target() -> Target:
    # A reply names no method: the seed's model rides in the result under a key the fuzzer can mutate.
    seeds = [encode_result({"model": name, "body": doc}) for name, doc in _valid_payloads().items()]

    def call(data: bytes) -> object:
        response = decode_response(data)
        result = response.result if isinstance(response.result, dict) else {}
        name = result.get("model")
        return _check(name if isinstance(name, str) else "", result.get("body"))

    return Target("rpc_reply", call, seeds, (WireError,))
