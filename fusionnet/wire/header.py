"""The frame head: a fixed prefix and a msgpack header, packed and parsed without trusting the peer.

Layout of one frame on the stream::

    prefix    16 bytes   MAGIC (4) | header length (u32, big-endian) | payload length (u64, big-endian)
    header    msgpack map, at most MAX_HEADER bytes
    head tag  TAG_SIZE bytes: authenticates prefix + header before the payload is allocated
    payload   the tensor's raw bytes, C order, native little-endian (AES-CTR ciphertext if ``enc``)
    tag       TAG_SIZE bytes: authenticates the whole frame (``mac.py``); of a ``bare`` frame, the
              prefix and header only: its payload is left to the kernel (loopback, ``crypt.py``)

The header names the receiver (``to``) and carries the sender's sequence number (``seq``): both are
under the head tag, which is what makes replay protection possible (``replay.py``).

``parse_prefix`` and ``parse_header`` are pure functions of bytes; every failure is a
``FrameRefused`` with a reason code. The same field checks guard frames built locally, so a bad
frame is refused before anything is written.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from fusionnet.errors import WireError
from fusionnet.wire import refusal as R
from fusionnet.wire.mac import NONCE_SIZE
from fusionnet.wire.refusal import FrameRefused

MAGIC = b"FNW1"
# 2: the receiver's id and a sequence number under the MAC (replay protection); 3: ``enc``; 4: ``bare``
VERSION = 4
_PREFIX = struct.Struct(">4sIQ")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER = 16 * 1024
MAX_ID_LEN = 256
MAX_NAME_LEN = 1024
MAX_RANK = 32
MAX_DIM = 1 << 48
MAX_COUNT = (1 << 63) - 1
KINDS = ("act", "grad", "param", "ctrl")

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}


@dataclass(frozen=True)
class FrameHeader:
    """Everything a frame says about itself except its bytes."""

    job_id: str
    sender: str
    kind: str
    step: int
    microbatch: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nonce: bytes
    payload_len: int
    receiver: str = ""  # the peer id the frame is for (``to``): no other receiver accepts it
    seq: int = 0  # the sender's sequence number (``replay.py``)
    encrypted: bool = False  # the payload is AES-CTR ciphertext (``crypt.py``)
    bare: bool = False  # the payload has no MAC: sent over loopback, where the kernel keeps it intact


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an allowed dtype; ``WireError`` for any other."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(
            f"dtype {dtype} cannot travel in a frame (allowed: {', '.join(ALLOWED_DTYPES)})"
        ) from None


def check_text(value: Any, field: str, max_len: int, *, allow_empty: bool = False) -> str:
    """A printable string of bounded length (no control characters reach a log line)."""
    if not isinstance(value, str):
        raise WireError(f"frame field {field!r} must be a string, got {type(value).__name__}")
    if not (allow_empty or value) or len(value) > max_len or not value.isprintable():
        raise WireError(
            f"frame field {field!r} must be 1..{max_len} printable characters, got {value[:64]!r}"
        )
    return value


def check_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise WireError(f"frame field {field!r} must be an integer in [0, 2**63), got {value!r}")
    return value


def check_kind(value: Any) -> str:
    if value not in KINDS:
        raise WireError(f"frame kind must be one of {', '.join(KINDS)}, got {value!r}")
    return value


def is_shape(shape: Any, limit: int = MAX_DIM) -> bool:
    """Whether a peer's ``shape`` is at most ``MAX_RANK`` sizes in [0, ``limit``) whose nonzero ones also
    multiply to under ``limit``: a tensor with a 0 among sizes like 2**47 holds no bytes, so its payload
    length passes, yet torch cannot lay it out (its strides overflow int64) and raises."""
    if not isinstance(shape, list | tuple) or len(shape) > MAX_RANK:
        return False
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < limit for d in shape):
        return False
    return math.prod(d for d in shape if d) < limit


def expected_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def pack_head(h: FrameHeader) -> bytes:
    """Prefix + msgpack header of a frame whose fields were already checked."""
    doc = {
        "v": VERSION,
        "job": h.job_id,
        "from": h.sender,
        "kind": h.kind,
        "step": h.step,
        "mb": h.microbatch,
        "name": h.name,
        "dtype": _DTYPE_NAMES[h.dtype],
        "shape": list(h.shape),
        "nonce": h.nonce,
        "to": h.receiver,
        "seq": h.seq,
        "enc": h.encrypted,
        "bare": h.bare,
    }
    header = msgpack.packb(doc, use_bin_type=True)
    assert len(header) <= MAX_HEADER, "field checks bound the header size"
    return _PREFIX.pack(MAGIC, len(header), h.payload_len) + header


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """``(header_len, payload_len)``; refuses a wrong magic or an out-of-bounds header length."""
    magic, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameRefused(f"stream does not start a frame (magic {magic!r})", reason=R.BAD_MAGIC)
    if not 0 < header_len <= MAX_HEADER:
        raise FrameRefused(f"header length {header_len} outside 1..{MAX_HEADER}", reason=R.HEADER_SIZE)
    return header_len, payload_len


def _unpack(raw: bytes) -> dict[str, Any]:
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_NAME_LEN * 4,
            max_bin_len=64,
            max_array_len=MAX_RANK,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types for hostile input; all mean the same here
        raise FrameRefused(f"header is not valid msgpack ({type(e).__name__})", reason=R.MALFORMED) from None
    if not isinstance(doc, dict):
        raise FrameRefused(f"header must be a map, got {type(doc).__name__}", reason=R.MALFORMED)
    return doc


def parse_header(raw: bytes, payload_len: int) -> FrameHeader:
    """Validates a received header. Unknown keys are ignored (a newer peer may add some)."""
    doc = _unpack(raw)
    job = doc.get("job") if isinstance(doc.get("job"), str) else None
    sender = doc.get("from") if isinstance(doc.get("from"), str) else None

    def refuse(message: str, reason: str = R.MALFORMED) -> FrameRefused:
        who = f"job {job[:64]!r}, sender {str(sender)[:64]!r}" if job is not None else "no readable job"
        return FrameRefused(f"{message} ({who})", reason=reason, job_id=job, sender=sender)

    if doc.get("v") != VERSION:
        raise refuse(f"unsupported frame version {doc.get('v')!r}")
    try:
        job_id = check_text(doc.get("job"), "job", MAX_ID_LEN)
        sender = check_text(doc.get("from"), "from", MAX_ID_LEN)
        kind = check_kind(doc.get("kind"))
        step = check_count(doc.get("step"), "step")
        microbatch = check_count(doc.get("mb"), "mb")
        name = check_text(doc.get("name"), "name", MAX_NAME_LEN, allow_empty=True)
        receiver = check_text(doc.get("to"), "to", MAX_ID_LEN)
        seq = check_count(doc.get("seq"), "seq")
    except WireError as e:
        raise refuse(str(e)) from None
    encrypted = doc.get("enc", False)
    if not isinstance(encrypted, bool):
        raise refuse(f"enc must be true or false, got {str(encrypted)[:32]!r}")
    bare = doc.get("bare", False)
    if not isinstance(bare, bool) or (bare and encrypted):
        raise refuse(f"bare must be true or false, and false for an encrypted frame, got {str(bare)[:32]!r}")
    nonce = doc.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
        raise refuse(f"nonce must be {NONCE_SIZE} bytes")
    dtype = ALLOWED_DTYPES.get(doc.get("dtype")) if isinstance(doc.get("dtype"), str) else None
    if dtype is None:
        raise refuse(f"dtype {str(doc.get('dtype'))[:32]!r} is not allowed", R.BAD_DTYPE)
    shape = doc.get("shape")
    if not isinstance(shape, list) or not is_shape(shape):
        raise refuse(
            f"shape must be at most {MAX_RANK} integers in [0, 2**48) of fewer than 2**48 elements, "
            f"got {str(shape)[:80]}",
            R.BAD_SHAPE,
        )
    nbytes = expected_nbytes(dtype, tuple(shape))
    if nbytes != payload_len:
        raise refuse(
            f"payload is {payload_len} bytes but {doc['dtype']}{shape} needs {nbytes}", R.SIZE_MISMATCH
        )
    return FrameHeader(
        job_id=job_id,
        sender=sender,
        kind=kind,
        step=step,
        microbatch=microbatch,
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        nonce=nonce,
        payload_len=payload_len,
        receiver=receiver,
        seq=seq,
        encrypted=encrypted,
        bare=bare,
    )
