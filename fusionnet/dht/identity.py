"""A peer's identity: one RSA key that is both its libp2p identity (its peer id) and its record signer.

hivemind's ``RSASignatureValidator`` makes a record's subkey ``<peer id>[owner:<RSA public key>]``
writable only by the holder of that key. On its own that proves nothing about the peer id in front
of the marker: any peer could write ``<victim id>[owner:<its own key>]``. Signing records with the
*libp2p identity* closes that gap: a peer id is the hash of the identity's public key, so
``owner_peer_id(marker)`` recomputes the id from the owner key, and a record whose peer id differs
from its owner's is somebody else's claim and is ignored (``announce.py``).

Key files are written private from creation (``write_private``: ``O_CREAT | O_EXCL`` with mode
0600, then an atomic rename), never written first and ``chmod``-ed after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_OWNER_CACHE_SIZE = 4096


def write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` readable by this user only, from the first byte on."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crash of this same pid number: never follow or reuse it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _wrap(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def identity_bytes(key: RSAPrivateKey) -> bytes:
    """The libp2p identity file's content (what ``p2pd -id`` reads) for ``key``."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def load_or_create_identity(path: Path) -> RSAPrivateKey:
    """The RSA identity stored at ``path``; a new one (written 0600) when the file does not exist."""
    if not path.exists():
        key = RSAPrivateKey()
        write_private(path, identity_bytes(key))
        return key
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA identity")
        key = serialization.load_der_private_key(proto.data, password=None)
    except Exception as e:  # protobuf and cryptography raise several types
        raise ValueError(f"{path}: not a libp2p RSA identity ({e}); delete it to make a new one") from e
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: not an RSA private key")
    return _wrap(key)


def peer_id_of(key: RSAPrivateKey) -> str:
    return PeerID.from_identity(identity_bytes(key)).to_base58()


def _peer_id_of_public(public: rsa.RSAPublicKey) -> str:
    der = public.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


_owner_cache: OrderedDict[bytes, str | None] = OrderedDict()


def owner_peer_id(owner_key: bytes) -> str | None:
    """The peer id whose identity is the RSA public key ``owner_key`` (OpenSSH form, as in the
    ``[owner:...]`` marker); ``None`` when it is not a valid RSA key. Cached: lookups repeat."""
    if owner_key in _owner_cache:
        _owner_cache.move_to_end(owner_key)
        return _owner_cache[owner_key]
    try:
        peer: str | None = _peer_id_of_public(RSAPublicKey.from_bytes(owner_key)._public_key)
    except Exception:  # cryptography raises several types on a malformed key
        peer = None
    _owner_cache[owner_key] = peer
    if len(_owner_cache) > _OWNER_CACHE_SIZE:
        _owner_cache.popitem(last=False)
    return peer


__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "identity_bytes",
    "load_or_create_identity",
    "owner_peer_id",
    "peer_id_of",
    "write_private",
]
