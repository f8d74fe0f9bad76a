"""safetensors written a tensor at a time: the result weights of a model the writer never holds whole.

``safetensors.torch.save_file`` takes every tensor at once and turns each into bytes first, so writing
a model's weights cost two to three times the model in memory. Here the tensors come from a mapping
that may read them lazily (``broker.tensorfiles.TensorFiles``: one tensor from disk per access): a
first pass gets each tensor's dtype and shape for the header (from the mapping's ``meta`` when it has
one, which reads a file's header and no tensor bytes), a second writes their bytes in the same order.
The layout is the format's own (an 8-byte little-endian header length, the JSON header padded with
spaces to 8 bytes, then the tensors back to back, in header order), so any safetensors reader loads
the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


NAMES = {name: dtype for dtype, name in DTYPES.items()}
TensorMeta = tuple[torch.dtype, tuple[int, ...]]


def describe(tensors: Mapping[str, torch.Tensor], key: str) -> TensorMeta:
    """``key``'s dtype and shape: from ``tensors.meta`` when the mapping offers it (files on disk), else
    from the tensor itself."""
    meta = getattr(tensors, "meta", None)
    if meta is not None:
        return meta(key)
    t = tensors[key]
    return t.dtype, tuple(t.shape)


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (a copy only when it is not contiguous on the CPU)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def header(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The JSON header for ``tensors`` in their iteration order, padded to 8 bytes."""
    doc: dict[str, object] = {}
    offset = 0
    for key in tensors:
        dtype, shape = describe(tensors, key)
        if dtype not in DTYPES:
            raise TypeError(f"{key!r}: dtype {dtype} has no safetensors name")
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        doc[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_stream(out: BinaryIO, tensors: Mapping[str, torch.Tensor]) -> None:
    head = header(tensors)
    out.write(struct.pack("<Q", len(head)))
    out.write(head)
    for key in tensors:
        out.write(_raw(tensors[key]))


def save_streaming(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    with path.open("wb") as f:
        write_stream(f, tensors)
