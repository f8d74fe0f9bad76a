"""Submission state that arrives in chunks (``upload_state``) before the ``submit_job`` that names it.

A model of hundreds of millions of parameters is a state blob of hundreds of MB: sent inside the
submission, the broker held it whole (twice, while decoding the message). Uploaded in chunks of at
most ``UPLOAD_CHUNK_BYTES``, it goes to a file as it comes; the submission then names the upload, the
broker hashes the file (the submitter's signature covers that hash, as it would the inline state's)
and moves it into the job's folder. Nothing of it is held in memory beyond one chunk.

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

import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.errors import JobError

UPLOAD_TTL = 3600.0
TAKEN_KEPT = 64  # uploads taken into jobs whose (submitter, size, hash) a repeated submission may ask for
MAX_UPLOADS_PER_SUBMITTER = 2
HASH_BLOCK = 8 << 20


@dataclass
class Upload:
    submitter: str
    total: int
    path: Path
    size: int = 0
    touched: float = field(default_factory=time.monotonic)
    digest: bytes | None = None  # sha256 of the complete upload, once computed


class StateUploads:
    def __init__(self, folder: Path, ttl: float = UPLOAD_TTL) -> None:
        self.folder, self.ttl = folder, ttl
        shutil.rmtree(folder, ignore_errors=True)  # a restarted broker's uploads are gone with it
        folder.mkdir(parents=True, exist_ok=True)
        self._uploads: dict[str, Upload] = {}
        self._taken: dict[str, tuple[str, int, bytes]] = {}  # upload id -> (submitter, size, sha256)

    def append(
        self, submitter: str, upload_id: str, offset: int, total: int, data: bytes, max_bytes: int
    ) -> int:
        """Writes ``data`` at ``offset``; returns the bytes held. A chunk out of order is refused, a
        repeated one (its call was retried) accepted without change."""
        self.expire()
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
        if end <= upload.size:
            return upload.size  # a repeat of a chunk already written
        if offset != upload.size:
            raise JobError(f"{where}: a chunk at byte {offset}, the broker holds {upload.size} bytes")
        with upload.path.open("ab") as f:
            f.write(data)
        upload.size = end
        return upload.size

    def sha256(self, upload_id: str) -> tuple[str, int, bytes]:
        """The submitter, size and hash of a complete upload (read from disk, a block at a time), or of
        one taken into a job lately (a repeated submission)."""
        if upload_id not in self._uploads and upload_id in self._taken:
            return self._taken[upload_id]
        upload = self._complete(upload_id)
        h = hashlib.sha256()
        with upload.path.open("rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        upload.digest = h.digest()
        return upload.submitter, upload.total, upload.digest

    def take(self, upload_id: str, submitter: str, dest: Path) -> None:
        """Moves the complete upload to ``dest`` (the job's state file); the upload is gone after."""
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
        upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            upload.path.unlink(missing_ok=True)

    def expire(self) -> None:
        now = time.monotonic()
        for upload_id in [k for k, u in self._uploads.items() if now - u.touched > self.ttl]:
            self.drop(upload_id)

    def _complete(self, upload_id: str) -> Upload:
        upload = self._uploads.get(upload_id)
        if upload is None:
            raise JobError(f"upload {upload_id}: no such upload (expired, or the broker restarted)")
        if upload.size != upload.total:
            raise JobError(f"upload {upload_id}: incomplete ({upload.size} of {upload.total} bytes)")
        return upload
