"""The RPC wire format: msgpack envelopes and length-prefixed stream frames. Pure functions, no I/O.

A request is the msgpack map ``{"v": 1, "method": str, "payload": map}``; a response is either
``{"ok": true, "result": map}``, ``{"ok": false, "error": {"kind": str, "message": str}}`` or, for a
small (unary) call whose answer is too big for a unary reply, ``{"ok": true, "stashed": bytes, "size":
int}``: the caller then fetches the answer over a stream with the reserved method ``$fetch``.

On a stream every message is one frame: the 4-byte magic ``FNR1``, an 8-byte big-endian body length,
then the body. The length comes first so that a receiver refuses an oversized message before it reads
(or allocates) any of it.

Everything a peer sends is decoded with msgpack only (no pickle, no ext types turned into objects);
anything that is not exactly the shape above is refused with a ``WireError`` naming what was wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgpack

from fusionnet.errors import (
    ComputeError,
    DeviceMemoryError,
    ExecutionError,
    FusionNetError,
    IRError,
    JobError,
    PartitionError,
    PlanError,
    TraceError,
    WireError,
)

PROTOCOL_VERSION = 1
UNARY_PROTOCOL = "/fusionnet/rpc/1"
STREAM_PROTOCOL = "/fusionnet/rpc-stream/1"
KEPT_PROTOCOL = "/fusionnet/rpc-kept/1"  # a stream that carries calls one after another (``kept.py``)
KEPT_IDLE = 60.0  # s the server keeps a kept stream that carries no call
KEPT_PER_PEER = 32  # kept streams one peer may hold open on a server; more are closed at once
FETCH_METHOD = "$fetch"  # reserved: fetch a stashed response over a stream

FRAME_MAGIC = b"FNR1"
FRAME_HEADER_LEN = len(FRAME_MAGIC) + 8
STREAM_CHUNK = 1 << 20

# Measured on loopback here (replicated hivemind P2P, 2 processes): a unary call costs ~2 ms for 100 B but
# ~12 ms for 100 KB, while a stream costs ~4-5 ms for anything up to 100 KB and 21 ms for 2 MB (unary: 88 ms;
# hivemind refuses unary messages above 4 MiB). So small calls go unary and everything else streams.
DEFAULT_UNARY_LIMIT = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024

_METHOD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

# Remote errors of these kinds are raised again on the caller's side as the same class, so that a caller can
# ``except PlanError`` around a remote call. Looked up by name in this table only: nothing is evaluated.
REMOTE_ERROR_CLASSES: dict[str, type[FusionNetError]] = {
    cls.__name__: cls
    for cls in (
        JobError,
        TraceError,
        IRError,
        PartitionError,
        PlanError,
        WireError,
        ExecutionError,
        ComputeError,
        DeviceMemoryError,
    )
}


class RPCError(FusionNetError, RuntimeError):
    """A remote call failed for a reason other than a FusionNet error raised by the remote handler:
    the peer is unreachable, the call timed out, the transport broke, or the handler crashed."""

    def __init__(self, message: str, *, peer: str = "", method: str = "", kind: str = "RPCError"):
        super().__init__(message)
        self.peer, self.method, self.kind = peer, method, kind


@dataclass(frozen=True)
class Request:
    method: str
    payload: dict[str, Any]


def check_method_name(method: str) -> str:
    if not isinstance(method, str) or not _METHOD_RE.fullmatch(method):
        raise WireError(f"rpc method name {method!r} is not an identifier of at most 64 characters")
    return method


def _pack(obj: Any, what: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"{what} cannot be encoded as msgpack: {e}") from e


def _unpack(data: bytes, what: str) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        # strict_map_key: only str/bytes keys; ext types stay inert ExtType values (refused below).
        # (no bytes(data): a big message's buffer is not copied once more before it is decoded)
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError, ...)
        raise WireError(f"{what} is not valid msgpack ({type(e).__name__}: {e})") from e


def encode_request(method: str, payload: dict[str, Any] | None) -> bytes:
    if method != FETCH_METHOD:
        check_method_name(method)
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise WireError(f"rpc {method}: payload must be a dict, got {type(payload).__name__}")
    return _pack({"v": PROTOCOL_VERSION, "method": method, "payload": payload}, f"rpc {method} request")


def decode_request(data: bytes) -> Request:
    doc = _unpack(data, "rpc request")
    if not isinstance(doc, dict) or not {"v", "method", "payload"} <= doc.keys():
        raise WireError("rpc request must be a map with keys 'v', 'method' and 'payload'")
    if doc["v"] != PROTOCOL_VERSION:
        raise WireError(f"rpc request has protocol version {doc['v']!r}; this peer speaks {PROTOCOL_VERSION}")
    method = doc["method"]
    if method != FETCH_METHOD:
        check_method_name(method)
    if not isinstance(doc["payload"], dict):
        raise WireError(f"rpc {method}: payload must be a map, got {type(doc['payload']).__name__}")
    return Request(method=method, payload=doc["payload"])


def encode_result(result: dict[str, Any]) -> bytes:
    return _pack({"ok": True, "result": result}, "rpc result")


def encode_error(kind: str, message: str) -> bytes:
    return _pack({"ok": False, "error": {"kind": str(kind), "message": str(message)}}, "rpc error")


def encode_stashed(token: bytes, size: int) -> bytes:
    return _pack({"ok": True, "stashed": token, "size": int(size)}, "rpc stash reference")


@dataclass(frozen=True)
class Response:
    """A decoded response: exactly one of ``result``, ``error`` (kind, message) or ``stashed`` is set."""

    result: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    stashed: bytes | None = None
    size: int = 0


def decode_response(data: bytes) -> Response:
    doc = _unpack(data, "rpc response")
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        raise WireError("rpc response must be a map with a boolean 'ok'")
    if not doc["ok"]:
        err = doc.get("error")
        if not isinstance(err, dict) or not isinstance(err.get("kind"), str):
            raise WireError("rpc error response lacks an 'error' map with a 'kind'")
        return Response(error=(err["kind"], str(err.get("message", ""))))
    if "stashed" in doc:
        if not isinstance(doc["stashed"], bytes) or not isinstance(doc.get("size"), int):
            raise WireError("rpc stash reference must carry bytes 'stashed' and an integer 'size'")
        return Response(stashed=doc["stashed"], size=doc["size"])
    if not isinstance(doc.get("result"), dict):
        raise WireError("rpc response lacks a 'result' map")
    return Response(result=doc["result"])


def frame_header(length: int) -> bytes:
    assert length >= 0
    return FRAME_MAGIC + length.to_bytes(8, "big")


def parse_frame_header(header: bytes, max_bytes: int, what: str) -> int:
    """Validates a frame header and returns the body length; refuses garbage and oversized bodies."""
    if len(header) != FRAME_HEADER_LEN or header[: len(FRAME_MAGIC)] != FRAME_MAGIC:
        raise WireError(f"{what}: not a FusionNet RPC frame (bad magic {bytes(header[:4])!r})")
    length = int.from_bytes(header[len(FRAME_MAGIC) :], "big")
    if length > max_bytes:
        raise WireError(f"{what} of {length} bytes exceeds the limit of {max_bytes} bytes")
    return length


def remote_exception(kind: str, message: str, *, peer: str, method: str) -> FusionNetError:
    """The exception a caller raises for an error response: the same project error class when the remote
    raised one (message verbatim), else an ``RPCError`` that names the peer, the method and the kind."""
    cls = REMOTE_ERROR_CLASSES.get(kind)
    if cls is not None:
        exc = cls(message)
        exc.peer, exc.method = peer, method  # type: ignore[attr-defined]
        return exc
    return RPCError(
        f"rpc {method} on peer {peer} failed: {kind}: {message}", peer=peer, method=method, kind=kind
    )
