"""Submission state that arrives in chunks (``upload_state``) before the ``submit_job`` that names it.

A model of hundreds of millions of parameters is a state blob of hundreds of MB: sent inside the
submission, the broker held it whole (twice, while decoding the message). Uploaded in chunks of at
most ``UPLOAD_CHUNK_BYTES``, it goes to a file as it comes; the submission then names the upload, the
broker hashes the file (the submitter's signature covers that hash, as it would the inline state's)
and moves it into the job's folder. Nothing of it is held in memory beyond one chunk.

The first chunk starts the upload at byte 0; the others may come in any order (a submitter keeps a
few calls in flight: one after the other, each chunk's trip through p2pd, its decoding and its write
left the others idle). Each is written at its offset; the broker keeps the spans it holds, takes a
chunk that lies within them as a repeat (a retried call) without writing it, and refuses one that
overlaps them partly or would leave more than ``MAX_SPANS`` separate spans. The upload is complete
when one span covers it. Calls run on worker threads, so the books are kept under a lock. The bytes
from 0 up to the first gap are hashed as that prefix grows (``_hash_prefix``), so the submission
finds the upload's SHA-256 ready instead of reading it all back.

Each upload belongs to the submitter who started it (only that key may add to it or submit it), is
bounded by ``--max-submission-mb``, and is dropped when untouched for ``UPLOAD_TTL`` seconds; a
submitter has at most ``MAX_UPLOADS_PER_SUBMITTER`` under way. Uploads live in memory and on disk
only until the broker restarts: the submitter then starts again.

A submission's call may come twice (the RPC client repeats a call whose stream closed before the
answer came), after the first one took the upload into its job: the submitter, size and hash of an
upload taken lately are kept (``TAKEN_KEPT``), so the repeat passes the signature check and gets the
job the first call made instead of "no such upload".
"""

from __future__ import annotations

import bisect
import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fusionnet.errors import JobError

UPLOAD_TTL = 3600.0
TAKEN_KEPT = 64  # uploads taken into jobs whose (submitter, size, hash) a repeated submission may ask for
MAX_UPLOADS_PER_SUBMITTER = 2
HASH_BLOCK = 8 << 20
MAX_SPANS = 64  # separate spans of bytes one upload may hold at once (chunks in flight leave gaps)


@dataclass
class Upload:
    submitter: str
    total: int
    path: Path
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) held, sorted, apart
    touched: float = field(default_factory=time.monotonic)
    digest: bytes | None = None  # sha256 of the complete upload, once computed
    # SHA-256 of the bytes from 0 up to ``hashed``, fed as the held prefix grows
    hasher: Any = field(default_factory=hashlib.sha256)
    hashed: int = 0

    @property
    def size(self) -> int:
        """Bytes held."""
        return sum(end - start for start, end in self.spans)

    def holds(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.spans, (start, float("inf"))) - 1
        return i >= 0 and self.spans[i][0] <= start and end <= self.spans[i][1]

    def add(self, start: int, end: int, where: str) -> None:
        """Notes ``[start, end)`` as held, merged with the spans it touches; ``JobError`` when it
        overlaps a held span or would leave more than ``MAX_SPANS`` of them."""
        i = bisect.bisect_left(self.spans, (start, start))
        before = self.spans[i - 1] if i else None
        after = self.spans[i] if i < len(self.spans) else None
        if (before is not None and before[1] > start) or (after is not None and after[0] < end):
            raise JobError(f"{where}: a chunk at bytes {start}-{end} overlaps bytes the broker holds")
        lo, hi, first, last = start, end, i, i
        if before is not None and before[1] == start:
            lo, first = before[0], i - 1
        if after is not None and after[0] == end:
            hi, last = after[1], i + 1
        spans = [*self.spans[:first], (lo, hi), *self.spans[last:]]
        if len(spans) > MAX_SPANS:
            raise JobError(f"{where}: a chunk at byte {start} would leave more than {MAX_SPANS} gaps")
        self.spans = spans


