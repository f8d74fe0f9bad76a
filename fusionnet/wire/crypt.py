"""Confidentiality on the direct path: payloads encrypted with AES-256-CTR under a per-frame key.

The frame MAC (``mac.py``) already authenticates every byte on the wire with GMAC chunk tags bound by
an HMAC; an encrypted frame (header field ``enc``, itself under the head tag) carries the payload's
ciphertext instead of its plaintext, and the same MAC covers the ciphertext. That is encrypt-then-MAC
with the two halves of AES-GCM (CTR encryption, GHASH authentication) under separate keys::

    enc_key = HMAC-SHA256(job_key, DOMAIN || nonce)      (the frame's 16-byte random nonce)
    c_i     = AES-256-CTR(enc_key, counter = i * 2**32, payload chunk i)    (1 MiB chunks)

A chunk of 1 MiB is 2**16 AES blocks, so the counter ranges of different chunks never overlap, and
a fresh key per frame means no (key, counter) pair is ever used twice. Per-chunk counters let the
sender encrypt and the receiver decrypt chunks in worker threads (OpenSSL releases the GIL), as the
MAC does. A receiver decrypts only after the whole frame's tag verified, in place, into the tensor
that is handed out: a tampered frame is refused before any of its plaintext is used.

Why not confidentiality everywhere: on loopback the bytes never leave the machine, and the P2P
fallback path is libp2p, which encrypts its connections itself. ``placement.wire_encryption``
(``auto`` by default) therefore encrypts exactly the frames that leave the machine over TCP;
``on`` encrypts loopback too, ``off`` nothing (and a receiver of an ``off`` job accepts plaintext
from any host). A receiver refuses a plaintext frame that its job's policy says must be encrypted
(reason ``plaintext``), so a misconfigured sender cannot leak silently for long.

Integrity on loopback follows the same line. Between two processes of one host, a TCP stream's bytes
pass only through the kernel: no other unprivileged process can read, alter or inject them (that takes
CAP_NET_RAW or ptrace, which also reach the processes' memory, keys included). So a frame whose
job allows plaintext there is sent ``bare`` over a loopback connection: its header still carries the
head tag and the final tag (the sender holds the link's key, the sizes, receiver and sequence number
are authentic), its payload bytes are left to the stream and not MACed, which was most of the data
path's cost per byte (``README``, Transport). A receiver takes a bare frame only from a loopback peer
of a job that is not ``on`` (``bare_ok``); anywhere else it is refused (reason ``bare``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
from collections import deque

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fusionnet.errors import WireError
from fusionnet.wire.gather import write_buffers
from fusionnet.wire.mac import (
    MAC_CHUNK,
    NONCE_SIZE,
    SMALL_FRAME,
    THREAD_MIN,
    THREAD_WINDOW,
    WRITE_CHUNK,
    FrameMac,
    chunk_spans,
)

DOMAIN = b"fusionnet/wire/v1 payload key"
POLICIES = ("auto", "on", "off")
# An encrypted frame's sender keeps this many windows being sealed in threads ahead of the socket.
SEAL_AHEAD = 2


@functools.lru_cache(maxsize=1024)
def is_loopback_host(host: str) -> bool:
    """True for loopback addresses (and the name ``localhost``); any other name counts as remote.

    Cached: every frame sent or received asks up to four times (the policies of both ends), and
    parsing the address (2.5 us) was about 6 % of a 16 KiB frame's CPU on loopback. A swarm has few
    addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_policy(policy: object) -> str:
    if policy not in POLICIES:
        raise WireError(f"wire encryption must be one of {', '.join(POLICIES)}, got {policy!r}")
    return str(policy)


def encrypt_to(policy: str, host: str) -> bool:
    """Whether a frame of a job with ``policy`` is encrypted when sent to ``host`` over TCP."""
    return policy == "on" or (policy == "auto" and not is_loopback_host(host))


def plaintext_ok(policy: str, host: str) -> bool:
    """Whether a receiver takes a plaintext frame of a job with ``policy`` from ``host``."""
    return policy == "off" or (policy == "auto" and is_loopback_host(host))


def bare_ok(policy: str, host: str) -> bool:
    """Whether a plaintext frame of a job with ``policy`` may go without a payload MAC to, or come
    from, ``host`` (the TCP peer's address): loopback only, and not for jobs that encrypt loopback."""
    return policy != "on" and is_loopback_host(host)


