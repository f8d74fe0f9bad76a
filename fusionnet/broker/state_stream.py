"""One sub-DAG's slice of a checkpoint as a safetensors byte stream, cut into parts of bounded size.

An assignment used to carry its slice inline: the broker read the tensors from disk, packed them into
one blob and encoded that into one RPC message, three copies of the slice at once (1.05 GB peak for a
125M-parameter Llama's first sub-DAG of 0.23 GB, over issue 11's 1 GB bound, and growing with the
model). A slice over ``PART_BYTES`` now goes to the compnode before its ``assign`` in ``stage_state``
calls of at most ``PART_BYTES`` each (``compnode.staging``), and the broker builds each part by
copying the bytes of the tensors straight from the checkpoint's files (``TensorFiles.byte_ranges``):
whatever the model size, the broker holds one part and its encoded message.

The stream is a plain safetensors file (``results.stream_safetensors``: 8-byte header length, JSON
header, tensors back to back in header order), so the compnode decodes it as it would an inline blob.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from fusionnet.broker.tensorfiles import TensorFiles
from fusionnet.results.stream_safetensors import describe, header

PART_BYTES = 32 << 20

# Where the bytes of one stretch of the stream come from: bytes in memory, or (file, offset, length).
Source = bytes | memoryview | tuple[Path, int, int]


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


class SliceStream:
    """The safetensors bytes of ``keys`` of ``tensors`` (a ``TensorFiles`` on disk or a dict)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
        self._tensors = tensors
        self.keys = list(keys)
        view = tensors.restricted(self.keys) if isinstance(tensors, TensorFiles) else self._subset()
        head = header(view)
        self._head = struct.pack("<Q", len(head)) + head
        sizes = []
        for k in self.keys:
            dtype, shape = describe(view, k)
            numel = 1
            for n in shape:
                numel *= n
            sizes.append(numel * dtype.itemsize)
        self.total = len(self._head) + sum(sizes)

    def _subset(self) -> dict[str, torch.Tensor]:
        return {k: self._tensors[k] for k in self.keys}

    def _sources(self) -> Iterator[Source]:
        yield self._head
        if isinstance(self._tensors, TensorFiles):
            yield from self._tensors.byte_ranges(self.keys).values()
            return
        for k in self.keys:
            yield _raw(self._tensors[k])

    def parts(self, part_bytes: int = PART_BYTES) -> Iterator[bytes]:
        """The stream in consecutive parts of ``part_bytes`` (the last one shorter); a file's bytes are
        read into the part's buffer directly."""
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
        buf = bytearray(part_bytes)
        view = memoryview(buf)
        fill = 0
        for source in self._sources():
            if isinstance(source, tuple):
                path, offset, length = source
                with path.open("rb", buffering=0) as f:
                    f.seek(offset)
                    while length:
                        take = min(length, part_bytes - fill)
                        got = f.readinto(view[fill : fill + take])
                        if not got:
                            raise OSError(f"{path.name}: file ended {length} bytes before a tensor's end")
                        fill += got
                        length -= got
                        if fill == part_bytes:
                            yield bytes(view)
                            fill = 0
                continue
            data = memoryview(source).cast("B")
            while len(data):
                take = min(len(data), part_bytes - fill)
                view[fill : fill + take] = data[:take]
                fill += take
                data = data[take:]
                if fill == part_bytes:
                    yield bytes(view)
                    fill = 0
        if fill:
            yield bytes(view[:fill])
