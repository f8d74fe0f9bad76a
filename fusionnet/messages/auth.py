"""Submitter signatures: who submitted a job, and who may look at it, cancel it or fetch its results.

A submitter holds an Ed25519 key (``runtime.submitter``). Each of its calls about jobs carries a
``SubmitterAuth``: its public key, an expiry and a signature over

    DOMAIN || msgpack([broker peer id, caller peer id, scope, subject, expires])

where ``scope`` is the RPC method and ``subject`` the job id (``job_status``, ``job_results``,
``cancel_job``), the submission digest (``submit_job``, ``submission_digest``: the spec and hashes of
IR, state and data) or empty (``status``). Binding the broker's and the caller's libp2p peer ids (the
caller's is authenticated by libp2p on every call) means a signature is good for one broker, from one
connection: a captured or leaked one cannot be replayed by anybody else, and it lapses after
``MAX_AUTH_LIFETIME`` seconds. A submitter is known by ``submitter_id``: the hex of its public key.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Annotated

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import Field

from fusionnet.errors import JobError
from fusionnet.messages.base import Message

DOMAIN = b"fusionnet/submitter-auth/1\x00"
MAX_AUTH_LIFETIME = 600.0  # s a signature may be valid for
CLOCK_SKEW = 60.0  # s of clock difference tolerated between submitter and broker
KEY_BYTES = 32


class SubmitterAuth(Message):
    key: Annotated[bytes, Field(min_length=KEY_BYTES, max_length=KEY_BYTES)]  # Ed25519 public key, raw
    expires: float  # unix time
    signature: Annotated[bytes, Field(min_length=64, max_length=64)]


def submitter_id(public: bytes) -> str:
    """How a submitter is named (allowlists, logs, job rows): the hex of its raw public key."""
    return public.hex()


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _message(broker: str, caller: str, scope: str, subject: str, expires: float) -> bytes:
    return DOMAIN + msgpack.packb([broker, caller, scope, subject, float(expires)], use_bin_type=True)


def sign_auth(
    key: Ed25519PrivateKey,
    *,
    broker: str,
    caller: str,
    scope: str,
    subject: str = "",
    lifetime: float = 300.0,
) -> SubmitterAuth:
    expires = time.time() + min(lifetime, MAX_AUTH_LIFETIME - CLOCK_SKEW)
    signature = key.sign(_message(broker, caller, scope, subject, expires))
    return SubmitterAuth(key=public_bytes(key), expires=expires, signature=signature)


def verify_auth(
    auth: SubmitterAuth | None, *, broker: str, caller: str, scope: str, subject: str = ""
) -> str:
    """The submitter id ``auth`` proves for this call, or a ``JobError`` saying why it proves nothing."""
    if auth is None:
        raise JobError(f"{scope}: the request is not signed by a submitter key (update fusionnet)")
    now = time.time()
    if not now - CLOCK_SKEW <= auth.expires <= now + MAX_AUTH_LIFETIME:
        raise JobError(f"{scope}: the submitter signature has expired or lives too long (clock off?)")
    try:
        Ed25519PublicKey.from_public_bytes(auth.key).verify(
            auth.signature, _message(broker, caller, scope, subject, auth.expires)
        )
    except (InvalidSignature, ValueError):
        raise JobError(f"{scope}: bad submitter signature (not for this broker, caller or request)") from None
    return submitter_id(auth.key)


def submission_digest(
    spec: dict[str, object],
    ir: bytes,
    state: bytes,
    data: bytes,
    request_id: str,
    *,
    state_sha256: bytes | None = None,
) -> str:
    """What a submission signature covers: the run spec and the hashes of its IR, state and data.
    ``state_sha256``: the state's hash when it came in a chunked upload (``state`` is then empty)."""
    h = hashlib.sha256()
    h.update(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode())
    h.update(hashlib.sha256(ir).digest())
    h.update(hashlib.sha256(state).digest() if state_sha256 is None else state_sha256)
    for part in (data, request_id.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()