class StateUploads:
    def __init__(self, folder: Path, ttl: float = UPLOAD_TTL) -> None:
        self.folder, self.ttl = folder, ttl
        shutil.rmtree(folder, ignore_errors=True)  # a restarted broker's uploads are gone with it
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # calls run on worker threads, several at once
        self._uploads: dict[str, Upload] = {}
        self._taken: dict[str, tuple[str, int, bytes]] = {}  # upload id -> (submitter, size, sha256)

    def append(
        self, submitter: str, upload_id: str, offset: int, total: int, data: bytes, max_bytes: int
    ) -> int:
        """Writes ``data`` at ``offset``; returns the bytes held. The first chunk must start at 0, the
        others come in any order; a repeated one (its call was retried) is accepted without change."""
        with self._lock:
            return self._append(submitter, upload_id, offset, total, data, max_bytes)

    def _append(
        self, submitter: str, upload_id: str, offset: int, total: int, data: bytes, max_bytes: int
    ) -> int:
        self._expire()
        where = f"upload {upload_id}"
        if total > max_bytes:
            raise JobError(
                f"{where}: {total} bytes of state exceed this broker's limit of {max_bytes} "
                "(--max-submission-mb)"
            )
        upload = self._uploads.get(upload_id)
        if upload is None:
            if offset != 0:
                raise JobError(f"{where}: no such upload (expired, or the broker restarted): start again")
            mine = sum(1 for u in self._uploads.values() if u.submitter == submitter)
            if mine >= MAX_UPLOADS_PER_SUBMITTER:
                raise JobError(f"{where}: this submitter has {mine} uploads under way already")
            upload = Upload(submitter, total, self.folder / f"{upload_id}.part")
            upload.path.write_bytes(b"")
            self._uploads[upload_id] = upload
        elif upload.submitter != submitter:
            raise JobError(f"{where}: no such upload (expired, or the broker restarted): start again")
        if total != upload.total:
            raise JobError(f"{where}: {total} bytes announced, {upload.total} at its start")
        end = offset + len(data)
        if end > upload.total:
            raise JobError(f"{where}: a chunk ending at byte {end} of {upload.total}")
        upload.touched = time.monotonic()
        if upload.holds(offset, end):
            return upload.size  # a repeat of a chunk already written
        upload.add(offset, end, where)  # (refused before a byte is written)
        with upload.path.open("r+b") as f:
            f.seek(offset)
            f.write(data)
            _hash_prefix(upload, f, offset, data)
        return upload.size

    def sha256(self, upload_id: str) -> tuple[str, int, bytes]:
        """The submitter, size and hash of a complete upload (read from disk, a block at a time), or of
        one taken into a job lately (a repeated submission)."""
        with self._lock:
            if upload_id not in self._uploads and upload_id in self._taken:
                return self._taken[upload_id]
            upload = self._complete(upload_id)  # complete: no chunk writes to it any more
            if upload.digest is None and upload.hashed == upload.total:  # hashed as it came
                upload.digest = upload.hasher.digest()
        if upload.digest is None:
            h = hashlib.sha256()
            with upload.path.open("rb") as f:
                while block := f.read(HASH_BLOCK):
                    h.update(block)
            upload.digest = h.digest()
        return upload.submitter, upload.total, upload.digest

    def take(self, upload_id: str, submitter: str, dest: Path) -> None:
        """Moves the complete upload to ``dest`` (the job's state file); the upload is gone after."""
        with self._lock:
            self._take(upload_id, submitter, dest)

    def _take(self, upload_id: str, submitter: str, dest: Path) -> None:
        upload = self._complete(upload_id)
        if upload.submitter != submitter:
            raise JobError(f"upload {upload_id}: no such upload (expired, or the broker restarted)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(upload.path, dest)
        del self._uploads[upload_id]
        if upload.digest is not None:
            self._taken[upload_id] = (upload.submitter, upload.total, upload.digest)
            for old in list(self._taken)[:-TAKEN_KEPT]:
                del self._taken[old]

    def drop(self, upload_id: str) -> None:
        with self._lock:
            self._drop(upload_id)

    def _drop(self, upload_id: str) -> None:
        upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            upload.path.unlink(missing_ok=True)

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for upload_id in [k for k, u in self._uploads.items() if now - u.touched > self.ttl]:
            self._drop(upload_id)

    def _complete(self, upload_id: str) -> Upload:
        upload = self._uploads.get(upload_id)
        if upload is None:
            raise JobError(f"upload {upload_id}: no such upload (expired, or the broker restarted)")
        if upload.size != upload.total:
            raise JobError(f"upload {upload_id}: incomplete ({upload.size} of {upload.total} bytes)")
        return upload


def _hash_prefix(upload: Upload, f: BinaryIO, offset: int, data: bytes) -> None:
    """Feeds ``upload.hasher`` what the chunk just written at ``offset`` adds to the held prefix: the
    chunk itself when it starts where the hash stands, then any chunks written ahead of it (read back),
    so the submission finds the upload hashed instead of reading it all again (seconds per GB)."""
    if offset != upload.hashed:
        return  # ahead of the prefix: hashed when the chunks before it come
    upload.hasher.update(data)
    upload.hashed += len(data)
    prefix_end = upload.spans[0][1]  # the span from 0, which this chunk joined
    f.seek(upload.hashed)
    while upload.hashed < prefix_end:
        block = f.read(min(HASH_BLOCK, prefix_end - upload.hashed))
        upload.hasher.update(block)
        upload.hashed += len(block)
