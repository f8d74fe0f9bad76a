"""Tensor frames: what compnodes send each other, and how one is written to / read from a byte stream.

A frame is one tensor plus who sent it for which job, step, micro-batch and value. On the wire it
is ``prefix | msgpack header | head tag | raw bytes | tag`` (layout in ``header.py``, tags in
``mac.py``). Nothing a peer sends is unpickled or evaluated: the header is msgpack of plain fields,
checked field by field; the payload is the raw bytes of an allowlisted dtype, received straight
into the memory of the tensor that is handed out (no extra copy). Sending takes a zero-copy view
of a contiguous CPU tensor. An encrypted frame (``crypt.py``) carries the payload's ciphertext,
which the receiver decrypts in place once the frame is authentic.

``read_frame`` checks, in this order, so that nothing large is allocated for a frame that will be
refused: prefix magic and header length, header structure and types, dtype allowlist, shape
bounds, ``nbytes == prod(shape) * itemsize``, ``payload <= max_payload``, sender (if bound to an
authenticated stream), job known, sender allowed, the head tag (so only a key holder can make a
receiver allocate a payload buffer), the receiver named in the header is us, the sequence number is
fresh (``replay.py``), that the frame is encrypted if its job requires it, that a ``bare`` frame (payload
without MAC) comes from a loopback peer of a job that allows it (``crypt.bare_ok``), then the
whole-frame tag once the bytes are in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from fusionnet.errors import WireError
from fusionnet.wire.crypt import PayloadCipher, write_sealed
from fusionnet.wire.gather import write_buffers
from fusionnet.wire.header import (
    ALLOWED_DTYPES,
    MAX_ID_LEN,
    MAX_NAME_LEN,
    FrameHeader,
    check_count,
    check_kind,
    check_text,
    dtype_name,
    pack_head,
)
from fusionnet.wire.mac import (
    NONCE_SIZE,
    SMALL_FRAME,
    THREAD_MIN,
    THREAD_WINDOW,
    WRITE_CHUNK,
    FrameMac,
    check_key,
)
from fusionnet.wire.replay import next_nonce, next_seq

__all__ = [
    "ALLOWED_DTYPES",
    "SMALL_FRAME",
    "THREAD_MIN",
    "THREAD_WINDOW",
    "WRITE_CHUNK",
    "TensorFrame",
    "encode_frame",
    "write_frame",
]


@dataclass(frozen=True)
class TensorFrame:
    """One tensor travelling between compnodes. Fields are checked on construction."""

    job_id: str
    sender: str
    kind: str  # "act" | "grad" | "param" | "ctrl"
    step: int
    microbatch: int
    name: str
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        check_text(self.job_id, "job_id", MAX_ID_LEN)
        check_text(self.sender, "sender", MAX_ID_LEN)
        check_kind(self.kind)
        check_count(self.step, "step")
        check_count(self.microbatch, "microbatch")
        check_text(self.name, "name", MAX_NAME_LEN, allow_empty=True)
        if not isinstance(self.tensor, torch.Tensor):
            raise WireError(
                f"frame {self.name!r}: tensor must be a torch.Tensor, got {type(self.tensor).__name__}"
            )
        dtype_name(self.tensor.dtype)
        if self.tensor.layout != torch.strided:
            raise WireError(
                f"frame {self.name!r}: only dense tensors travel, got layout {self.tensor.layout}"
            )


def payload_view(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A flat byte view of a tensor's data, copying only if it is not a contiguous CPU tensor.

    Returns the tensor actually viewed too: the caller keeps it alive while the view is in use.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.reshape(-1).view(torch.uint8)
    return t, memoryview(flat.numpy()).cast("B")


def _head_of(
    frame: TensorFrame,
    nonce: bytes | None,
    receiver: str,
    seq: int | None,
    encrypted: bool = False,
    bare: bool = False,
) -> tuple[bytes, memoryview, torch.Tensor, bytes]:
    if not isinstance(frame, TensorFrame):
        raise WireError(f"expected a TensorFrame, got {type(frame).__name__}")
    if bare and encrypted:
        raise WireError("an encrypted frame always carries its payload's MAC (bare and encrypt)")
    check_text(receiver, "receiver", MAX_ID_LEN)
    seq = next_seq() if seq is None else check_count(seq, "seq")
    t, payload = payload_view(frame.tensor)
    nonce = next_nonce() if nonce is None else nonce
    if len(nonce) != NONCE_SIZE:
        raise WireError(f"nonce must be {NONCE_SIZE} bytes")
    header = FrameHeader(
        job_id=frame.job_id,
        sender=frame.sender,
        kind=frame.kind,
        step=frame.step,
        microbatch=frame.microbatch,
        name=frame.name,
        dtype=t.dtype,
        shape=tuple(t.shape),
        nonce=nonce,
        payload_len=len(payload),
        receiver=receiver,
        seq=seq,
        encrypted=encrypted,
        bare=bare,
    )
    return pack_head(header), payload, t, nonce


def encode_frame(
    frame: TensorFrame,
    key: bytes,
    *,
    receiver: str,
    seq: int | None = None,
    nonce: bytes | None = None,
    encrypt: bool = False,
    bare: bool = False,
) -> list[bytes | memoryview]:
    """``[head + head tag, payload, tag]`` for ``writelines``; the payload is a view of the tensor's memory.

    ``receiver`` is the peer id the frame is for; ``seq`` defaults to this process's next sequence
    number; ``encrypt`` sends the payload's ciphertext (a new buffer) instead. The tensor must not be
    modified while the returned buffers are in use. ``bare``: the payload goes without a MAC
    (loopback only, ``crypt.bare_ok``).
    """
    key = check_key(key)
    head, payload, _, nonce = _head_of(frame, nonce, receiver, seq, encrypt, bare)
    mac = FrameMac(key, nonce)
    if encrypt:
        payload = memoryview(PayloadCipher(key, nonce).seal(payload))
    tags = [] if bare else mac.chunk_tags(payload)
    return [head + mac.head_tag(head), payload, mac.finish(head, tags)]


@dataclass(frozen=True)
class PreparedFrame:
    """A checked frame ready to write: head bytes, payload view, and the tensor that view keeps alive."""

    head: bytes
    payload: memoryview
    mac: FrameMac
    tensor: torch.Tensor
    cipher: PayloadCipher | None = None  # set: the payload leaves encrypted
    bare: bool = False  # the payload leaves without a MAC (loopback, ``crypt.bare_ok``)

    def payload_tags(self) -> list[bytes]:
        """The payload's chunk tags, computed here (none for a bare frame)."""
        return [] if self.bare else self.mac.chunk_tags(self.payload)


