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


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Each tensor becomes its own contiguous buffer (safetensors refuses shared storage: tied weights)."""
    return _save({k: v.detach().contiguous().clone() for k, v in tensors.items()})


def unpack_tensors(blob: object, what: str, *, max_bytes: int = MAX_BLOB_BYTES) -> dict[str, torch.Tensor]:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise WireError(f"{what}: expected safetensors bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise WireError(f"{what}: {len(blob)} bytes exceeds the {max_bytes}-byte bound")
    try:
        return dict(_load(bytes(blob)))
    except Exception as e:  # safetensors raises its own SafetensorError / ValueError subclasses
        raise WireError(f"{what}: not a valid safetensors blob ({type(e).__name__}: {e})") from None
