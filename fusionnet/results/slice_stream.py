"""A set of tensors as one safetensors byte stream, read a part at a time: how state moves in bounded
messages whatever the size of the model or of any one tensor (issue 11).

The stream is a plain safetensors file (``stream_safetensors``: 8-byte header length, JSON header,
tensors back to back in header order), so whoever puts the parts together back to back has a file any
safetensors reader loads. Parts are byte ranges, not groups of tensors: a 100 MB embedding crosses in
as many parts as it takes, and no message is bigger than the part size.

Two uses. The broker sends a sub-DAG's slice of its checkpoint to a compnode ahead of the assignment
(``stage_state``, ``compnode.staging``): the tensors come from ``broker.tensorfiles.TensorFiles``,
whose ``byte_ranges`` say where each tensor's bytes lie in its file, so a part is filled by reading the
file into it, never by making a tensor first. A compnode answers ``collect`` with the byte ranges of
its live state: the parts are copied from the tensors' memory, never packed whole.

Before (measured on the broker of a 125M-parameter Llama): an assignment held its slice three times
(tensors, packed blob, encoded message), 1.05 GB peak against issue 11's 1 GB bound.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from fusionnet.results.stream_safetensors import describe, header

PART_BYTES = 32 << 20

# Where the bytes of one stretch of the stream come from: bytes in memory, or (file, offset, length).
Source = memoryview | tuple[Path, int, int]


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


class SliceStream:
    """The safetensors bytes of ``keys`` of ``tensors``: a dict, or a mapping with ``restricted(keys)``
    and ``byte_ranges(keys)`` (``TensorFiles``) whose bytes are read from files."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
        self.keys = list(keys)
        on_disk = hasattr(tensors, "byte_ranges")
        view = tensors.restricted(self.keys) if on_disk else {k: tensors[k] for k in self.keys}  # type: ignore
        head = header(view)
        head = struct.pack("<Q", len(head)) + head
        sizes = [_nbytes(*describe(view, k)) for k in self.keys]
        self.total = len(head) + sum(sizes)
        self._tensors, self._on_disk, self._head = tensors, on_disk, head
        # On disk: where each key's bytes lie, from one read of each file's header.
        self._ranges = tensors.byte_ranges(self.keys) if on_disk else {}  # type: ignore[attr-defined]
        self._last: tuple[int, memoryview] | None = None
        # Stream offset of each segment (the header, then every key), for random access by ``read``.
        self._starts = [0]
        for n in (len(head), *sizes[:-1]) if sizes else ():
            self._starts.append(self._starts[-1] + n)

    def _source(self, index: int) -> Source:
        if index == 0:
            return memoryview(self._head)
        key = self.keys[index - 1]
        if self._on_disk:
            return self._ranges[key]
        if self._last is None or self._last[0] != index:  # a device tensor is copied out once per part
            self._last = (index, _raw(self._tensors[key]))
        return self._last[1]

    def read_into(self, start: int, out: memoryview) -> None:
        """Fills ``out`` with the stream's bytes from ``start`` (``out`` must not run past the end)."""
        if start < 0 or start + len(out) > self.total:
            raise ValueError(f"bytes [{start}, {start + len(out)}) outside the stream's {self.total}")
        index = bisect.bisect_right(self._starts, start) - 1
        filled = 0
        while filled < len(out):
            source = self._source(index)
            skip = start + filled - self._starts[index]
            if isinstance(source, tuple):
                path, offset, length = source
                take = min(length - skip, len(out) - filled)
                with path.open("rb", buffering=0) as f:
                    f.seek(offset + skip)
                    got = 0
                    while got < take:
                        n = f.readinto(out[filled + got : filled + take])
                        if not n:
                            raise OSError(f"{path.name}: ends inside the bytes of a tensor")
                        got += n
            else:
                take = min(len(source) - skip, len(out) - filled)
                out[filled : filled + take] = source[skip : skip + take]
            filled += take
            index += 1

    def read(self, start: int, stop: int) -> bytes:
        buf = bytearray(min(stop, self.total) - start)
        self.read_into(start, memoryview(buf))
        return bytes(buf)

    def chunks(self, part_bytes: int = PART_BYTES) -> int:
        """How many parts of ``part_bytes`` the stream takes (at least one)."""
        return max(1, -(-self.total // part_bytes))

    def packed(self) -> bytearray:
        """The whole stream in one buffer, each tensor's bytes copied once, straight from where it
        lives: a CUDA tensor goes device -> buffer on the caller's stream, no host copy between (how a
        failover snapshot is packed: safetensors' ``save`` copied each tensor two or three times)."""
        if self._on_disk:
            raise ValueError("packed() is for tensors in memory")
        buf = bytearray(self.total)
        buf[: len(self._head)] = self._head
        for index, key in enumerate(self.keys, start=1):
            t = self._tensors[key].detach()
            n = t.numel() * t.element_size()
            if n:
                into = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=self._starts[index])
                into.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return buf

    def parts(self, part_bytes: int = PART_BYTES) -> Iterator[bytes]:
        """The stream in consecutive parts of ``part_bytes`` (the last one shorter)."""
        if part_bytes < 1:
            raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
        for start in range(0, self.total, part_bytes):
            yield self.read(start, start + part_bytes)