def check_frame(frame: TensorFrame, key: bytes) -> None:
    """The checks of an outgoing frame that do not depend on its receiver (``WireError``)."""
    check_key(key)
    if not isinstance(frame, TensorFrame):
        raise WireError(f"expected a TensorFrame, got {type(frame).__name__}")


def prepare_frame(
    frame: TensorFrame, key: bytes, receiver: str, *, encrypt: bool = False, bare: bool = False
) -> PreparedFrame:
    """All checks of an outgoing frame for ``receiver``, done before a connection is touched."""
    key = check_key(key)
    head, payload, t, nonce = _head_of(frame, None, receiver, None, encrypt, bare)
    cipher = PayloadCipher(key, nonce) if encrypt else None
    return PreparedFrame(head, payload, FrameMac(key, nonce), t, cipher, bare)


async def write_prepared(
    writer: asyncio.StreamWriter, p: PreparedFrame, *, threaded_mac: bool = True
) -> None:
    """Writes one frame, computing the MAC of a large payload in a worker thread while it is sent.

    On any exception the stream holds a partial frame and must be closed by the caller.
    """
    head = p.head + p.mac.head_tag(p.head)
    if p.cipher is not None:
        await write_sealed(writer, head, p.head, p.payload, p.mac, p.cipher, threaded_mac)
        return
    if len(p.payload) <= SMALL_FRAME:
        # Small: the whole frame in one write (one syscall), tags first; GMAC of a small payload
        # costs less than the syscall and wake-up a separate tag write would.
        writer.writelines((head, p.payload, p.mac.finish(p.head, p.payload_tags())))
        await writer.drain()
        return
    tags_future: asyncio.Future[list[bytes]] | None = None
    if threaded_mac and not p.bare and len(p.payload) >= THREAD_MIN:
        tags_future = asyncio.get_running_loop().run_in_executor(None, p.mac.chunk_tags, p.payload)
    try:
        for start in range(0, len(p.payload), WRITE_CHUNK):
            chunk = p.payload[start : start + WRITE_CHUNK]
            write_buffers(writer, (head, chunk) if start == 0 else (chunk,))  # head rides with chunk 0
            await writer.drain()
        # Inline, the tags are computed only now: the receiver is still reading the payload's tail
        # (bare: none, the final tag binds the head alone).
        tags = await tags_future if tags_future is not None else p.payload_tags()
        writer.write(p.mac.finish(p.head, tags))
        await writer.drain()
    finally:
        if tags_future is not None and not tags_future.done():
            tags_future.cancel()


async def write_frame(
    writer: asyncio.StreamWriter,
    frame: TensorFrame,
    key: bytes,
    *,
    receiver: str,
    threaded_mac: bool = True,
    encrypt: bool = False,
    bare: bool = False,
) -> None:
    """Checks then writes one frame for ``receiver`` (nothing is written if a check fails)."""
    prepared = prepare_frame(frame, key, receiver, encrypt=encrypt, bare=bare)
    await write_prepared(writer, prepared, threaded_mac=threaded_mac)
