"""What a receiver knows of the jobs it serves (``receiver.FrameReceiver``): each job's route (keys,
allowed senders, callback), its counters, the connection timeouts, and which errors are a failure on
our side rather than a peer's bytes (``is_local_failure``). Pure data, no I/O.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from fusionnet.errors import WireError
from fusionnet.wire.frames import TensorFrame

FrameHandler = Callable[[TensorFrame], Awaitable[None] | None]
# Stats bucket for refusals that cannot be charged to a registered job (unreadable header, unknown job).
NO_JOB = "<no job>"
# Jobs remembered after they end, so that their late frames are skipped rather than closing a
# connection that other jobs share; a frame of any other unknown job closes its connection.
MAX_ENDED_JOBS = 1024


# What torch, numpy and the interpreter say when an allocation fails: torch's CPU allocator ("can't
# allocate memory", the form RLIMIT_DATA gives; "not enough memory: you tried to allocate" elsewhere),
# CUDA's and MPS's "out of memory", numpy's "unable to allocate", C++'s bad_alloc, and a thread the
# threaded MAC could not start (its stack is memory of the same budget). Narrow on purpose: a decoder's
# complaint about a peer's bytes must stay a refusal.
_ALLOCATION_FAILED = re.compile(
    r"(can't|cannot|could not|unable to|failed to|tried to) allocate|out of memory|not enough memory"
    r"|bad_alloc|can't start new thread",
    re.IGNORECASE,
)


def is_local_failure(error: BaseException) -> bool:
    """Whether ``error`` is this process failing to allocate (memory, or a thread), not anything about a
    peer's bytes: the frame being read is lost through no fault of its sender."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and bool(_ALLOCATION_FAILED.search(str(error)))


@dataclass
class JobStats:
    """Counters of one job on one receiver. ``frames_refused`` maps a reason code to a count."""

    frames_accepted: int = 0
    bytes_accepted: int = 0
    frames_refused: dict[str, int] = field(default_factory=dict)
    bytes_refused: int = 0

    @property
    def refused_total(self) -> int:
        return sum(self.frames_refused.values())

    def as_dict(self) -> dict[str, object]:
        return {
            "frames_accepted": self.frames_accepted,
            "bytes_accepted": self.bytes_accepted,
            "frames_refused": dict(sorted(self.frames_refused.items())),
            "bytes_refused": self.bytes_refused,
        }


@dataclass(frozen=True)
class JobRoute:
    key: bytes | Mapping[str, bytes]  # one job-wide key, or the key of each sender's link to us
    allowed_senders: frozenset[str]
    on_frame: FrameHandler
    encryption: str = "auto"  # ``placement.wire_encryption``: which plaintext frames are refused
    # the sequence-number lanes accepted (None: all); two readers of one job split them (``handoff.py``)
    lanes: frozenset[int] | None = None


@dataclass(frozen=True)
class Timeouts:
    """Seconds a connection may take: to its first frame, between frames, and per read in a frame."""

    handshake: float = 10.0
    # Long: a sub-task may compute for minutes between two frames on a pooled connection, and a
    # close that crosses a frame in flight loses that frame. Stalled attackers are cut by the
    # handshake timeout and the connection caps long before this.
    idle: float = 1800.0
    progress: float = 30.0

    def __post_init__(self) -> None:
        if not all(t > 0 for t in (self.handshake, self.idle, self.progress)):
            raise WireError(f"timeouts must be > 0 seconds, got {self}")
