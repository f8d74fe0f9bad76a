"""The submitter's key: who this user is to a broker (``fusionnet submit``, ``status``, ``cancel``,
``results``). An Ed25519 key made on first use in the submitter's state folder and kept private
(folder 0700, key 0600 from its first byte), like a daemon's identity; its public half, the
submitter id a broker's ``--submitters`` file lists, is written next to it (``submitter.pub``) and
printed by ``fusionnet key``.

Where: ``--key FILE`` of the commands, else ``$FUSIONNET_KEY``, else ``$FUSIONNET_HOME/submitter.key``,
else ``~/.fusionnet/submitter.key``. Two commands started at once on a fresh folder end up with the
same key (the first to link its file wins; the other reads it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fusionnet.dht.identity import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from fusionnet.errors import JobError
from fusionnet.messages.auth import SubmitterAuth, public_bytes, sign_auth, submitter_id

KEY_NAME = "submitter.key"


def default_key_path() -> Path:
    if os.environ.get("FUSIONNET_KEY"):
        return Path(os.environ["FUSIONNET_KEY"])
    home = os.environ.get("FUSIONNET_HOME")
    return (Path(home) if home else Path.home() / ".fusionnet") / KEY_NAME


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def _read(path: Path) -> Ed25519PrivateKey:
    data = path.read_bytes()
    if len(data) != 32:
        raise ValueError(f"not a FusionNet submitter key (32 bytes expected, got {len(data)})")
    return Ed25519PrivateKey.from_private_bytes(data)


def load_or_create_key(path: Path | None = None) -> Ed25519PrivateKey:
    """The key stored at ``path`` (a command's ``--key FILE``; default ``default_key_path()``); a new one
    when there is none. A file that is no key, or cannot be read or made, is the user's input: ``JobError``
    naming where the path came from (exit 2, one line), never an internal error of every command."""
    where = "--key"
    if path is None:
        where = "$FUSIONNET_KEY" if os.environ.get("FUSIONNET_KEY") else "submitter key"
    path = default_key_path() if path is None else Path(path)
    try:
        return _load_or_create(path)
    except IsADirectoryError:
        raise JobError(f"{where} {path}: is a directory, not a key file") from None
    except (FileExistsError, NotADirectoryError):  # from making its folder: a file is in the way
        raise JobError(f"{where} {path}: cannot create it ({path.parent} is not a directory)") from None
    except OSError as e:
        raise JobError(f"{where} {path}: cannot read or create it ({e.strerror or e})") from None
    except ValueError as e:  # a file of the wrong size; a NUL byte in the path
        raise JobError(f"{where} {path}: {e}") from None


def _load_or_create(path: Path) -> Ed25519PrivateKey:
    if path.exists():
        return _read(path)
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_raw(key))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces: a key another process linked first wins
        except FileExistsError:
            return _read(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    pub = path.with_name(path.stem + ".pub")
    with contextlib.suppress(OSError):
        pub.write_text(submitter_id(public_bytes(key)) + "\n")
    return key


@dataclass(frozen=True)
class Signer:
    """Signs one client's calls to one broker (``messages.auth``)."""

    key: Ed25519PrivateKey
    broker: str
    caller: str  # this client's libp2p peer id

    @property
    def submitter_id(self) -> str:
        return submitter_id(public_bytes(self.key))

    def auth(self, scope: str, subject: str = "") -> SubmitterAuth:
        return sign_auth(self.key, broker=self.broker, caller=self.caller, scope=scope, subject=subject)