class PayloadCipher:
    """Encrypts/decrypts the payload of one frame, chunk by chunk; safe to use from several threads."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        if len(nonce) != NONCE_SIZE:
            raise WireError(f"nonce must be {NONCE_SIZE} bytes")
        self._key = hmac.digest(key, DOMAIN + nonce, hashlib.sha256)

    def _context(self, index: int):  # type: ignore[no-untyped-def]  # cryptography's context types are private
        counter = (index << 32).to_bytes(16, "big")
        return Cipher(algorithms.AES(self._key), modes.CTR(counter)).encryptor()

    def seal(self, data: memoryview, first: int = 0) -> bytearray:
        """The ciphertext of ``data``, a chunk-aligned part of a payload starting at chunk ``first``."""
        out = bytearray(len(data))
        view = memoryview(out)
        for i, (a, b) in enumerate(chunk_spans(len(data))):
            self._context(first + i).update_into(data[a:b], view[a:b])
        return out

    def open_in_place(self, data: memoryview, first: int = 0) -> None:
        """Decrypts ``data`` (chunk-aligned, from chunk ``first``) where it lies (CTR is symmetric).

        Through a scratch chunk and back: ``cryptography`` 51 refuses ``update_into`` with overlapping
        input and output ("data and buf must not overlap"), which older releases did in place."""
        scratch = memoryview(bytearray(min(len(data), MAC_CHUNK)))
        for i, (a, b) in enumerate(chunk_spans(len(data))):
            out = scratch[: b - a]
            self._context(first + i).update_into(data[a:b], out)
            data[a:b] = out


def window_spans(nbytes: int, window_chunks: int) -> list[tuple[int, int, int]]:
    """``(start, stop, first_chunk)`` of consecutive windows of ``window_chunks`` MAC chunks."""
    step = window_chunks * MAC_CHUNK
    return [(a, min(a + step, nbytes), a // MAC_CHUNK) for a in range(0, nbytes, step)]


async def write_sealed(
    writer: asyncio.StreamWriter,
    head: bytes,
    plain_head: bytes,
    payload: memoryview,
    mac: FrameMac,
    cipher: PayloadCipher,
    threaded: bool,
) -> None:
    """Writes an encrypted frame (``head`` already carries its head tag; ``plain_head`` is what the
    final tag binds): windows of the payload sealed, and their MAC computed over the ciphertext, in
    worker threads up to ``SEAL_AHEAD`` windows ahead of the socket. On an exception the stream holds
    a partial frame and must be closed by the caller."""

    def seal_window(a: int, b: int, first: int) -> tuple[memoryview, list[bytes]]:
        sealed = memoryview(cipher.seal(payload[a:b], first))
        return sealed, mac.chunk_tags(sealed, first)

    if len(payload) <= SMALL_FRAME:  # one write, as a small plaintext frame
        sealed, tags = seal_window(0, len(payload), 0)
        writer.writelines((head, sealed, mac.finish(plain_head, tags)))
        await writer.drain()
        return
    spans = window_spans(len(payload), THREAD_WINDOW)
    use_threads = threaded and len(payload) >= THREAD_MIN
    loop = asyncio.get_running_loop()
    ahead: deque[asyncio.Future[tuple[memoryview, list[bytes]]]] = deque()
    launched = 0
    tags = []
    try:
        for i, span in enumerate(spans):
            while use_threads and launched < len(spans) and len(ahead) < SEAL_AHEAD:
                ahead.append(loop.run_in_executor(None, seal_window, *spans[launched]))
                launched += 1
            sealed, window_tags = await ahead.popleft() if use_threads else seal_window(*span)
            tags += window_tags
            for start in range(0, len(sealed), WRITE_CHUNK):
                chunk = sealed[start : start + WRITE_CHUNK]
                write_buffers(writer, (head, chunk) if i == 0 and start == 0 else (chunk,))
                await writer.drain()
        writer.write(mac.finish(plain_head, tags))
        await writer.drain()
    finally:
        for future in ahead:
            future.cancel()


async def decrypt(view: memoryview, cipher: PayloadCipher, threaded: bool) -> None:
    """Decrypts an authenticated payload in place, a large one in windows on worker threads."""
    if not threaded or len(view) < THREAD_MIN:
        cipher.open_in_place(view)
        return
    loop = asyncio.get_running_loop()
    await asyncio.gather(
        *(
            loop.run_in_executor(None, cipher.open_in_place, view[a:b], first)
            for a, b, first in window_spans(len(view), THREAD_WINDOW)
        )
    )
