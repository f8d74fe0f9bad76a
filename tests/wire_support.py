"""Helpers shared by the wire tests (no tests here): frames as bytes, hostile frames, a condition wait."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Callable

import msgpack
import torch

from fusionnet.wire.frame_reader import read_frame
from fusionnet.wire.frames import TensorFrame, encode_frame
from fusionnet.wire.header import MAGIC, VERSION
from fusionnet.wire.mac import FrameMac

KEY = b"k" * 32
RECEIVER = "S"  # the receiving peer's id in every test
OTHER_KEY = b"o" * 32


def frame(
    t: torch.Tensor, *, job: str = "job1", sender: str = "A", name: str = "x", step: int = 0
) -> TensorFrame:
    return TensorFrame(job_id=job, sender=sender, kind="act", step=step, microbatch=1, name=name, tensor=t)


def frame_bytes(
    f: TensorFrame, key: bytes = KEY, *, receiver: str = RECEIVER, seq: int | None = None
) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(f, key, receiver=receiver, seq=seq))


def craft(
    payload: bytes,
    *,
    key: bytes | None = KEY,
    payload_len: int | None = None,
    **fields: object,
) -> bytes:
    """A frame built by hand, so tests can send what ``encode_frame`` would never produce."""
    doc: dict[str, object] = {
        "v": VERSION,
        "job": "job1",
        "from": "A",
        "kind": "act",
        "step": 0,
        "mb": 0,
        "name": "x",
        "dtype": "uint8",
        "shape": [len(payload)],
        "nonce": os.urandom(16),
        "to": RECEIVER,
        "seq": 1,
    }
    doc.update(fields)
    doc = {k: v for k, v in doc.items() if v is not None}
    header = msgpack.packb(doc, use_bin_type=True)
    n = len(payload) if payload_len is None else payload_len
    head = struct.pack(">4sIQ", MAGIC, len(header), n) + header
    head_tag = tag = b"\0" * 32
    if key is not None and isinstance(doc.get("nonce"), bytes) and len(doc["nonce"]) == 16:
        mac = FrameMac(key, doc["nonce"])
        head_tag, tag = mac.head_tag(head), mac.finish(head, mac.chunk_tags(memoryview(payload)))
    return head + head_tag + payload + tag


async def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def read_bytes(
    data: bytes, keyring: Callable[[str, str], bytes | None] = lambda job, sender: KEY, **kw
) -> TensorFrame:
    kw.setdefault("max_payload", 1 << 30)
    kw.setdefault("receiver", RECEIVER)
    return await read_frame(await reader_of(data), keyring, **kw)


async def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Waits for ``cond()`` with a deadline (polling the event loop, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.002)
