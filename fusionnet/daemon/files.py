"""The files a daemon owns: its state directory (locked while it runs) and its address file.

State folders are 0700 and a daemon process runs under umask 077 (``apply_private_umask``).

The address file is the readiness signal scripts wait for: it appears (atomically: written to a temporary
name, then renamed) only once the daemon is fully up, holds its visible multiaddrs one per line, and is
removed again on shutdown so a stale file never points at a dead peer.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("fusionnet.daemon.files")

PRIVATE_DIR_MODE = 0o700
# A daemon process creates every file 0600 and folder 0700 (job files, checkpoints, results, the
# database, profile caches): they hold other people's models and data.
PRIVATE_UMASK = 0o077


def apply_private_umask() -> int:
    """Makes every file this process creates from now on private to its user; returns the old umask.

    Called once by a daemon process's entry point (``Daemon.serve``), before anything is written, so
    that files are private from creation rather than ``chmod``-ed after their content is on disk."""
    return os.umask(PRIVATE_UMASK)


def write_address_file(path: Path, maddrs: list[str]) -> None:
    if not maddrs:
        raise ValueError("no visible multiaddrs to write to the address file")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{m}\n" for m in maddrs))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_address_file(path: Path) -> list[str]:
    """The multiaddrs in an address file (empty lines and ``#`` comments skipped)."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


class StateDir:
    """A daemon's state directory, exclusively locked (``flock``) while the daemon runs, so that two daemons
    never share an identity, a profile cache or a database. Without ``--state-dir`` a temporary directory
    is used and removed on exit."""

    def __init__(self, path: Path | None, role: str):
        self.temporary = path is None
        self.role = role
        self._path = None if path is None else Path(path)
        self._lock_fd: int | None = None

    @property
    def path(self) -> Path:
        assert self._path is not None, "the state dir exists once acquire() has run"
        return self._path

    def acquire(self) -> None:
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix=f"fusionnet-{self.role}-"))
        try:
            # 0700 from creation (parents are the operator's business); mkdtemp already makes 0700
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--state-dir {self.path}: cannot create it ({e.strerror})") from e
        try:
            mode = stat.S_IMODE(self.path.stat().st_mode)
            if mode & 0o077:  # a folder from an older version, or made by hand: keys and jobs live here
                log.warning(
                    "--state-dir %s was readable by others (mode %o): restricting it to 0700", self.path, mode
                )
                os.chmod(self.path, PRIVATE_DIR_MODE)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:  # a read-only file system, a folder of another user's
            raise ValueError(f"--state-dir {self.path}: cannot use it ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ValueError(f"--state-dir {self.path}: in use by another daemon (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if self.temporary:
            log.info(
                "no --state-dir given: using %s (removed on exit; identity and caches are not kept)",
                self.path,
            )

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)

    def file(self, name: str) -> Path:
        return self.path / name
