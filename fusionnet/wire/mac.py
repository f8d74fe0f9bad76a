"""Frame authentication: a keyed MAC over prefix, header and payload that keeps up with GB/s streams.

Why not one HMAC-SHA256 over the whole frame: measured on this project's machines it runs at
~1 GB/s per core, the same order as loopback TCP, so it would halve the data path's throughput on
both ends. AES-GMAC (OpenSSL through ``cryptography``, a project dependency) runs at ~7 GB/s and
releases the GIL, so the receiver can authenticate chunk *i* in a worker thread while chunk *i+1*
is still arriving, and the sender while it writes. HMAC-SHA256 stays where it is cheap: deriving
the per-frame key and binding everything together.

Construction, per frame (``nonce``: 16 random bytes carried in the header)::

    subkey   = HMAC-SHA256(job_key, DOMAIN || nonce)
    head_tag = HMAC-SHA256(subkey, "H" || prefix || header)
    t_i      = GMAC(subkey, iv = i as 12 big-endian bytes, data = payload[i*MAC_CHUNK : (i+1)*MAC_CHUNK])
    tag      = HMAC-SHA256(subkey, "F" || prefix || header || t_0 || ... || t_{n-1})

``head_tag`` travels right after the header, so a receiver authenticates the sizes a frame claims
before it allocates a buffer for the payload: a peer without the key cannot make it allocate
anything. A fresh subkey per frame keeps GCM's IVs (the chunk index) unique per key; the final tag
binds the lengths, the header, and the number and order of chunks. Tags are compared in constant
time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fusionnet.errors import WireError

DOMAIN = b"fusionnet/wire/v1 frame key"
MAC_CHUNK = 1 << 20
TAG_SIZE = 32
NONCE_SIZE = 16
MIN_KEY_SIZE = 16
MAX_KEY_SIZE = 1024
# I/O tuning of frames (``frames.py``, ``crypt.py``), here because it is sized by what MACs cost.
WRITE_CHUNK = 1 << 20
# From this size on, chunk MACs are computed in worker threads (GMAC releases the GIL), in parallel
# with the socket I/O. Smaller payloads are authenticated inline, chunk by chunk as they arrive: a
# hop to a thread costs about what GMAC of a MiB does, and inline hashing of chunk i still overlaps
# with the kernel receiving chunk i+1.
THREAD_MIN = 8 * MAC_CHUNK
# A receiver hands chunks to threads in windows of this many: one hop per window, not per chunk.
THREAD_WINDOW = 4
# Up to this payload size a frame goes out in one write with its MAC computed first.
SMALL_FRAME = 256 * 1024


LINK_DOMAIN = b"fusionnet/wire/v1 link key"


def link_key(job_key: bytes, a: int, b: int) -> bytes:
    """The key of the link between sub-DAGs ``a`` and ``b`` of a job (either direction): the broker
    hands each compnode only the keys of its own links, so a compnode of the job cannot forge a frame
    between two others (with one job-wide key any member could claim to be any other)."""
    low, high = sorted((a, b))
    if low < 0 or low == high:
        raise WireError(f"no link between sub-DAGs {a} and {b}")
    label = LINK_DOMAIN + low.to_bytes(4, "big") + high.to_bytes(4, "big")
    return hmac.new(check_key(job_key), label, hashlib.sha256).digest()


def check_key(key: object, where: str = "job key") -> bytes:
    """Returns ``key`` as bytes, or raises ``WireError`` if it is too short to be a secret."""
    if not isinstance(key, bytes | bytearray):
        raise WireError(f"{where} must be bytes, got {type(key).__name__}")
    if not MIN_KEY_SIZE <= len(key) <= MAX_KEY_SIZE:
        raise WireError(f"{where} must be {MIN_KEY_SIZE}..{MAX_KEY_SIZE} bytes, got {len(key)}")
    return bytes(key)


def chunk_spans(nbytes: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` payload ranges that get one GMAC each (none for an empty payload)."""
    return [(start, min(start + MAC_CHUNK, nbytes)) for start in range(0, nbytes, MAC_CHUNK)]


class FrameMac:
    """The authenticator of one frame. ``chunk_tag`` may run in worker threads concurrently."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        assert len(nonce) == NONCE_SIZE
        self._subkey = hmac.digest(key, DOMAIN + nonce, hashlib.sha256)

    def chunk_tag(self, index: int, data: bytes | bytearray | memoryview) -> bytes:
        # A new AESGCM per call: it costs microseconds and makes concurrent calls from threads safe.
        return AESGCM(self._subkey).encrypt(index.to_bytes(12, "big"), b"", data)

    def chunk_tags(self, data: memoryview, first: int = 0) -> list[bytes]:
        """Tags of the chunks of ``data``: a chunk-aligned part of a payload, from chunk ``first`` on."""
        return [self.chunk_tag(first + i, data[a:b]) for i, (a, b) in enumerate(chunk_spans(len(data)))]

    def head_tag(self, head: bytes) -> bytes:
        return hmac.digest(self._subkey, b"H" + head, hashlib.sha256)

    def verify_head(self, head: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.head_tag(head), tag)

    def finish(self, head: bytes, chunk_tags: Sequence[bytes]) -> bytes:
        h = hmac.new(self._subkey, b"F" + head, hashlib.sha256)
        for t in chunk_tags:
            h.update(t)
        return h.digest()

    def verify(self, head: bytes, chunk_tags: Sequence[bytes], tag: bytes) -> bool:
        return hmac.compare_digest(self.finish(head, chunk_tags), tag)
