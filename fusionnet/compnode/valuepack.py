"""A whole small value in one frame: its tensors side by side in one buffer behind a msgpack head.

Why: a value used to travel as one frame per tensor plus a structure frame, and every frame costs a
header, two MACs, a buffer and a wake-up on both ends (tens of microseconds each), which dominates
for the small activations of real models. A value whose tensors total at most ``PACK_MAX`` bytes is
copied once into a packed buffer (cheap at that size) and sent as a single structure frame.

Payload layout (a uint8 tensor)::

    MAGIC (4) | head length (u32, big-endian) | head (msgpack) | zeros to ALIGN | part 0 | zeros | part 1 ...

``head = {"tree": structure, "parts": [[dtype, shape, offset], ...], "codecs": [info or None, ...]}``.
Every part starts at a multiple of ``ALIGN`` (so it can be viewed in place as its dtype), parts do
not overlap and lie inside the payload; the receiver checks all of that, the dtype allowlist and bool
bytes, before it makes a tensor view of any part. Nothing is copied on the receiving side.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np
import torch

from fusionnet.errors import WireError
from fusionnet.wire.header import ALLOWED_DTYPES, dtype_name, is_shape

MAGIC = b"FNV1"
_HEAD = struct.Struct(">4sI")
ALIGN = 64
PACK_MAX = 1 << 20  # values up to this many tensor bytes travel packed
MAX_HEAD = 1 << 20
MAX_PARTS = 4096
# dtypes whose bytes numpy views directly (bfloat16 has no numpy dtype: it takes torch's way)
_NUMPY_DTYPES: dict[torch.dtype, type] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_packed(payload: torch.Tensor) -> bool:
    return (
        payload.dtype == torch.uint8
        and payload.numel() >= _HEAD.size
        and payload[:4].numpy().tobytes() == MAGIC
    )


def pack_value(tree: Any, tensors: list[torch.Tensor], codecs: list[dict[str, Any] | None]) -> torch.Tensor:
    """One uint8 tensor holding ``tensors`` (contiguous CPU copies are made here) and their description.

    Built in a ``bytearray`` with buffer copies, not with torch ops: a small torch op costs a few
    microseconds of dispatch, and a value of four tensors took about 30 of them per frame."""
    flat = [_bytes_of(t) for t in tensors]
    parts, offset = [], 0
    for t, raw in zip(tensors, flat):
        parts.append([dtype_name(t.dtype), list(t.shape), offset])
        offset = _aligned(offset + len(raw))
    head = msgpack.packb({"tree": tree, "parts": parts, "codecs": codecs}, use_bin_type=True)
    start = _aligned(_HEAD.size + len(head))
    out = bytearray(start + offset)  # zeroed: the padding between parts is zeros
    _HEAD.pack_into(out, 0, MAGIC, len(head))
    out[_HEAD.size : _HEAD.size + len(head)] = head
    with memoryview(out) as view:
        for (_, _, at), raw in zip(parts, flat):
            view[start + at : start + at + len(raw)] = raw
    return torch.frombuffer(out, dtype=torch.uint8)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t``'s data, copied to the CPU and made contiguous where it is not."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not t.numel():
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES and not (t.is_conj() or t.is_neg()):
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()).cast("B")


def unpack_value(payload: torch.Tensor) -> tuple[Any, dict[int, torch.Tensor], list[Any]]:
    """``(tree, tensors by index, codec infos)`` of a packed payload; ``WireError`` for anything off.

    The parts are numpy views of the payload's memory turned into tensors (``_part_tensor``): no copy,
    and no torch op per slice."""
    size = payload.numel()
    if payload.dtype != torch.uint8 or payload.dim() != 1 or size < _HEAD.size:
        raise WireError(f"a packed value is a flat uint8 payload of at least {_HEAD.size} bytes")
    data = payload.contiguous().numpy()
    magic, head_len = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or not 0 < head_len <= min(MAX_HEAD, size - _HEAD.size):
        raise WireError(f"packed value head of {head_len} bytes in a {size} byte payload")
    try:
        doc = msgpack.unpackb(
            data[_HEAD.size : _HEAD.size + head_len].tobytes(),
            raw=False,
            strict_map_key=True,
            max_array_len=1 << 16,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types for hostile input; all mean the same here
        raise WireError(f"packed value head is not msgpack: {type(e).__name__}") from None
    if not isinstance(doc, dict) or set(doc) != {"tree", "parts", "codecs"}:
        raise WireError("packed value head must hold tree, parts and codecs")
    parts, codecs = doc["parts"], doc["codecs"]
    if not isinstance(parts, list) or not isinstance(codecs, list) or len(parts) != len(codecs):
        raise WireError("packed value parts and codecs must be lists of one length")
    if len(parts) > MAX_PARTS:
        raise WireError(f"packed value of {len(parts)} parts (at most {MAX_PARTS})")
    start = _aligned(_HEAD.size + head_len)
    tensors, end = {}, 0
    for i, part in enumerate(parts):
        dtype, shape, offset = _check_part(part, i)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < end or offset % ALIGN or start + offset + nbytes > size:
            raise WireError(f"packed part {i} at {offset} (+{nbytes} bytes) overlaps or leaves the payload")
        end = offset + nbytes
        raw = data[start + offset : start + offset + nbytes]
        if dtype == torch.bool and nbytes and int(raw.max()) > 1:
            raise WireError(f"packed bool part {i} holds bytes other than 0/1")
        tensors[i] = _part_tensor(payload, raw, start + offset, dtype, shape)
    return doc["tree"], tensors, codecs


def _part_tensor(
    payload: torch.Tensor, raw: np.ndarray, at: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    """The part at byte ``at`` of ``payload`` (``raw``: those bytes) as a tensor of its own."""
    as_numpy = _NUMPY_DTYPES.get(dtype)
    if as_numpy is not None and raw.size:
        # ``from_numpy`` of a reshaped view: a tensor that owns its (shared) memory, not a torch view
        # (``_own_tensor`` says why that matters); the array keeps the payload's memory alive.
        return torch.from_numpy(raw.view(as_numpy).reshape(shape))
    return _own_tensor(payload[at : at + raw.size].view(dtype).reshape(shape))


def _own_tensor(view: torch.Tensor) -> torch.Tensor:
    """``view``'s memory as a tensor that autograd does not count as a view, without a copy.

    Why: a part sliced out of the payload is a view, and the graph a compnode runs may mutate what it
    receives as a model would its own tensor: ``torch.export`` writes ``detach_`` on lifted constants,
    which torch refuses on a view ("Can't detach views in-place") though it works on the sender's
    original. Parts do not overlap, so each owning its span is safe.
    """
    return view.new_empty(0).set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def _check_part(part: object, i: int) -> tuple[torch.dtype, list[int], int]:
    if not isinstance(part, list) or len(part) != 3:
        raise WireError(f"packed part {i} must be [dtype, shape, offset]")
    name, shape, offset = part
    dtype = ALLOWED_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise WireError(f"packed part {i}: dtype {str(name)[:32]!r} is not allowed")
    if not isinstance(shape, list) or not is_shape(shape, 1 << 40):
        raise WireError(f"packed part {i}: bad shape {str(shape)[:80]}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise WireError(f"packed part {i}: bad offset {offset!r}")
    return dtype, shape, offset
