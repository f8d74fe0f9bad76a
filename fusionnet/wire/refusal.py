"""Why a frame was refused, in a form the receiver can count and act on.

Every refusal is a ``WireError`` (the project's error for bad peer input) carrying a short
``reason`` code for the per-job counters, the job and sender the frame *claimed* (unverified unless
the reason says otherwise), and ``in_sync``: whether the byte stream is still positioned at a frame
boundary. A receiver keeps a connection after an in-sync refusal (a frame for a job that just
ended) and closes it otherwise, because after a garbled header or a failed MAC it can no longer
trust any length the stream gives it.
"""

from __future__ import annotations

from fusionnet.errors import WireError

# Reason codes, used as stats keys and in log lines. Kept as plain strings so metrics can export them.
TRUNCATED = "truncated"
BAD_MAGIC = "bad_magic"
HEADER_SIZE = "header_size"
MALFORMED = "malformed_header"
BAD_DTYPE = "bad_dtype"
BAD_SHAPE = "bad_shape"
SIZE_MISMATCH = "size_mismatch"
OVERSIZED = "oversized"
UNKNOWN_JOB = "unknown_job"
SENDER_NOT_ALLOWED = "sender_not_allowed"
SENDER_MISMATCH = "sender_mismatch"
BAD_MAC = "bad_mac"
BAD_VALUE = "bad_value"
HANDLER_ERROR = "handler_error"
WRONG_RECEIVER = "wrong_receiver"
REPLAY = "replay"
TIMEOUT = "timeout"
UNEXPECTED = "unexpected"
PLAINTEXT = "plaintext"  # unencrypted, where the job wants its frames encrypted (``crypt.py``)
BARE = "bare"  # a payload without MAC from anywhere but a loopback peer (``crypt.bare_ok``)

REASONS = (
    TRUNCATED,
    BAD_MAGIC,
    HEADER_SIZE,
    MALFORMED,
    BAD_DTYPE,
    BAD_SHAPE,
    SIZE_MISMATCH,
    OVERSIZED,
    UNKNOWN_JOB,
    SENDER_NOT_ALLOWED,
    SENDER_MISMATCH,
    BAD_MAC,
    BAD_VALUE,
    HANDLER_ERROR,
    WRONG_RECEIVER,
    REPLAY,
    TIMEOUT,
    UNEXPECTED,
    PLAINTEXT,
    BARE,
)


class FrameRefused(WireError):
    """A frame from a peer was refused; ``reason`` is one of ``REASONS``."""

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        job_id: str | None = None,
        sender: str | None = None,
        in_sync: bool = False,
        nbytes: int = 0,
    ) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.job_id = job_id
        self.sender = sender
        self.in_sync = in_sync
        self.nbytes = nbytes  # the payload size the frame claimed, for the refused-bytes counter


class StreamEnded(WireError):
    """The peer closed the stream cleanly between two frames (not a refusal)."""


class PeerUnreachable(WireError):
    """A frame could not be delivered: the peer refused the connection or it broke twice."""
