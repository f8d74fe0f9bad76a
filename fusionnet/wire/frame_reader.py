"""Reading one tensor frame from a byte stream (``read_frame``), with every check of ``frames.py``'s
list, in that order, so that nothing large is allocated for a frame that will be refused; the payload
is received straight into the tensor handed out, its MAC checked chunk by chunk as it arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import torch

from fusionnet.wire import refusal as R
from fusionnet.wire.crypt import PayloadCipher, decrypt
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import PREFIX_SIZE, FrameHeader, parse_header, parse_prefix
from fusionnet.wire.mac import TAG_SIZE, THREAD_MIN, THREAD_WINDOW, FrameMac, chunk_spans
from fusionnet.wire.refusal import FrameRefused, StreamEnded
from fusionnet.wire.sources import ByteSource, as_source

__all__ = ["ReplayGuard", "allocate_tensor", "check_values", "read_frame"]

_SKIP_CHUNK = 1 << 20

Keyring = Callable[[str, str], bytes | None]  # (job, sender) -> key; None: unknown job


async def _read(source: ByteSource, n: int, what: str, job: str | None = None) -> bytes:
    try:
        return await source.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FrameRefused(
            f"stream ended inside a frame's {what} ({len(e.partial)} of {n} bytes)",
            reason=R.TRUNCATED,
            job_id=job,
        ) from None


async def _skip(source: ByteSource, n: int, refusal: FrameRefused) -> FrameRefused:
    """Reads and drops the rest of a refused frame so the stream stays at a frame boundary."""
    scratch = memoryview(bytearray(min(n, _SKIP_CHUNK)))
    while n:
        take = min(n, len(scratch))
        try:
            await source.readinto(scratch[:take])
        except asyncio.IncompleteReadError:
            refusal.in_sync = False
            return refusal
        n -= take
    refusal.in_sync = True
    return refusal


async def _receive_payload(
    source: ByteSource, view: memoryview, mac: FrameMac, threaded: bool, bare: bool = False
) -> list[bytes]:
    """Fills ``view`` chunk by chunk, authenticating each chunk while later ones arrive (a bare
    payload in one piece, unauthenticated: no chunk tags)."""
    if bare:
        await source.readinto(view)
        return []
    spans = chunk_spans(len(view))
    if not threaded or len(view) < THREAD_MIN:
        tags = []
        for i, (a, b) in enumerate(spans):
            await source.readinto(view[a:b])
            tags.append(mac.chunk_tag(i, view[a:b]))
        return tags
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[list[bytes]]] = []
    try:
        for first in range(0, len(spans), THREAD_WINDOW):
            a, b = spans[first][0], spans[min(first + THREAD_WINDOW, len(spans)) - 1][1]
            await source.readinto(view[a:b])
            futures.append(loop.run_in_executor(None, mac.chunk_tags, view[a:b], first))
        return [tag for window in await asyncio.gather(*futures) for tag in window]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def allocate_tensor(h: FrameHeader) -> tuple[torch.Tensor, memoryview]:
    """The tensor a payload will be received into, and a byte view of its memory to fill.

    ``torch.empty`` rather than a zeroed ``bytearray``: zeroing is a full pass over the memory (1.9
    ms per 16 MiB measured here) that the payload overwrites anyway. Every byte is written before
    the tensor is used: ``read_frame`` returns it only after the payload and its MAC are complete.
    """
    t = torch.empty(h.shape, dtype=h.dtype)
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def check_values(h: FrameHeader, t: torch.Tensor) -> None:
    """Refuses values torch cannot represent safely: a bool stored as a byte other than 0 or 1."""
    if h.dtype == torch.bool and t.numel() and bool((t.view(torch.uint8) > 1).any()):
        raise FrameRefused(
            f"bool tensor {h.name!r} holds bytes other than 0/1 (job {h.job_id!r}, sender {h.sender!r})",
            reason=R.BAD_VALUE,
            job_id=h.job_id,
            sender=h.sender,
            in_sync=True,
            nbytes=h.payload_len,
        )


class ReplayGuard(Protocol):
    """What ``read_frame`` asks about sequence numbers (``receiver.FrameReceiver`` implements it)."""

    def fresh(self, job_id: str, sender: str, seq: int) -> bool: ...

    def accept(self, job_id: str, sender: str, seq: int) -> bool: ...


# Over 80 lines on purpose: one straight sequence of checks in the order the module docstring gives
# (each before anything it protects is read or allocated); split up, that order would be hard to see.
async def read_frame(
    reader: asyncio.StreamReader | ByteSource,
    keyring: Keyring,
    *,
    max_payload: int,
    receiver: str,
    replay: ReplayGuard | None = None,
    job_ended: Callable[[str], bool] | None = None,
    accept_sender: Callable[[str, str], bool] | None = None,
    bound_sender: str | None = None,
    threaded_mac: bool = True,
    plaintext_ok: Callable[[str], bool] | None = None,
    bare_ok: Callable[[str], bool] | None = None,
) -> TensorFrame:
    """Reads and authenticates one frame. Every problem is a ``WireError``.

    ``keyring(job_id, sender)`` gives the key of that sender's frames (``b""``: the job has no link from
    it, refused like a sender that is not a member), or ``None`` (unknown job: refused, out of sync, so
    the connection closes instead of reading a payload nobody wants, unless ``job_ended(job_id)`` says
    it is a job that ran here and just ended: then its late frame is skipped); ``receiver`` is our own
    peer id, which the frame must name; ``replay`` refuses a sequence number already accepted from that
    sender (checked before the payload is allocated, recorded once the whole frame is authentic);
    ``accept_sender(job, sender)`` may refuse a sender before its payload is read; ``bound_sender`` is
    the peer id the transport already authenticated (P2P streams), which the frame's sender must equal;
    ``plaintext_ok(job)`` (if given) refuses an unencrypted frame of a job whose frames must be
    encrypted (checked before the payload is allocated); ``bare_ok(job)`` allows a frame whose
    payload carries no MAC (``crypt.bare_ok``: a loopback peer; None: refused). A clean EOF between
    frames raises ``StreamEnded``; a refusal raises ``FrameRefused`` whose ``in_sync`` says whether
    the stream is still at a frame boundary.
    """
    source = as_source(reader)
    try:
        prefix = await source.readexactly(PREFIX_SIZE)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise StreamEnded("peer closed the stream") from None
        raise FrameRefused(
            f"stream ended inside a frame's prefix ({len(e.partial)} of {PREFIX_SIZE} bytes)",
            reason=R.TRUNCATED,
        ) from None
    header_len, payload_len = parse_prefix(prefix)
    raw = await _read(source, header_len, "header")
    h = parse_header(raw, payload_len)
    who = f"job {h.job_id!r}, sender {h.sender!r}, frame {h.kind}/{h.name!r}"

    def refusal(message: str, reason: str) -> FrameRefused:
        return FrameRefused(
            f"{message} ({who})", reason=reason, job_id=h.job_id, sender=h.sender, nbytes=payload_len
        )

    if payload_len > max_payload:
        raise refusal(f"payload of {payload_len} bytes exceeds the {max_payload} byte limit", R.OVERSIZED)
    rest = TAG_SIZE + payload_len + TAG_SIZE
    if bound_sender is not None and h.sender != bound_sender:
        raise await _skip(source, rest, refusal(f"stream authenticated as {bound_sender}", R.SENDER_MISMATCH))
    key = keyring(h.job_id, h.sender)
    if key is None:
        if job_ended is not None and job_ended(h.job_id):  # a late frame of a job we ran: harmless
            raise await _skip(source, rest, refusal("job ended here", R.UNKNOWN_JOB))
        raise refusal("no such job here", R.UNKNOWN_JOB)  # not in sync: we close, nothing is read
    if not key or (accept_sender is not None and not accept_sender(h.job_id, h.sender)):
        raise await _skip(source, rest, refusal("sender is not a member of this job", R.SENDER_NOT_ALLOWED))

    mac = FrameMac(key, h.nonce)
    if not mac.verify_head(prefix + raw, await _read(source, TAG_SIZE, "head tag", h.job_id)):
        raise refusal("header MAC check failed: wrong key or altered header", R.BAD_MAC)
    rest -= TAG_SIZE
    # Authentic header from here on: its receiver and sequence number are the sender's own.
    if h.receiver != receiver:
        raise await _skip(source, rest, refusal(f"frame is for {h.receiver!r}, not for us", R.WRONG_RECEIVER))
    if replay is not None and not replay.fresh(h.job_id, h.sender, h.seq):
        raise await _skip(
            source,
            rest,
            refusal(f"sequence number {h.seq} already seen, too old, or not ours to read", R.REPLAY),
        )
    if not h.encrypted and plaintext_ok is not None and not plaintext_ok(h.job_id):
        raise await _skip(
            source, rest, refusal("unencrypted frame of a job whose frames must be encrypted", R.PLAINTEXT)
        )
    if h.bare and (bare_ok is None or not bare_ok(h.job_id)):
        raise await _skip(
            source, rest, refusal("payload without MAC from a peer that is not on loopback", R.BARE)
        )
    tensor, view = allocate_tensor(h)  # only now: the sizes it is made from are authenticated
    try:
        tags = await _receive_payload(source, view, mac, threaded_mac, h.bare)
    except asyncio.IncompleteReadError:
        raise refusal(f"stream ended inside a {payload_len} byte payload", R.TRUNCATED) from None
    tag = await _read(source, TAG_SIZE, "tag", h.job_id)
    if not mac.verify(prefix + raw, tags, tag):
        raise refusal("MAC check failed: wrong key or altered bytes", R.BAD_MAC)
    if h.encrypted:  # only now: nothing of a tampered frame is ever decrypted
        await decrypt(view, PayloadCipher(key, h.nonce), threaded_mac)
    if replay is not None and not replay.accept(h.job_id, h.sender, h.seq):  # a twin won the race
        twin = refusal(f"sequence number {h.seq} already seen", R.REPLAY)
        twin.in_sync = True  # the whole frame was read
        raise twin
    check_values(h, tensor)
    return _checked_frame(h, tensor)


def _checked_frame(h: FrameHeader, tensor: torch.Tensor) -> TensorFrame:
    """A ``TensorFrame`` from fields ``parse_header`` already checked, without checking them again."""
    frame = object.__new__(TensorFrame)
    for name, value in (
        ("job_id", h.job_id),
        ("sender", h.sender),
        ("kind", h.kind),
        ("step", h.step),
        ("microbatch", h.microbatch),
        ("name", h.name),
        ("tensor", tensor),
    ):
        object.__setattr__(frame, name, value)
    return frame
