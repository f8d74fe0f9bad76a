"""The messages between a compnode daemon and a job's sandbox worker, over one Unix socket pair.

A message is ``u32 header length | u64 total blob length | msgpack header | blobs``; the header is a
map with ``op`` (and ``id`` for calls and replies) and ``blobs``, the length of each blob. Blobs are
received straight into torch byte tensors (one copy, no zero-fill), so a tensor frame's payload is a
view of its blob. Nothing is unpickled either way: the worker runs untrusted graphs, and a worker an
attacker took over must not be able to reach the daemon through this socket. The daemon therefore
bounds what it reads (header size, blob count, blob and message size) and checks every field; what
does not fit ends the worker (``IPCError``), never the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from fusionnet.dag.ir import dtype_from_name, dtype_name
from fusionnet.errors import ExecutionError, FusionNetError
from fusionnet.rpc.protocol import REMOTE_ERROR_CLASSES
from fusionnet.wire.frames import TensorFrame, payload_view
from fusionnet.wire.header import MAX_RANK, is_shape

_PREFIX = struct.Struct("<IQ")
MAX_HEADER_BYTES = 1 << 20
MAX_BLOBS = 4096
MAX_MESSAGE_BYTES = 8 << 30  # a snapshot of a large sub-DAG comes back as one message of chunks


class IPCError(FusionNetError):
    """The other end of a sandbox socket sent something that is not a message, or went away."""


Blob = bytes | bytearray | memoryview


class IPCChannel:
    """One end of the socket pair. ``send`` may be called from many tasks (one message at a time);
    ``recv`` from one reader task only."""

    def __init__(self, sock: socket.socket, *, max_message: int = MAX_MESSAGE_BYTES) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.max_message = max_message
        self._lock = asyncio.Lock()

    async def send(self, header: dict[str, Any], blobs: Sequence[Blob] = ()) -> None:
        views = [memoryview(b).cast("B") for b in blobs]
        head = msgpack.packb({**header, "blobs": [v.nbytes for v in views]}, use_bin_type=True)
        prefix = _PREFIX.pack(len(head), sum(v.nbytes for v in views))
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.sock_sendall(self.sock, prefix + head)
            for v in views:
                if v.nbytes:
                    await loop.sock_sendall(self.sock, v)

    async def _read_into(self, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        done = 0
        while done < view.nbytes:
            n = await loop.sock_recv_into(self.sock, view[done:])
            if n == 0:
                raise EOFError("the other end closed the socket")
            done += n

    async def recv(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The next message: its header and its blobs as uint8 tensors. ``EOFError`` at a clean end
        (between messages or within one), ``IPCError`` for anything malformed."""
        prefix = bytearray(_PREFIX.size)
        await self._read_into(memoryview(prefix))
        head_len, total = _PREFIX.unpack(prefix)
        if head_len > MAX_HEADER_BYTES or total > self.max_message:
            raise IPCError(f"message of {head_len} + {total} bytes exceeds the limits")
        head = bytearray(head_len)
        await self._read_into(memoryview(head))
        try:
            header = msgpack.unpackb(bytes(head), raw=False, strict_map_key=True, use_list=True)
        except Exception as e:
            raise IPCError(f"message header is not msgpack ({type(e).__name__})") from None
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            raise IPCError("message header is not a map with an 'op'")
        sizes = header.get("blobs")
        if (
            not isinstance(sizes, list)
            or len(sizes) > MAX_BLOBS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
            or sum(sizes) != total
        ):
            raise IPCError("message blob lengths do not add up")
        blobs = []
        for n in sizes:
            t = torch.empty(n, dtype=torch.uint8)
            if n:
                await self._read_into(memoryview(t.numpy()).cast("B"))
            blobs.append(t)
        return header, blobs

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def blob_view(t: torch.Tensor) -> memoryview:
    """A received blob as bytes-like (no copy)."""
    return memoryview(t.numpy()).cast("B")


def int_field(header: dict[str, Any], name: str, low: int = 0, high: int = 1 << 62) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise IPCError(f"message field {name!r} is not an integer in {low}..{high}")
    return value


def str_field(header: dict[str, Any], name: str, limit: int = 10_000) -> str:
    value = header.get(name)
    if not isinstance(value, str) or len(value) > limit:
        raise IPCError(f"message field {name!r} is not a string of at most {limit} characters")
    return value


def error_of(e: BaseException) -> list[str]:
    """An exception as ``[class name, message]``; ``error_from`` maps known FusionNet classes back."""
    if isinstance(e, FusionNetError):
        return [type(e).__name__, str(e)[:4000]]
    return [ExecutionError.__name__, f"{type(e).__name__}: {e}"[:4000]]


def error_from(doc: Any) -> FusionNetError:
    """The other end's ``error_of``, as the same FusionNet class when it is one of the RPC layer's
    known ones (looked up by name in that table: nothing is evaluated), else an ``ExecutionError``."""
    if not isinstance(doc, list) or len(doc) != 2 or not all(isinstance(x, str) for x in doc):
        return IPCError("malformed error from the other end")
    cls = REMOTE_ERROR_CLASSES.get(doc[0], ExecutionError)
    return cls(doc[1][:4000])


# ---- tensor frames --------------------------------------------------------------------------------
def frame_message(frame: TensorFrame) -> tuple[dict[str, Any], list[Blob]]:
    keep, view = payload_view(frame.tensor)
    header = {
        "job": frame.job_id,
        "sender": frame.sender,
        "kind": frame.kind,
        "step": frame.step,
        "mb": frame.microbatch,
        "name": frame.name,
        "dtype": dtype_name(keep.dtype),
        "shape": list(keep.shape),
    }
    return header, [view]


def frame_of(header: dict[str, Any], blobs: list[torch.Tensor]) -> TensorFrame:
    """A ``TensorFrame`` back from ``frame_message``'s parts; ``TensorFrame`` checks its fields."""
    if len(blobs) != 1:
        raise IPCError("a frame message carries one blob")
    try:
        dtype = dtype_from_name(str_field(header, "dtype", 32))
    except Exception:
        raise IPCError(f"frame dtype {header.get('dtype')!r} is unknown") from None
    shape = header.get("shape")
    if not isinstance(shape, list) or not is_shape(shape):  # the limits a frame passed on the wire
        raise IPCError(f"frame shape is not a list of at most {MAX_RANK} sizes: {str(shape)[:80]}")
    numel = 1
    for d in shape:
        numel *= d
    blob = blobs[0]
    if numel * torch.empty((), dtype=dtype).element_size() != blob.numel():
        raise IPCError(f"frame of shape {shape} and dtype {dtype} does not fill {blob.numel()} bytes")
    tensor = blob.view(dtype).reshape(shape) if blob.numel() else torch.empty(shape, dtype=dtype)
    if dtype == torch.bool and tensor.numel() and bool((blob > 1).any()):
        raise IPCError("bool frame holds bytes other than 0/1")
    try:
        return TensorFrame(
            job_id=str_field(header, "job", 256),
            sender=str_field(header, "sender", 256),
            kind=str_field(header, "kind", 16),
            step=int_field(header, "step"),
            microbatch=int_field(header, "mb"),
            name=str_field(header, "name", 4096),
            tensor=tensor,
        )
    except FusionNetError as e:
        raise IPCError(f"frame fields: {e}") from None
