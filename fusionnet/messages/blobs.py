"""Tensors <-> bytes for job messages (submission, assignment, results): safetensors, never pickle.

safetensors is a JSON header plus raw little-endian buffers, so decoding bytes from a peer can only
ever yield plain tensors; anything else (garbage, a truncated buffer, a header that lies about sizes)
is refused with a ``WireError`` that says which blob was bad.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as _load
from safetensors.torch import save as _save

from fusionnet.errors import WireError

MAX_BLOB_BYTES = 1 << 30


def own_storage(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor contiguous and on a storage of its own, as safetensors wants (it refuses shared
    storage: tied weights). Only a tensor whose storage an earlier one already uses is copied: cloning
    them all would hold the whole state twice while a large model is packed."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel():
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    return out


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    return _save(own_storage(tensors))


def unpack_tensors(blob: object, what: str, *, max_bytes: int = MAX_BLOB_BYTES) -> dict[str, torch.Tensor]:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise WireError(f"{what}: expected safetensors bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise WireError(f"{what}: {len(blob)} bytes exceeds the {max_bytes}-byte bound")
    try:
        return dict(_load(bytes(blob)))
    except Exception as e:  # safetensors raises its own SafetensorError / ValueError subclasses
        raise WireError(f"{what}: not a valid safetensors blob ({type(e).__name__}: {e})") from None
